"""compile_model writes an artifact directory that a fresh process loads without tracing or compiling;
every stale, tampered or mismatched artifact is refused with an ArtifactError naming what differs;
writes are atomic (an interrupted compile leaves no OUT) and concurrent writers serialize.

The tiny model is compiled once per module (3 Inductor compiles, specialization off on CPU); the
corruption tests edit private copies of that artifact.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import graphkiln
from artifact_helpers import (
    ENGINE,
    GREEDY,
    PROMPTS,
    RESULT_PREFIX,
    SMALL_CONFIG,
    SMALL_CONFIG_ARGS,
    compile_cmd,
    edit_manifest,
    greedy_tokens,
    popen,
    run_python_json,
    single_error_line,
    temp_folders,
)
from graphkiln import CompileConfig
from graphkiln.compiler.artifact_dir import check_artifact
from graphkiln.compiler.counters import torch_compile_events
from graphkiln.compiler.manifest import FORMAT_VERSION
from graphkiln.errors import ArtifactError
from graphkiln.models.tiny import tiny_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model compiled once for this module. Tests must not modify it: copy it first."""
    out = tmp_path_factory.mktemp("artifacts") / "tiny"
    manifest, report = graphkiln.compile_model("tiny", out, SMALL_CONFIG)
    report.counters.expect(graphs_traced=1, inductor_compiles=3, specialized_compiles=0)
    assert torch_compile_events()["dynamo_graphs"] >= 1  # the counters the fresh-process test reads do count
    assert (out / "manifest.json").is_file() and not temp_folders(out)
    return out


@pytest.fixture(scope="module")
def eager_tokens() -> list[list[int]]:
    return greedy_tokens(graphkiln.LLM.eager("tiny", **ENGINE))


@pytest.fixture
def art(artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the module's artifact, free to corrupt."""
    return Path(shutil.copytree(artifact, tmp_path / "art"))


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
    assert {p.relative_to(fresh_cache) for p in fresh_cache.rglob("*.so")} == shipped  # gcc built nothing


def test_copied_artifact_loads_and_matches_eager(art: Path, eager_tokens: list[list[int]]) -> None:
    """The control for every corruption test below: an untouched copy (in another folder) loads and generates."""
    llm = graphkiln.load(art, **ENGINE)
    assert llm.manifest["format_version"] == FORMAT_VERSION
    assert greedy_tokens(llm) == eager_tokens


# ---------------------------------------------------------------- refused artifacts


def _set_torch_version(art: Path) -> None:
    edit_manifest(art, lambda m: m["environment"].__setitem__("torch", "0.0"))


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


def _delete_graph(art: Path) -> None:
    (art / "graph.pkl").unlink()


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
    "manifest-torch-version": (_set_torch_version, r"torch is '0\.0' but this process has '.+'"),
    "manifest-python-version": (_set_python_version, r"python is '2\.7\.18' but this process has"),
    "manifest-device": (_set_device_name, r"device is .*'NEON'.* but this process has"),
    "manifest-not-json": (_flip_manifest_byte, r"{art}/manifest\.json: not valid JSON"),
    "format-version-99": (_format_99, r"{art}/manifest\.json: format_version 99, this graphkiln reads 2"),
    "manifest-missing": (_delete_manifest, r"{art}/manifest\.json: missing"),
    "graph-missing": (_delete_graph, r"{art}/graph\.pkl: listed in manifest\.json but missing"),
}
PIECE_CORRUPTIONS = {
    "piece-truncated": (_truncate_piece, r"sha256 differs"),
    "piece-byte-flipped": (_flip_piece_byte, r"sha256 differs"),
    "piece-missing": (_delete_piece, r"listed in manifest\.json but missing"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_artifact_is_refused(art: Path, case: str) -> None:
    edit, pattern = CORRUPTIONS[case]
    edit(art)
    with pytest.raises(ArtifactError, match=pattern.replace("{art}", re.escape(str(art)))) as info:
        graphkiln.load(art, **ENGINE)
    assert "recompile" in str(info.value)  # says what to do


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


def test_same_device_and_dtype_are_accepted(artifact: Path) -> None:
    """Control for the two tests above: naming the artifact's own device/dtype passes every check."""
    manifest = check_artifact(artifact, tiny_model_dir(), device="cpu", dtype="float32")
    assert manifest["config"]["device"] == "cpu" and manifest["config"]["dtype"] == "float32"


def test_missing_out_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "never-compiled"
    with pytest.raises(ArtifactError, match=re.escape(str(out)) + r": no such artifact directory"):
        graphkiln.load(out, **ENGINE)
    assert not out.exists()


class _Marker:
    """Unpickling this creates the marker file: proof that a pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_tampered_graph_is_never_unpickled(art: Path, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    (art / "graph.pkl").write_bytes(pickle.dumps(_Marker(marker)))  # manifest keeps the old sha256
    with pytest.raises(ArtifactError, match=re.escape(str(art / "graph.pkl")) + r": sha256 differs"):
        graphkiln.load(art, **ENGINE)
    assert not marker.exists()
    # The payload does work when unpickled, so the absence of the marker means something.
    pickle.loads((art / "graph.pkl").read_bytes()).close()
    assert marker.exists()


def test_tampered_graph_with_other_mismatch_is_never_unpickled(art: Path, tmp_path: Path) -> None:
    """A stale environment is found before the file hashes; still nothing is unpickled."""
    marker = tmp_path / "unpickled"
    (art / "graph.pkl").write_bytes(pickle.dumps(_Marker(marker)))
    _set_torch_version(art)
    with pytest.raises(ArtifactError, match="torch"):
        graphkiln.load(art, **ENGINE)
    assert not marker.exists()


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


# ---------------------------------------------------------------- changed model files


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A private copy of the tiny model directory (never edit the shared one in GRAPHKILN_CACHE)."""
    return Path(shutil.copytree(tiny_model_dir(), tmp_path / "model"))


def _resave_one_tensor_changed(model_dir: Path) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2  # same shape, new values
    save_file(tensors, path, metadata={"format": "pt", "edited": "norm doubled"})  # a new header


def _reshape_one_tensor(model_dir: Path) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def _add_tensor(model_dir: Path) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(model_dir: Path) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "rms_norm_eps": 1e-6}))


