"""graphkiln deletes or replaces only what it wrote: `--force` replaces a graphkiln artifact (or an empty
folder), never a project folder, the working directory or the model directory; a dump folder is emptied
only when graphkiln's marker lists every file in it; -o and --dump-dir stay apart, and out of other
artifacts. Every refusal is one line, exit 2, naming the path and why, before anything is written.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import graphkiln
from artifact_helpers import SMALL_CONFIG, compile_error, temp_folders
from graphkiln import CompileConfig
from graphkiln.compiler.manifest import foreign_content
from graphkiln.errors import ArtifactError, ConfigError
from graphkiln.models.tiny import tiny_model_dir
from graphkiln.passes.dump import INDEX, MARKER, Dump

pytestmark = pytest.mark.slow


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: what must survive a refused compile."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder of someone's work: sources, notes, a JSON manifest of another tool."""
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('mine')\n")
    (root / "notes.md").write_text("# notes\n")
    (root / "manifest.json").write_text(json.dumps({"name": "project", "version": "1.0"}))
    return root


# ---------------------------------------------------------------- -o and --force


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_a_folder_that_is_not_an_artifact_is_never_replaced(
    project: Path, force: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(project)
    line = compile_error(capsys, "tiny", "-o", project, *(["--force"] if force else []))
    assert line.startswith(f"error: {project}: already exists and ") and "not a graphkiln manifest" in line, line
    assert "--force" not in line  # it would not help: the hint is only for artifacts
    assert snapshot(project) == before
    assert sorted(p.name for p in project.parent.iterdir()) == ["project"]  # no lock file, no temp folder


def test_the_working_directory_is_never_replaced(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "manifest.json").unlink()
    before = snapshot(project)
    monkeypatch.chdir(project)
    line = compile_error(capsys, "tiny", "-o", ".", "--force")
    assert line.startswith(f"error: {project}: already exists and it holds no readable manifest.json"), line
    assert snapshot(project) == before


def test_an_artifact_holding_someone_elses_file_is_not_replaced(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = Path(shutil.copytree(artifact, tmp_path / "art"))
    (out / "pieces" / "README.txt").write_text("my notes about these pieces")
    before = snapshot(out)
    line = compile_error(capsys, "tiny", "-o", out, "--force")
    assert "holds pieces/README.txt, which is not part of the artifact" in line and "--force" not in line, line
    assert snapshot(out) == before


def test_an_artifact_holding_someone_elses_empty_folder_is_not_replaced(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = Path(shutil.copytree(artifact, tmp_path / "art"))
    (out / "pieces" / "to-sort").mkdir()
    line = compile_error(capsys, "tiny", "-o", out, "--force")
    assert "holds pieces/to-sort, which is not part of the artifact" in line, line
    assert (out / "pieces" / "to-sort").is_dir()


def test_folders_named_like_its_temporary_ones_are_not_removed(tmp_path: Path) -> None:
    """A compile removes the temporary folders an earlier one left only where its mark says they are its own."""
    out = tmp_path / "out"
    mine, empty = tmp_path / ".out.tmp-mydata", tmp_path / ".out.tmp-123-abc"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    empty.mkdir()
    graphkiln.compile_model("tiny", out, SMALL_CONFIG)
    assert (mine / "notes.txt").read_text() == "mine\n" and empty.is_dir()
    assert temp_folders(out) == [empty, mine]


@pytest.mark.parametrize("content", ["artifact", "signed-artifact", "empty"])
def test_without_force_an_artifact_or_empty_folder_suggests_force(
    artifact: Path, tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    if content == "empty":
        out.mkdir()
    else:
        shutil.copytree(artifact, out)
    if content == "signed-artifact":
        (out / "manifest.sig").write_bytes(bytes(64))
    line = compile_error(capsys, "tiny", "-o", out)
    assert line == f"error: {out}: already exists; pass --force (force=True) to replace it"


def test_force_replaces_an_empty_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    manifest, _ = graphkiln.compile_model("tiny", out, SMALL_CONFIG, force=True)
    assert json.loads((out / "manifest.json").read_text())["fields_sha256"] == manifest["fields_sha256"]
    assert not temp_folders(out)


@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_out_apart_from_the_model_directory(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Path(shutil.copytree(tiny_model_dir(), tmp_path / "models" / "tiny"))
    before = snapshot(model)
    out, relation = {
        "same": (model, "is"), "inside": (model / "compiled", "is inside"), "holding": (model.parent, "holds")
    }[where]  # fmt: skip
    line = compile_error(capsys, model, "-o", out, "--force")
    assert line.startswith(f"error: -o {out} {relation} the model directory {model}; "), line
    assert snapshot(model) == before and not (model / "compiled").exists()


@pytest.mark.parametrize("flag, where, relation", [
    ("-o", "pieces/inner", "is inside"), ("--dump-dir", "pieces/dumps", "is inside"), ("--dump-dir", "", "is"),
], ids=["out-inside", "dump-inside", "dump-is"])  # fmt: skip
def test_nothing_is_written_inside_another_artifact(
    artifact: Path, tmp_path: Path, flag: str, where: str, relation: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its load refuses any file its manifest does not list (a lock file, a dump), and --force would then refuse
    to replace it."""
    outer = Path(shutil.copytree(artifact, tmp_path / "outer"))
    before = snapshot(outer)
    target = outer / where if where else outer
    args = ("-o", target) if flag == "-o" else ("-o", tmp_path / "out", "--dump-dir", target)
    line = compile_error(capsys, "tiny", *args)
    assert line.startswith(f"error: {flag} {target} {relation} the graphkiln artifact {outer}, "), line
    assert snapshot(outer) == before and foreign_content(outer) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outer"]


def test_a_lock_file_graphkiln_did_not_write_keeps_its_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The lock is taken for the compile (this one stops at its NaN weight, under the lock) and keeps
    what a file of that name held."""
    model = Path(shutil.copytree(tiny_model_dir(), tmp_path / "model"))
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    lock = tmp_path / ".out.lock"
    lock.write_text("someone's file\n")
    line = compile_error(capsys, model, "-o", tmp_path / "out")
    assert "holds NaN or Inf" in line, line
    assert lock.read_text() == "someone's file\n" and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- dumps


def test_a_docs_folder_with_an_index_is_not_a_dump(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "guide").mkdir(parents=True)
    (docs / INDEX).write_text("# Welcome\n")
    (docs / "guide" / "install.md").write_text("pip install graphkiln\n")
    before = snapshot(docs)
    config = CompileConfig(dump_dir=str(docs))
    with pytest.raises(ConfigError, match=re.escape(f"dump_dir={str(docs)!r} is not empty and holds no {MARKER}")):
        graphkiln.compile_model("tiny", tmp_path / "out", config)
    assert snapshot(docs) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]  # refused before anything was written


def test_a_dump_is_replaced_only_while_it_holds_just_its_own_files(tmp_path: Path) -> None:
    root = tmp_path / "dump"
    with Dump(root) as dump:
        dump.write("01-pass.before.py", "x = 1\n", "a graph")
    assert json.loads((root / MARKER).read_text())["files"] == ["01-pass.before.py", INDEX]
    with Dump(root) as dump:  # graphkiln's own dump: emptied and written again
        dump.write("02-other.after.py", "y = 2\n", "another graph")
    assert sorted(p.name for p in root.iterdir()) == [MARKER, "02-other.after.py", INDEX]
    (root / "my-notes.md").write_text("what I learned from this dump\n")
    before = snapshot(root)
    with pytest.raises(ConfigError, match=r"holds my-notes\.md, which no earlier dump wrote"):
        with Dump(root):
            pass
    assert snapshot(root) == before
    (root / "my-notes.md").unlink()
    (root / "drafts").mkdir()
    with pytest.raises(ConfigError, match=r"holds drafts, which no earlier dump wrote"):
        with Dump(root):
            pass
    assert (root / "drafts").is_dir()


def test_a_link_to_a_dump_stands_for_that_dump(tmp_path: Path) -> None:
    """The dump a link points at is emptied and written again, the link kept; a link to a folder that is not a
    dump is refused, and what it points at kept."""
    root, link = tmp_path / "dump", tmp_path / "dump-link"
    with Dump(root) as dump:
        dump.write("01-pass.before.py", "x = 1\n", "a graph")
    link.symlink_to(root)
    with Dump(link) as dump:
        dump.write("02-other.after.py", "y = 2\n", "another graph")
    assert link.is_symlink() and sorted(p.name for p in root.iterdir()) == [MARKER, "02-other.after.py", INDEX]
    docs, docs_link = tmp_path / "docs", tmp_path / "docs-link"
    docs.mkdir()
    (docs / "guide.md").write_text("mine\n")
    docs_link.symlink_to(docs)
    with pytest.raises(ConfigError, match=re.escape(f"dump_dir={str(docs)!r} is not empty and holds no {MARKER}")):
        with Dump(docs_link):
            pass
    assert snapshot(docs) == {"guide.md": b"mine\n"}


@pytest.mark.parametrize("where", ["same", "dump-inside-out", "out-inside-dump"])
def test_dump_dir_apart_from_out(tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    dump, relation = {"same": (out, "is"), "dump-inside-out": (out / "dump", "is inside"),
                      "out-inside-dump": (tmp_path, "holds")}[where]  # fmt: skip
    line = compile_error(capsys, "tiny", "-o", out, "--dump-dir", dump)
    assert line.startswith(f"error: --dump-dir {dump} {relation} -o {out}; "), line
    assert list(tmp_path.iterdir()) == []  # no -o folder, no dump folder, nothing in the dump folder given


def test_api_raises_typed_errors(project: Path) -> None:
    with pytest.raises(ArtifactError, match="not a graphkiln manifest"):
        graphkiln.compile_model("tiny", project, SMALL_CONFIG, force=True)
