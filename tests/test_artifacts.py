"""compile_model writes an artifact directory that a fresh process loads without tracing or compiling;
every tampered or mismatched artifact is refused with an ArtifactError naming what differs, before
anything in it is loaded.

The tiny model is compiled once per session (the `artifact` fixture in conftest.py); the
corruption tests edit private copies of it (`art`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch

import graphkiln
from artifact_helpers import (
    COMPILED,
    ENGINE,
    GREEDY,
    PROMPTS,
    RESULT_PREFIX,
    SMALL_CONFIG,
    SMALL_ENGINE,
    edit_manifest,
    greedy_tokens,
    plant_marker_kernel,
    run_python_json,
    set_torch_version,
)
from graphkiln.compiler.artifact_load import check_artifact
from graphkiln.compiler.graph_file import read_graph
from graphkiln.compiler.manifest import FORMAT_VERSION, foreign_content
from graphkiln.errors import ArtifactError, ConfigError
from graphkiln.models.tiny import tiny_model_dir

pytestmark = pytest.mark.slow


def piece_files(out: Path) -> list[Path]:
    return sorted((out / "pieces").rglob("*.bin"))


# ---------------------------------------------------------------- load in a fresh process


def test_fresh_process_loads_without_tracing_or_compiling(
    artifact: Path, eager_tokens: list[list[int]], tmp_path: Path
) -> None:
    """A fresh process with an empty Inductor cache (a fresh machine): no trace, no compile, no gcc."""
    fresh_cache = tmp_path / "inductor-cache"
    code = f"""
import os
os.environ["TORCHINDUCTOR_CACHE_DIR"] = {str(fresh_cache)!r}
import json, sys, torch
torch.set_num_threads(1)
import graphkiln
from graphkiln.compiler.counters import torch_compile_events
from graphkiln.compiler.manifest import FORMAT_VERSION
before = torch_compile_events()
llm = graphkiln.load({str(artifact)!r}, **{ENGINE!r})
llm.wait_compiled()  # the pieces load in the background: the tokens below are theirs
outs = llm.generate({PROMPTS!r}, graphkiln.{GREEDY!r})
text = llm.generate(["Hello there"], graphkiln.{GREEDY!r})[0]
print({RESULT_PREFIX!r} + json.dumps({{"before": before, "after": torch_compile_events(),
      "tokens": [o.token_ids for o in outs], "text": [text.prompt_token_ids, text.text],
      "transformers": "transformers" in sys.modules}}))
"""
    result = run_python_json(code)
    assert not result["transformers"]  # config and tokenizer come from the artifact: seconds saved
    reference = graphkiln.LLM.eager("tiny", **ENGINE).generate(["Hello there"], GREEDY)[0]
    assert result["text"] == [reference.prompt_token_ids, reference.text]
    assert result["before"] == {"dynamo_graphs": 0, "inductor_compiles": 0, "inductor_cache_loads": 0}
    after = result["after"]
    assert after["dynamo_graphs"] == 0, after
    assert after["inductor_compiles"] == 0, after
    assert after["inductor_cache_loads"] > 0, after  # the pieces really came from the artifact
    assert result["tokens"] == eager_tokens
    assert [len(t) for t in eager_tokens] == [GREEDY.max_tokens] * len(PROMPTS)
    shipped = {p.relative_to(artifact / "cpu-kernels") for p in (artifact / "cpu-kernels").rglob("*.so")}
    assert shipped, "compile-model on the CPU ships its compiled C++ kernels"
    # The kernels go to the artifact's own folder of the cache, and gcc built nothing there or anywhere else.
    (own,) = (fresh_cache / "graphkiln-artifacts").iterdir()
    assert {p.relative_to(own) for p in fresh_cache.rglob("*.so")} == shipped


def test_a_compile_after_a_load_in_one_process_ships_what_a_fresh_process_needs(
    artifact: Path, eager_tokens: list[list[int]], tmp_path: Path
) -> None:
    """A CPU compile in a process that has loaded (and compiled) before ships every C++ library a fresh process
    with an empty Inductor cache loads, the CPU vector-ISA check's among them: Inductor remembers that check's
    answer per process, and without its library a machine with no compiler would build every kernel anew."""
    with graphkiln.load(artifact, **COMPILED) as llm:
        assert greedy_tokens(llm) == eager_tokens
    out = tmp_path / "again"
    graphkiln.compile_model("tiny", out, SMALL_CONFIG, engine=SMALL_ENGINE)
    fresh_cache = tmp_path / "inductor-cache"
    code = f"""