def _edit_tokenizer_config(model_dir: Path) -> None:
    path = model_dir / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "add_bos_token": False}))


MODEL_EDITS = {
    "weights-resaved-one-tensor-changed": (_resave_one_tensor_changed, "weights"),
    "weights-one-tensor-reshaped": (_reshape_one_tensor, "weights"),
    "weights-tensor-added": (_add_tensor, "weights"),
    "config-json-changed": (_edit_config, "config_sha256"),
    "tokenizer-config-changed": (_edit_tokenizer_config, "tokenizer_files"),
}


@pytest.mark.parametrize("case", list(MODEL_EDITS))
def test_changed_model_files_are_refused(artifact: Path, model_dir: Path, case: str) -> None:
    """The fingerprint ignores where the model lives, so `model=` can point the shared artifact at a copy."""
    check_artifact(artifact, model_dir)  # control: the untouched copy passes
    edit, field = MODEL_EDITS[case]
    edit(model_dir)
    with pytest.raises(ArtifactError, match=re.escape(f"model files in {model_dir} differ") + rf".*\({field} changed\)"):
        graphkiln.load(artifact, model=model_dir, **ENGINE)


def test_changed_weights_in_recorded_source_are_refused(model_dir: Path, tmp_path: Path) -> None:
    """The default path: with no `model=`, load checks the directory recorded at compile time."""
    out = tmp_path / "art"
    manifest, _ = graphkiln.compile_model(model_dir, out, SMALL_CONFIG)
    assert manifest["model"]["source"] == str(model_dir.resolve())
    check_artifact(out, Path(manifest["model"]["source"]))  # control
    _resave_one_tensor_changed(model_dir)
    with pytest.raises(ArtifactError, match=re.escape(str(model_dir.resolve())) + r".*\(weights changed\)"):
        graphkiln.load(out, **ENGINE)


# ---------------------------------------------------------------- on_mismatch="recompile"


def test_stale_artifact_recompiles_on_request(art: Path, eager_tokens: list[list[int]]) -> None:
    _set_torch_version(art)
    with pytest.raises(ArtifactError, match="torch"):
        graphkiln.load(art, **ENGINE)
    llm = graphkiln.load(art, on_mismatch="recompile", **ENGINE)
    assert llm.manifest["environment"]["torch"] != "0.0"
    assert json.loads((art / "manifest.json").read_text())["environment"]["torch"] != "0.0"  # rewritten on disk
    assert llm.manifest["config"]["decode_batch_sizes"] == list(SMALL_CONFIG.decode_batch_sizes)
    assert greedy_tokens(llm) == eager_tokens
    assert not temp_folders(art)
    check_artifact(art, tiny_model_dir())  # and it stays valid for a plain load


