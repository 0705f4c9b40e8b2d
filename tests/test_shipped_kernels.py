"""graphkiln's Triton kernels carried in an artifact (kernels/shipped.py): written into the artifact before it is
sealed, checked like every file of it, and put into a Triton cache folder that lacks them. Which kernels a CUDA
compile ships and that a first start elsewhere then builds none is tests/gpu/test_startup_gpu.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import graphkiln
from artifact_helpers import COMPILED, ENGINE, GREEDY, PROMPTS, SMALL_CONFIG, SMALL_ENGINE, greedy_tokens, temp_folders
from graphkiln.compiler.artifact_dir import write_artifact
from graphkiln.errors import ArtifactError
from graphkiln.kernels.shipped import TRITON_KERNELS, install_shipped_kernels
from graphkiln.models.tiny import tiny_model_dir

ENTRY = "QFOL7LBBKJ3XVPTEN4AH3D6ESYDK5JQD2GJRRW2MOAEZBEPNKDRQ"  # a Triton cache key's form (base32)


def _write_entry(folder: Path, written_in: Path) -> None:
    """A Triton cache entry as Triton writes it in `written_in`: its files and a group file listing them there."""
    folder.mkdir(parents=True)
    files = {"_decode_kernel.json": '{"name": "_decode_kernel"}', "_decode_kernel.cubin": "\x7fELF binary"}
    for name, text in files.items():
        (folder / name).write_text(text)
    group = {"child_paths": {name: str(written_in / ENTRY / name) for name in files}}
    (folder / "__grp___decode_kernel.json").write_text(json.dumps(group))


def test_an_entry_the_cache_lacks_is_put_whole_with_its_group_pointing_there(tmp_path: Path) -> None:
    shipped, cache = tmp_path / "artifact" / TRITON_KERNELS, tmp_path / "triton-cache"
    _write_entry(shipped / ENTRY, tmp_path / "compile-machine-cache")
    install_shipped_kernels(shipped, cache)
    entry = cache / ENTRY
    group = json.loads((entry / "__grp___decode_kernel.json").read_text())
    assert group["child_paths"] == {"_decode_kernel.json": str(entry / "_decode_kernel.json"),
                                    "_decode_kernel.cubin": str(entry / "_decode_kernel.cubin")}  # fmt: skip
    assert all(Path(p).read_text() == (shipped / ENTRY / Path(p).name).read_text() for p in group["child_paths"].values())
    assert sorted(p.name for p in cache.iterdir()) == [ENTRY], "a staging folder was left in the cache"


def test_an_entry_the_cache_holds_is_left_as_it_is(tmp_path: Path) -> None:
    shipped, cache = tmp_path / "artifact" / TRITON_KERNELS, tmp_path / "triton-cache"
    _write_entry(shipped / ENTRY, tmp_path / "compile-machine-cache")
    _write_entry(cache / ENTRY, cache)
    (cache / ENTRY / "_decode_kernel.cubin").write_text("built here")
    install_shipped_kernels(shipped, cache)
    assert (cache / ENTRY / "_decode_kernel.cubin").read_text() == "built here"
    install_shipped_kernels(tmp_path / "no-such-folder", cache)  # an artifact that ships none


def test_a_cache_that_cannot_be_written_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shipped = tmp_path / "artifact" / TRITON_KERNELS
    _write_entry(shipped / ENTRY, tmp_path / "compile-machine-cache")
    _write_entry(shipped / ENTRY.lower(), tmp_path / "compile-machine-cache")
    (tmp_path / "a-file").write_text("not a folder")
    with caplog.at_level("WARNING", logger="graphkiln.kernels.shipped"):
        install_shipped_kernels(shipped, tmp_path / "a-file" / "cache")
    assert len(caplog.records) == 1 and str(shipped) in caplog.records[0].getMessage()


def test_files_finish_adds_are_sealed_into_the_manifest_and_checked_at_load(
    tmp_path: Path, eager_tokens: list[list[int]]
) -> None:
    """`write_artifact(finish=...)` runs on the complete artifact before it is sealed (here: loads it, as the
    serving-kernel builds do, and ships an entry): the entry's files are listed with their sha256, the stage's
    seconds recorded, the load's lock file beside the temporary folder removed; the artifact serves as one
    without them, and an edited shipped file is refused at load, naming it."""
    out = tmp_path / "tiny"

    def finish(tmp: Path) -> dict[str, float]:
        with graphkiln.load(tmp, **ENGINE) as llm:
            llm.generate(["hi"], GREEDY)
        _write_entry(tmp / TRITON_KERNELS / ENTRY, tmp_path / "cache")
        return {"serving_kernels": 1.5}

    manifest, report = write_artifact(tiny_model_dir(), "tiny", out, SMALL_CONFIG, SMALL_ENGINE.to_dict(),
                                      finish=finish)  # fmt: skip
    listed = sorted(rel for rel in manifest["files"] if rel.startswith(f"{TRITON_KERNELS}/"))
    assert listed == [f"{TRITON_KERNELS}/{ENTRY}/{name}" for name in
                      ("__grp___decode_kernel.json", "_decode_kernel.cubin", "_decode_kernel.json")]  # fmt: skip
    assert report.timings["serving_kernels"] == manifest["timings"]["serving_kernels"] == 1.5
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".tiny.lock"]
    assert not temp_folders(out)
    with graphkiln.load(out, **COMPILED) as llm:
        assert greedy_tokens(llm, PROMPTS[:1]) == eager_tokens[:1]
    (out / TRITON_KERNELS / ENTRY / "_decode_kernel.cubin").write_text("\x7fELF other")
    with pytest.raises(ArtifactError, match="_decode_kernel.cubin"):
        graphkiln.load(out, **ENGINE)
