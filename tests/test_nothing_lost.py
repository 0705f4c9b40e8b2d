"""graphkiln deletes or replaces only what it wrote: a dump folder is emptied only when graphkiln's marker
lists every file in it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import graphkiln
from graphkiln import CompileConfig
from graphkiln.errors import ConfigError
from graphkiln.passes.dump import INDEX, MARKER, Dump

pytestmark = pytest.mark.slow


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: what must survive a refused compile."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- dumps


def test_a_docs_folder_with_an_index_is_not_a_dump(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "guide").mkdir(parents=True)
    (docs / INDEX).write_text("# Welcome\n")
    (docs / "guide" / "install.md").write_text("pip install graphkiln\n")
    before = snapshot(docs)
    config = CompileConfig(decode_batch_sizes=(1,), prefill_token_buckets=(16,), dump_dir=str(docs))
    with pytest.raises(ConfigError, match=re.escape(f"dump_dir={str(docs)!r} is not empty and holds no {MARKER}")):
        graphkiln.compile_model("tiny", tmp_path / "out", config)
    assert snapshot(docs) == before


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