def test_on_mismatch_must_be_known(artifact: Path) -> None:
    with pytest.raises(graphkiln.errors.ConfigError, match="on_mismatch"):
        graphkiln.load(artifact, on_mismatch="ignore", **ENGINE)


def test_stale_artifact_recompiles_with_device_and_dtype_named(art: Path) -> None:
    _set_torch_version(art)
    llm = graphkiln.load(art, device="cpu", dtype="float32", on_mismatch="recompile", **ENGINE)
    assert llm.manifest["environment"]["torch"] != "0.0"


# ---------------------------------------------------------------- atomic and concurrent writes


def test_interrupted_compile_leaves_no_artifact(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = popen(compile_cmd("tiny", "-o", out, "--quiet", *SMALL_CONFIG_ARGS))
    try:
        deadline = time.monotonic() + 240
        while not temp_folders(out):
            assert proc.poll() is None, f"compile ended before its temp folder was seen: {proc.communicate()}"
            assert time.monotonic() < deadline, "no .out.tmp-* folder appeared"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    stale = temp_folders(out)
    assert stale, "the killed compile should have left its temp folder behind"
    assert not out.exists()
    with pytest.raises(ArtifactError, match="no such artifact directory"):
        graphkiln.load(out, **ENGINE)

    graphkiln.compile_model("tiny", out, SMALL_CONFIG)
    assert not any(p.exists() for p in stale), "the next compile should remove stale temp folders"
    assert not temp_folders(out)
    check_artifact(out, tiny_model_dir())


def test_compile_refuses_existing_out_without_force(artifact: Path) -> None:
    before = (artifact / "manifest.json").read_bytes()
    with pytest.raises(ArtifactError, match=re.escape(str(artifact)) + ": already exists"):
        graphkiln.compile_model("tiny", artifact, SMALL_CONFIG)
    assert (artifact / "manifest.json").read_bytes() == before


def test_concurrent_compiles_of_one_out(tmp_path: Path, eager_tokens: list[list[int]]) -> None:
    out = tmp_path / "out"
    plain = popen(compile_cmd("tiny", "-o", out, "--quiet", *SMALL_CONFIG_ARGS))
    forced = popen(compile_cmd("tiny", "-o", out, "--quiet", "--force", *SMALL_CONFIG_ARGS))
    results = {}
    for name, proc in (("plain", plain), ("forced", forced)):
        try:
            _, err = proc.communicate(timeout=400)
        finally:
            proc.kill()
        results[name] = (proc.returncode, err)
    # --force always ends in success: it either compiled first, or waited for the lock and replaced OUT.
    assert results["forced"][0] == 0, results["forced"][1][-3000:]
    code, err = results["plain"]
    assert code in (0, 2), err[-3000:]
    if code == 2:  # lost the race: waited for the lock, then found OUT present
        line = single_error_line(err)
        assert line.startswith("error: ") and "already exists" in line, line
    assert not temp_folders(out)
    llm = graphkiln.load(out, **ENGINE)
    assert greedy_tokens(llm, PROMPTS[:1]) == eager_tokens[:1]


# ---------------------------------------------------------------- specialized artifacts


def test_specialized_artifact_loads(tmp_path: Path, eager_tokens: list[list[int]]) -> None:
    config = CompileConfig(decode_batch_sizes=(1, 2), prefill_token_buckets=(16,), specialize=True)
    out = tmp_path / "spec"
    manifest, report = graphkiln.compile_model("tiny", out, config)
    unique = manifest["compiled"]["unique_pieces"]
    assert {key: info["sizes"] for key, info in unique.items()} == {key: [1, 2, 16] for key in unique}
    for key in unique:
        assert {p.name for p in (out / "pieces" / key).iterdir()} == {"dynamic.bin", "1.bin", "2.bin", "16.bin"}
    assert report.counters.specialized_compiles == 3 * len(unique)
    llm = graphkiln.load(out, **ENGINE)
    assert greedy_tokens(llm, PROMPTS[:2]) == eager_tokens[:2]
