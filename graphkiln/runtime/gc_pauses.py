"""Python's garbage collector kept from pausing the engine's steps.

CPython's full collections stop every thread while they scan the heap, and their cost grows with it.
Importing Inductor makes hundreds of thousands of long-lived objects and sets off several full
collections on the way, each longer than the last; an eager step served beside the import stalls
for each. Within `collections_deferred` (a load, the background preparation; nested or on several
threads, the outermost block decides) automatic collection is off. When the outermost block ends,
if collection was on before it, the objects alive are moved to the permanent generation
(`gc.freeze`) and collection is turned back on: the imported modules and the engine live as long as
the process, and left where they are the first full collection after the block would scan them all,
a pause as long as those it saved, in the middle of serving. The garbage cycles made meanwhile (a
few thousand objects) stay allocated. `collect_all` is a full collection that sees the frozen
objects too, for an engine's close, whose cycles may hold its weights.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False
_froze = False


@contextlib.contextmanager
def collections_deferred() -> Iterator[None]:
    """No automatic collection inside; at the outermost end the heap frozen, where collection was on."""
    global _depth, _was_enabled, _froze
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled and not gc.isenabled():  # the caller may have turned it on meanwhile
                gc.freeze()
                _froze = True
                gc.enable()


def collect_all() -> None:
    """A full collection, the objects frozen here included (frozen again after, as long as they live)."""
    with _lock:
        if _froze:
            gc.unfreeze()
        gc.collect()
        if _froze:
            gc.freeze()
