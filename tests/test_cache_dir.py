"""Values kept in graphkiln's cache while their files stay as they are (cache_dir.py), and Triton's hash of its
own sources kept that way (compat.warm_triton; where Triton is installed); a compile cache that cannot be written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import graphkiln
from graphkiln.cache_dir import kept_while_unchanged
from graphkiln.errors import ConfigError


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package-like folder of files, and graphkiln's cache in a folder of the test's."""
    monkeypatch.setenv("GRAPHKILN_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "pkg"
    (root / "sub" / "__pycache__").mkdir(parents=True)
    (root / "a.py").write_text("a = 1\n")
    (root / "sub" / "lib.so").write_bytes(b"\0" * 64)
    return root


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        return f"value-{self.calls}"


def test_a_value_is_computed_once_and_again_when_a_file_changes(folder: Path) -> None:
    compute = Counting()
    assert kept_while_unchanged("k", folder, compute) == "value-1"
    assert kept_while_unchanged("k", folder, compute) == "value-1" and compute.calls == 1
    (folder / "sub" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"x")  # bytecode does not count
    assert kept_while_unchanged("k", folder, compute) == "value-1" and compute.calls == 1
    (folder / "a.py").write_text("a = 2\n")  # the same size: its modification time differs
    os.utime(folder / "a.py", ns=(1, 1))
    assert kept_while_unchanged("k", folder, compute) == "value-2"
    (folder / "b.py").write_text("")
    assert kept_while_unchanged("k", folder, compute) == "value-3"
    assert kept_while_unchanged("k", folder, compute) == "value-3" and compute.calls == 3


def test_a_corrupt_store_is_computed_again_and_an_unwritable_cache_still_gives_the_value(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compute = Counting()
    kept_while_unchanged("k", folder, compute)
    [store] = (tmp_path / "cache" / "kept").iterdir()
    for corrupt in ("{not json", "[1, 2]", json.dumps({"stamp": 1, "value": 2})):
        store.write_text(corrupt)
        assert kept_while_unchanged("k", folder, compute) == f"value-{compute.calls}"
    assert compute.calls == 4 and [p.name for p in store.parent.iterdir()] == [store.name]  # no partial left
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("GRAPHKILN_CACHE_DIR", str(blocked / "cache"))
    assert kept_while_unchanged("k", folder, compute) == "value-5"
    assert blocked.read_text() == "not a folder"


WARM = """
import sys
import triton.runtime.cache as cache
from graphkiln.compat import warm_triton
if sys.argv[1] == "kept":  # the hash must come from the store: Triton's own would fail
    def refuse():
        raise AssertionError("Triton's hash computed again")
    cache.triton_key = refuse
warm_triton()
print(cache.triton_key())
"""


def test_triton_hash_is_kept_for_the_next_process(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from triton.runtime.cache import triton_key

    env = {**os.environ, "GRAPHKILN_CACHE_DIR": str(tmp_path)}
    outputs = []
    for mode in ("first", "kept"):
        proc = subprocess.run([sys.executable, "-c", WARM, mode], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(proc.stdout.strip())
    assert outputs == [triton_key(), triton_key()]


def test_a_folder_that_cannot_be_walked_means_computing(folder: Path) -> None:
    (folder / "gone.py").symlink_to(folder / "missing.py")  # stat of a dangling link fails
    compute = Counting()
    assert kept_while_unchanged("k", folder, compute) == "value-1"
    assert kept_while_unchanged("k", folder, compute) == "value-2"


def test_a_compile_cache_that_cannot_be_written_names_graphkiln_cache_dir(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve MODEL --compile` with GRAPHKILN_CACHE_DIR a file: the setting to change is named, before any compile
    (whose error would say to pick another folder for -o, which serve does not take)."""
    cache = tmp_path / "cache"
    cache.write_text("not a folder\n")
    monkeypatch.setenv("GRAPHKILN_CACHE_DIR", str(cache))
    with pytest.raises(ConfigError, match="set GRAPHKILN_CACHE_DIR to a writable folder") as info:
        graphkiln.cached_artifact("tiny")
    assert str(info.value).startswith(f"{cache / 'artifacts'}: graphkiln's compile cache cannot be written there")
    assert cache.read_text() == "not a folder\n"
