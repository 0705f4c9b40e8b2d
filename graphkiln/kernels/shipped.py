"""graphkiln's Triton kernels carried in an artifact, so a first start on a machine whose Triton cache lacks them
reads them instead of building them (seconds to the first token, and builds beside the first steps).

Triton keeps each kernel it builds in its cache folder, one entry per cache key (a hash of the kernel's source,
its specialization and options, Triton's own sources, the ptxas version and the GPU): the compiled files and a
group file (`__grp__<kernel>.json`) that lists them by absolute path. The compile-model run that loads its
artifact once (`graphkiln.api.build_serving_kernels`) copies the entries of every graphkiln kernel that load
built or read (`ship_loaded_kernels`); a load copies those its machine's cache lacks into it before any of ours
launches (`install_shipped_kernels`), each group file pointed at its new place. On a machine of another kind or
with another Triton, torch or ptxas the keys differ and the entries are never read. The files are listed with
their sha256 in the manifest, like the compiled pieces.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRITON_KERNELS = "triton-kernels"
GROUP_PREFIX = "__grp__"
WRAPPERS_MAX = 4

log = logging.getLogger(__name__)


def ship_loaded_kernels(dest: Path) -> int:
    """Copy the Triton cache entry of every graphkiln kernel this process has built or read into `dest`, one
    folder per entry; how many. Nothing is copied where Triton's internals are not as expected."""
    folders = {Path(path).parent for kernel in _loaded_kernels() for path in kernel.metadata_group.values()}
    shipped = 0
    for folder in sorted(folders):
        groups = list(folder.glob(f"{GROUP_PREFIX}*.json"))
        if not groups:
            continue
        (dest / folder.name).mkdir(parents=True, exist_ok=True)
        for file in folder.iterdir():
            if file.is_file() and not file.name.startswith("."):
                shutil.copyfile(file, dest / folder.name / file.name)
        shipped += 1
    return shipped


def install_shipped_kernels(shipped: Path, cache: Path | None = None) -> None:
    """Put the entries under `shipped` that Triton's cache folder (`cache`, else Triton's current one) lacks into
    it, each whole or not at all (written beside it and renamed into place), so that graphkiln's kernels are
    read there rather than built. Best effort: the first entry that cannot be put there ends it with a warning,
    and Triton builds what is missing."""
    if not shipped.is_dir():
        return
    if cache is None:
        from triton import knobs

        cache = Path(knobs.cache.dir)
    for entry in sorted(p for p in shipped.iterdir() if p.is_dir()):
        target = cache / entry.name
        if target.exists():
            continue
        try:
            _install(entry, target)
        except (OSError, ValueError, KeyError, TypeError) as e:  # (the files' sha256 matched the manifest's)
            log.warning("%s: could not put the artifact's Triton kernels into Triton's cache %s (%s: %s); those "
                        "missing there are built at their first use", shipped, cache, type(e).__name__, e)  # fmt: skip
            return


def _install(entry: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        for file in entry.iterdir():
            if file.name.startswith(GROUP_PREFIX):
                group = json.loads(file.read_text())
                group["child_paths"] = {name: str(target / Path(path).name)
                                        for name, path in group["child_paths"].items()}  # fmt: skip
                (staging / file.name).write_text(json.dumps(group))
            else:
                shutil.copyfile(file, staging / file.name)
        staging.chmod(0o755)
        os.rename(staging, target)
    except OSError:
        if not target.exists():  # (else another process put the entry there meanwhile: theirs stays)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _loaded_kernels() -> Iterator[Any]:
    """Every compiled kernel of graphkiln's Triton functions in this process (Triton's per-device caches)."""
    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("graphkiln.kernels.") or module is None:
            continue
        for value in list(vars(module).values()):
            for _ in range(WRAPPERS_MAX):  # an autotuner's or heuristics' wrapper holds the function as `fn`
                if hasattr(value, "device_caches") or not hasattr(value, "fn"):
                    break
                value = value.fn
            caches = getattr(value, "device_caches", None)
            if not isinstance(caches, dict) or id(value) in seen:
                continue
            seen.add(id(value))
            for cache in caches.values():
                kernels = cache[0] if isinstance(cache, tuple) and cache and isinstance(cache[0], dict) else {}
                yield from (k for k in kernels.values() if isinstance(getattr(k, "metadata_group", None), dict))
