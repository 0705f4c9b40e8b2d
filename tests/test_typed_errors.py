"""Mistakes that used to end in a traceback end in a typed graphkiln error: one line on the command line,
exit 2, naming the file, field or value and what to do."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import graphkiln
from artifact_helpers import (
    ENGINE, compile_error, edit_manifest, flip_piece_byte_and_rehash, rehash, single_error_line, temp_folders,
)
from graphkiln import CompileConfig, cli
from graphkiln.errors import ArtifactError, ConfigError, ModelFileError
from graphkiln.models.tiny import tiny_model_dir

pytestmark = pytest.mark.slow


def generate_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = cli.main(["generate", *map(str, args), "--prompt", "hi", "--max-tokens", "2"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cuda_device_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli.compile_model_main(["tiny", "-o", str(out), "--device", "cuda", "--quiet"]) == 2
    line = single_error_line(capsys.readouterr().err)
    expected = r"error: CompileConfig\.device='cuda' but this torch \S+ is built without CUDA; use --device cpu"
    assert re.fullmatch(expected, line), line
    with pytest.raises(ConfigError, match=r"device='cuda'.*use --device cpu"):
        graphkiln.compile_model("tiny", out, CompileConfig(device="cuda"))
    assert not out.exists() and not list(tmp_path.iterdir())



def test_out_on_a_file_system_that_refuses_writes(capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/sys/kernel").is_dir():
        pytest.skip("needs Linux sysfs, where nobody may create files")
    out = Path("/sys/graphkiln-out")
    line = compile_error(capsys, "tiny", "-o", out)
    assert line.startswith(f"error: {out}: cannot write the artifact (") and "pick a writable folder" in line, line


def test_a_disk_filling_while_the_pieces_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The write of the compiled pieces fails as a full disk fails it (ENOSPC, injected: CI cannot mount a small
    file system): one error line, and neither OUT nor a temporary folder is left."""
    from graphkiln.compiler import artifact_dir

    def full(compiled, out: Path) -> dict:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "pieces"))

    monkeypatch.setattr(artifact_dir, "save_compiled", full)
    out = tmp_path / "out"
    line = compile_error(capsys, "tiny", "-o", out)
    assert line.startswith(f"error: {out}: the disk filled while the artifact was written (") and "free space" in line
    assert not out.exists() and not temp_folders(out)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_out_in_a_read_only_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parent = tmp_path / "read-only"
    parent.mkdir(mode=0o555)
    line = compile_error(capsys, "tiny", "-o", parent / "out")
    assert "cannot write the artifact" in line and "Permission denied" in line, line


def test_corrupt_piece_with_its_sha256_fixed_up_is_named(art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    piece = flip_piece_byte_and_rehash(art)
    with pytest.raises(ArtifactError, match=re.escape(f"{piece}: Inductor cannot load this piece (") + ".*recompile"):
        graphkiln.load(art, capture="blocking", **ENGINE)
    code, out, err = generate_cli(capsys, art)  # the engine served eagerly; the CLI still fails on the artifact
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"error: {piece}: Inductor cannot load this piece")


def test_corrupt_tokenizer_snapshot_with_its_sha256_fixed_up_is_named(art: Path) -> None:
    snapshot = art / "tokenizer.json"
    snapshot.write_text(snapshot.read_text()[: len(snapshot.read_text()) // 2])
    rehash(art, snapshot)
    with pytest.raises(ArtifactError, match=re.escape(f"{snapshot}: the tokenizer snapshot cannot be read (")):
        graphkiln.load(art, **ENGINE)


@pytest.mark.parametrize(
    "field, edit",
    [
        ("config.dtype", lambda m: m["config"].__setitem__("dtype", "bfloat16")),
        ("model.config.num_layers", lambda m: m["model"]["config"].__setitem__("num_layers", 3)),
        ("engine.block_size", lambda m: m["engine"].__setitem__("block_size", 32)),
        ("environment.torch", lambda m: m["environment"].__setitem__("torch", torch.__version__ + "-edited")),
    ],
    ids=["dtype", "num_layers", "block_size", "torch-version"],
)
def test_hand_edited_manifest_field_is_named(art: Path, field: str, edit, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(art, edit, reseal=False)
    manifest = re.escape(str(art / "manifest.json"))
    pattern = rf"{manifest}: field {re.escape(field)} was changed \(now .*\) after compile-model wrote it; recompile"
    with pytest.raises(ArtifactError, match=pattern):
        graphkiln.load(art, **ENGINE)
    code, out, err = generate_cli(capsys, art)
    assert code == 2 and re.match("error: " + pattern, single_error_line(err))


@pytest.mark.parametrize("source", [None, 123, ""], ids=["removed", "a-number", "empty"])
def test_a_model_source_that_names_no_directory(art: Path, source, capsys: pytest.CaptureFixture[str]) -> None:
    """model.source is left out of the seal (a user may point it at moved weights), so it is checked as read:
    an error naming the field and how to say where the weights are, which then loads; inspect still shows the rest."""
    edit_manifest(art, lambda m: m["model"].pop("source") if source is None else m["model"].update(source=source))
    with pytest.raises(ArtifactError, match=r"model\.source is .*graphkiln\.load\(OUT, model=DIR\)"):
        graphkiln.load(art, **ENGINE)
    code, out, err = generate_cli(capsys, art)
    assert code == 2 and single_error_line(err).startswith(f"error: {art / 'manifest.json'}: model.source is ")
    code, out, err = generate_cli(capsys, art, "--model", tiny_model_dir())
    assert code == 0 and out.startswith("'hi' -> "), err
    assert cli.main(["inspect", str(art)]) == 0
    assert f"model         {source if source is not None else None} (" in capsys.readouterr().out


def test_serve_names_a_model_whose_source_is_gone_after_its_model_dir(art: Path, monkeypatch) -> None:
    """`serve OUT --model DIR` on an artifact whose model.source names no directory: the model served is DIR's,
    and so is its name."""
    from graphkiln.serve import server

    edit_manifest(art, lambda m: m["model"].pop("source"))
    served = []
    monkeypatch.setattr(server, "serve", lambda llm, config, *args: served.append((llm, config)))
    assert cli.main(["serve", str(art), "--model", str(tiny_model_dir()), "--port", "0"]) == 0
    llm, config = served[0]
    llm.close()
    assert config.model_name == tiny_model_dir().name


@pytest.mark.parametrize("model", [123, "", ["tiny"]])
def test_a_model_that_is_not_a_path(art: Path, model) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"model={model!r}; give 'tiny', a model directory")):
        graphkiln.load(art, model=model, **ENGINE)
    with pytest.raises(ConfigError, match=re.escape(f"model={model!r}")):
        graphkiln.LLM.eager(model)


def test_moved_weights_point_to_model(art: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The weights moved after compiling: the error says where they were and how to say where they are."""
    moved = Path(shutil.copytree(tiny_model_dir(), tmp_path / "new-home"))
    gone = tmp_path / "old-home"
    edit_manifest(art, lambda m: m["model"].__setitem__("source", str(gone)))
    with pytest.raises(ModelFileError, match=re.escape(f"{gone}: the model directory {art / 'manifest.json'} names")
                       + r".*graphkiln\.load\(OUT, model=NEW_DIR\).*--model NEW_DIR"):
        graphkiln.load(art, **ENGINE)
    code, out, err = generate_cli(capsys, art)
    assert code == 2 and single_error_line(err).startswith(f"error: {gone}: ")
    code, out, err = generate_cli(capsys, art, "--model", moved)
    assert code == 0, err
    assert out.startswith("'hi' -> ")
