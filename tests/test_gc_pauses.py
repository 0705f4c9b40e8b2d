"""Collection pauses kept from the engine's steps (runtime/gc_pauses.py): no automatic collection inside the
blocks, the heap frozen at the outermost end where collection was on, and a close's collection that sees it."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from graphkiln.runtime.gc_pauses import collect_all, collections_deferred


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only a collection frees it


@pytest.fixture
def collection_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_nested_blocks_turn_collection_off_and_the_outermost_freezes_and_turns_it_back_on(collection_on) -> None:
    frozen = gc.get_freeze_count()
    with collections_deferred():
        assert not gc.isenabled()
        node = Node()
        inner_done = threading.Event()

        def inner() -> None:
            with collections_deferred():
                pass
            inner_done.set()

        threading.Thread(target=inner).start()
        assert inner_done.wait(10)
        assert not gc.isenabled()  # another thread's inner block ended: still off
    assert gc.isenabled()
    assert gc.get_freeze_count() > frozen  # the objects alive at the end, node among them
    freed = weakref.ref(node)
    del node
    gc.collect()
    assert freed() is not None  # frozen: a plain collection does not see it
    collect_all()
    assert freed() is None


def test_collection_turned_off_by_the_caller_stays_off_and_nothing_is_frozen() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        frozen = gc.get_freeze_count()
        with collections_deferred():
            node = Node()
        # Frozen objects freed by their last reference leave the count, so it may fall; a freeze would raise it
        # by every object alive.
        assert not gc.isenabled() and gc.get_freeze_count() <= frozen
        freed = weakref.ref(node)
        del node
        gc.collect()
        assert freed() is None
    finally:
        if was:
            gc.enable()
