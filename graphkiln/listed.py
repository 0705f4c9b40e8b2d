"""What in a folder graphkiln wrote: an artifact's manifest and a dump's marker each list their files, and a
folder may be replaced or emptied only while it holds nothing else. Sits at the bottom with errors and the
version: the compiler and the passes both use it, and it imports neither torch nor the rest."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath


def first_unlisted(root: Path, listed: Iterable[str]) -> str | None:
    """The first path under `root` (relative, in sorted order) that is neither a listed file nor a folder on the
    way to one, a symbolic link counting as a file; None when everything there is listed."""
    files = set(listed)
    folders = {str(parent) for name in files for parent in PurePosixPath(name).parents}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel not in (folders if path.is_dir() and not path.is_symlink() else files):
            return rel
    return None