import os
os.environ["TORCHINDUCTOR_CACHE_DIR"] = {str(fresh_cache)!r}
import json, graphkiln
from graphkiln.compiler.counters import torch_compile_events
llm = graphkiln.load({str(out)!r}, **{ENGINE!r})
llm.wait_compiled()
tokens = [o.token_ids for o in llm.generate({PROMPTS!r}, graphkiln.{GREEDY!r})]
print({RESULT_PREFIX!r} + json.dumps({{"events": torch_compile_events(), "tokens": tokens}}))
"""
    result = run_python_json(code)
    assert result["tokens"] == eager_tokens and result["events"]["inductor_compiles"] == 0
    shipped = {p.relative_to(out / "cpu-kernels") for p in (out / "cpu-kernels").rglob("*.so")}
    (own,) = (fresh_cache / "graphkiln-artifacts").iterdir()
    assert {p.relative_to(own) for p in fresh_cache.rglob("*.so")} == shipped


def test_forgetting_the_vector_isa_checks_forgets_the_avx512_bf16_answer_too() -> None:
    """On a CPU with AVX-512 BF16 the check leaves its answer on Inductor's ISA object; kept, a second check would
    build its probes with the flag added, under other keys than a fresh process's (seen on such a CPU: the
    test above then found two probe libraries the artifact lacked). Set here by hand, on any CPU."""
    from torch._inductor import cpu_vec_isa

    from graphkiln.compat import forget_vec_isa_checks

    avx512 = next(isa for isa in cpu_vec_isa.supported_vec_isa_list if type(isa) is cpu_vec_isa.VecAVX512)
    forget_vec_isa_checks()  # what an earlier compile in this process found
    flags = avx512.build_arch_flags()
    avx512._is_avx512_bf16_supported = True
    assert avx512.build_arch_flags() != flags
    forget_vec_isa_checks()
    assert avx512.build_arch_flags() == flags and not avx512.is_avx512_bf16_supported()


def test_copied_artifact_loads_and_matches_eager(art: Path, eager_tokens: list[list[int]]) -> None:
    """The control for every corruption test below: an untouched copy (in another folder) loads and generates."""
    llm = graphkiln.load(art, **COMPILED)
    assert llm.manifest["format_version"] == FORMAT_VERSION
    assert greedy_tokens(llm) == eager_tokens


def test_graph_keeps_the_attention_submodules_and_no_piece_graphs(artifact: Path) -> None:
    """graph.json holds the stitching graph and its attention submodules' graphs; each piece is an empty module
    at load, where its compiled code goes."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    gm = read_graph(artifact / "graph.json")
    submodules = manifest["compiled"]["submodules"]
    assert any(attn for _, attn in submodules) and any(not attn for _, attn in submodules)
    for name, attn in submodules:
        module = gm.get_submodule(name)
        assert isinstance(module, torch.fx.GraphModule) == attn, name
        assert attn or not list(module.children()) and not list(module.parameters()), name
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == [name for name, _ in submodules]


# ---------------------------------------------------------------- refused artifacts


def _set_python_version(art: Path) -> None:
    edit_manifest(art, lambda m: m["environment"].__setitem__("python", "2.7.18"))


def _set_device_name(art: Path) -> None:
    edit_manifest(art, lambda m: m["environment"]["device"].__setitem__("capability", "NEON"))


def _flip_manifest_byte(art: Path) -> None:
    path = art / "manifest.json"
    data = bytearray(path.read_bytes())
    assert data[0] == ord("{")
    data[0] ^= 0x01  # "{" -> "z"
    path.write_bytes(bytes(data))


def _format_99(art: Path) -> None:
    edit_manifest(art, lambda m: m.__setitem__("format_version", 99))


def _delete_manifest(art: Path) -> None:
    (art / "manifest.json").unlink()


def _another_tools_manifest(art: Path) -> None:
    (art / "manifest.json").write_text(json.dumps({"name": "project", "version": "1.0"}))


def _delete_graph(art: Path) -> None:
    (art / "graph.json").unlink()


