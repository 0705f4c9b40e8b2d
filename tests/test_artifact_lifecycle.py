"""Artifacts over time: model files changing under an artifact are refused, `on_mismatch="recompile"`
rebuilds a stale one, writes are atomic (an interrupted compile leaves no OUT), concurrent writers
serialize, and specialized artifacts load.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import graphkiln
from artifact_helpers import (
    COMPILED,
    ENGINE,
    PROMPTS,
    SMALL_CONFIG,
    SMALL_ENGINE,
    SMALL_CONFIG_ARGS,
    compile_cmd,
    greedy_tokens,
    popen,
    set_torch_version,
    single_error_line,
    temp_folders,
)
from graphkiln import CompileConfig
from graphkiln.compiler.artifact_load import check_artifact
from graphkiln.errors import ArtifactError
from graphkiln.models.tiny import tiny_model_dir

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- changed model files


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A private copy of the tiny model directory (never edit the packaged one)."""
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
    manifest, _ = graphkiln.compile_model(model_dir, out, SMALL_CONFIG, engine=SMALL_ENGINE)
    assert manifest["model"]["source"] == str(model_dir.resolve())
    check_artifact(out, Path(manifest["model"]["source"]))  # control
    _resave_one_tensor_changed(model_dir)
    with pytest.raises(ArtifactError, match=re.escape(str(model_dir.resolve())) + r".*\(weights changed\)"):
        graphkiln.load(out, **ENGINE)


# ---------------------------------------------------------------- on_mismatch="recompile"


def test_stale_artifact_recompiles_on_request(art: Path, eager_tokens: list[list[int]]) -> None:
    set_torch_version(art)
    with pytest.raises(ArtifactError, match="torch"):
        graphkiln.load(art, **ENGINE)
    llm = graphkiln.load(art, on_mismatch="recompile", **COMPILED)
    assert llm.manifest["environment"]["torch"] != "0.0"
    assert json.loads((art / "manifest.json").read_text())["environment"]["torch"] != "0.0"  # rewritten on disk
    assert llm.manifest["engine"]["decode_batch_sizes"] == list(SMALL_ENGINE.decode_batch_sizes)
    assert greedy_tokens(llm) == eager_tokens
    assert not temp_folders(art)
    check_artifact(art, tiny_model_dir())  # and it stays valid for a plain load


def test_on_mismatch_must_be_known(artifact: Path) -> None:
    with pytest.raises(graphkiln.errors.ConfigError, match="on_mismatch"):
        graphkiln.load(artifact, on_mismatch="ignore", **ENGINE)


def test_stale_artifact_recompiles_with_device_and_dtype_named(art: Path) -> None:
    set_torch_version(art)
    llm = graphkiln.load(art, device="cpu", dtype="float32", on_mismatch="recompile", **ENGINE)
    assert llm.manifest["environment"]["torch"] != "0.0"


# ---------------------------------------------------------------- atomic and concurrent writes


def test_interrupted_compile_leaves_no_artifact(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = popen(compile_cmd("tiny", "-o", out, "--quiet", *SMALL_CONFIG_ARGS))
    try:
        deadline = time.monotonic() + 240
        # The folder and its mark: a compile killed between the two leaves a folder nothing may remove.
        while not any(p.suffix == ".graphkiln" for p in temp_folders(out)):
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

    graphkiln.compile_model("tiny", out, SMALL_CONFIG, engine=SMALL_ENGINE)
    assert not any(p.exists() for p in stale), "the next compile should remove stale temp folders"
    assert not temp_folders(out)
    check_artifact(out, tiny_model_dir())


def test_compile_refuses_existing_out_without_force(artifact: Path) -> None:
    before = (artifact / "manifest.json").read_bytes()
    with pytest.raises(ArtifactError, match=re.escape(str(artifact)) + ": already exists"):
        graphkiln.compile_model("tiny", artifact, SMALL_CONFIG, engine=SMALL_ENGINE)
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
    llm = graphkiln.load(out, **COMPILED)
    assert greedy_tokens(llm, PROMPTS[:1]) == eager_tokens[:1]


# ---------------------------------------------------------------- specialized artifacts


def test_specialized_artifact_loads(tmp_path: Path, eager_tokens: list[list[int]]) -> None:
    config = CompileConfig(specialize_sizes=(1, 16))
    out = tmp_path / "spec"
    manifest, report = graphkiln.compile_model("tiny", out, config)
    unique = manifest["compiled"]["unique_pieces"]
    assert {key: info["sizes"] for key, info in unique.items()} == {key: [1, 16] for key in unique}
    for key in unique:
        assert {p.name for p in (out / "pieces" / key).iterdir()} == {"dynamic.bin", "1.bin", "16.bin"}
    assert report.counters.specialized_compiles == 2 * len(unique)
    llm = graphkiln.load(out, **COMPILED)
    assert greedy_tokens(llm, PROMPTS[:1]) == eager_tokens[:1]  # prefill in 16 rows, decode at 1: the two sizes'
    assert greedy_tokens(llm, PROMPTS[:2]) == eager_tokens[:2]
