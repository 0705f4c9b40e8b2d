"""graphkiln's cache folder, and values kept there while the files they were computed from stay as they are.

`kept_while_unchanged` is for a value that costs tenths of a second to compute from a folder of files a process
never changes (Triton's hash of its own 400 MB library, compat.warm_triton): it keeps the value beside the
stamps of every file of the folder (its path, size, modification time and inode, which a reinstall changes)
and gives it back while they match. A folder it cannot walk or a store it cannot read means computing the value;
a store it cannot write (a read-only or full disk) leaves it computed. It writes only its own files, atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """graphkiln's cache folder: GRAPHKILN_CACHE_DIR, else $XDG_CACHE_HOME/graphkiln, else ~/.cache/graphkiln."""
    if root := os.environ.get("GRAPHKILN_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "graphkiln"


def files_stamp(folder: Path) -> str:
    """A digest of every file under `folder` (caches of bytecode aside): relative path, size, modification time
    and inode."""
    digest = hashlib.sha256()
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(parent, name)
            stat = os.stat(path)
            relative = os.path.relpath(path, folder)
            digest.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}\n".encode())
    return digest.hexdigest()


def kept_while_unchanged(name: str, folder: Path, compute: Callable[[], str]) -> str:
    """compute(), kept in cache_root()/kept/ for `folder` (one file per folder) while its files' stamps hold."""
    folder = folder.resolve()
    store = cache_root() / "kept" / f"{name}-{hashlib.sha256(str(folder).encode()).hexdigest()[:16]}.json"
    try:
        stamp = files_stamp(folder)
    except OSError:  # a file gone or unreadable while walking: nothing to keep the value by
        return compute()
    try:
        kept = json.loads(store.read_text())
        if isinstance(kept, dict) and kept.get("stamp") == stamp and isinstance(kept.get("value"), str):
            return kept["value"]
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=store.parent, prefix=f".{store.name}.")
    except OSError:
        return value
    try:
        with os.fdopen(fd, "w") as out:
            json.dump({"folder": str(folder), "stamp": stamp, "value": value}, out)
        os.replace(partial, store)
    except OSError:
        Path(partial).unlink(missing_ok=True)
    return value