def _truncate_piece(art: Path) -> Path:
    piece = piece_files(art)[0]
    os.truncate(piece, piece.stat().st_size // 2)
    return piece


def _flip_piece_byte(art: Path) -> Path:
    piece = piece_files(art)[-1]
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0xFF
    piece.write_bytes(bytes(data))
    return piece


def _delete_piece(art: Path) -> Path:
    piece = piece_files(art)[1]
    piece.unlink()
    return piece


# (edit, regex the message must match; "{art}" is the artifact folder)
CORRUPTIONS = {
    "manifest-torch-version": (set_torch_version, r"torch is '0\.0' but this process has '.+'"),
    "manifest-python-version": (_set_python_version, r"python is '2\.7\.18' but this process has"),
    "manifest-device": (_set_device_name, r"device is .*'NEON'.* but this process has"),
    "format-version-99": (_format_99, rf"{{art}}/manifest\.json: format_version 99, this graphkiln reads {FORMAT_VERSION}"),
    "graph-missing": (_delete_graph, r"{art}/graph\.json: listed in manifest\.json but missing"),
}
PIECE_CORRUPTIONS = {
    "piece-truncated": (_truncate_piece, r"sha256 differs"),
    "piece-byte-flipped": (_flip_piece_byte, r"sha256 differs"),
    "piece-missing": (_delete_piece, r"listed in manifest\.json but missing"),
}


def _load_refused(art: Path, edit, pattern: str) -> str:
    """`edit` the artifact, then the message of the ArtifactError its load raises, which matches `pattern` ({art}:
    the artifact's path)."""
    edit(art)
    with pytest.raises(ArtifactError, match=pattern.replace("{art}", re.escape(str(art)))) as info:
        graphkiln.load(art, **ENGINE)
    return str(info.value)


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_artifact_is_refused(art: Path, case: str) -> None:
    assert "recompile" in _load_refused(art, *CORRUPTIONS[case])  # says what to do


# What leaves a folder no graphkiln artifact at all: --force would refuse to replace it, so no message suggests it.
NOT_ARTIFACTS = {
    "manifest-missing": (_delete_manifest, r"{art}: not a graphkiln artifact \(it holds no manifest\.json\)"),
    "manifest-not-json": (_flip_manifest_byte, r"{art}/manifest\.json: not valid JSON \(.*\), so {art} is not a "),
    "another-tools-manifest": (_another_tools_manifest,
                               r"{art}/manifest\.json: not a graphkiln manifest \(no format_version\), so {art} "),
}


@pytest.mark.parametrize("case", list(NOT_ARTIFACTS))
def test_a_folder_that_is_no_artifact_is_refused_without_the_force_hint(art: Path, case: str) -> None:
    message = _load_refused(art, *NOT_ARTIFACTS[case])
    assert "--force" not in message and "compile-model MODEL -o OUT" in message
    assert foreign_content(art) is not None  # --force would refuse it


@pytest.mark.parametrize("case", list(PIECE_CORRUPTIONS))
def test_corrupt_piece_is_refused_naming_the_file(art: Path, case: str) -> None:
    edit, pattern = PIECE_CORRUPTIONS[case]
    piece = edit(art)
    with pytest.raises(ArtifactError, match=re.escape(str(piece)) + ": " + pattern):
        graphkiln.load(art, **ENGINE)


def test_other_dtype_is_refused(artifact: Path) -> None:
    with pytest.raises(ArtifactError, match=r"compiled for dtype 'float32', asked for 'bfloat16'"):
        graphkiln.load(artifact, dtype="bfloat16", **ENGINE)


def test_other_device_is_refused(artifact: Path) -> None:
    with pytest.raises(ArtifactError, match=r"compiled for device 'cpu', asked for 'cuda'"):
        graphkiln.load(artifact, device="cuda", **ENGINE)


def test_a_device_torch_does_not_know_is_a_config_error(artifact: Path) -> None:
    with pytest.raises(ConfigError, match=r"device 'tpu' is not a torch device .*; use 'cpu' or 'cuda'"):
        graphkiln.load(artifact, device="tpu", **ENGINE)


def test_same_device_and_dtype_are_accepted(artifact: Path) -> None:
    """Control for the two tests above: naming the artifact's own device/dtype passes every check."""
    manifest = check_artifact(artifact, tiny_model_dir(), device="cpu", dtype="float32")
    assert manifest["config"]["device"] == "cpu" and manifest["config"]["dtype"] == "float32"


def test_missing_out_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "never-compiled"
    with pytest.raises(ArtifactError, match=re.escape(str(out)) + r": no such artifact directory"):
        graphkiln.load(out, **ENGINE)
    assert not out.exists()


def test_tampered_graph_is_refused_naming_it(art: Path) -> None:
    graph = json.loads((art / "graph.json").read_text())
    graph["pieces"].reverse()  # manifest keeps the old sha256
    (art / "graph.json").write_text(json.dumps(graph))
    with pytest.raises(ArtifactError, match=re.escape(str(art / "graph.json")) + r": sha256 differs"):
        graphkiln.load(art, **ENGINE)


def test_a_stale_environment_is_refused_before_any_code_loads(art: Path, tmp_path: Path) -> None:
    """A stale environment is found before the file hashes (here intact: a kernel planted and rehashed); still
    nothing of the artifact is loaded."""
    kernel = tmp_path / "kernel-loaded"
    plant_marker_kernel(art, kernel)
    set_torch_version(art)
    with pytest.raises(ArtifactError, match="torch"):
        graphkiln.load(art, **ENGINE)
    assert not kernel.exists()


def test_artifact_of_other_pass_code_is_refused_naming_the_pass(art: Path) -> None:
    """A graph rewritten by another version of a built-in pass may call ops this code lacks."""
    users_pass = {"name": "users_own_pass", "stage": "dynamo", "uuid": "not ours to judge"}
    edit_manifest(art, lambda m: m["passes"].append(users_pass))
    check_artifact(art, tiny_model_dir())  # a pass graphkiln does not know is the caller's business
    edit_manifest(art, lambda m: next(p for p in m["passes"] if p["name"] == "silu_mul_linear").update(uuid="0" * 64))
    with pytest.raises(ArtifactError, match=re.escape(str(art / "manifest.json")) +
                       r": pass silu_mul_linear has changed since this artifact was compiled; recompile"):
        graphkiln.load(art, **ENGINE)


def _rewrite_graph(art: Path, edit) -> None:
    """Edit graph.json and fix its sha256 in the manifest, as when other graphkiln code wrote the artifact."""
    graph = json.loads((art / "graph.json").read_text())
    edit(graph)
    data = json.dumps(graph).encode()
    (art / "graph.json").write_bytes(data)
    edit_manifest(art, lambda m: m["files"].__setitem__("graph.json", hashlib.sha256(data).hexdigest()))


def _call(graph: dict) -> dict:
    return next(n for n in graph["graph"] if n["op"] == "call_function")


@pytest.mark.parametrize(("target", "why"), [
    ({"function": ["_operator", "removed_function"]}, r"AttributeError: .*removed_function"),
    ({"op": "graphkiln.removed_op"}, r"AttributeError: .*removed_op"),
    ({"function": ["os", "system"]}, r"ValueError: function os\.system: not of _operator, operator"),
])  # fmt: skip
def test_graph_naming_what_this_graphkiln_lacks_or_refuses_is_refused_naming_the_file(
    art: Path, target: dict, why: str
) -> None:
    """Hashes intact, yet the graph names a function or op this graphkiln lacks, or a function outside the
    modules a graph may call: refused at load, naming the file; nothing is imported from elsewhere."""
    _rewrite_graph(art, lambda graph: _call(graph).__setitem__("target", target))
    with pytest.raises(ArtifactError, match=re.escape(str(art / "graph.json")) +
                       rf": this graphkiln cannot rebuild it \({why}.*recompile"):
        graphkiln.load(art, capture="blocking", **ENGINE)


@pytest.mark.parametrize("section", ["files", "environment"])
def test_manifest_missing_section_is_refused(art: Path, section: str) -> None:
    edit_manifest(art, lambda m: m.pop(section))
    with pytest.raises(ArtifactError, match=section):
        graphkiln.load(art, **ENGINE)


@pytest.mark.parametrize("edit", ["drop", "unknown-field"])
def test_manifest_model_config_must_be_a_model_config(art: Path, edit: str) -> None:
    def change(m: dict) -> None:
        if edit == "drop":
            m["model"].pop("config")
        else:
            m["model"]["config"]["sliding"] = 1

    edit_manifest(art, change)
    with pytest.raises(ArtifactError, match=r"field model\.config is missing or invalid"):
        graphkiln.load(art, **ENGINE)


