"""A background job's Python gives way to a late step.

The pieces job imports Inductor, seconds of Python, beside the engine's eager steps, and the two take turns at
the interpreter lock: a step's Python runs several times slower meanwhile. While the block of
`late_steps_first` runs, the job's thread looks at the step lock at each checkpoint: each module it imports
first, and each audit event it raises (a module's code read, unmarshalled and run, the code dataclasses and
namedtuples generate compiled and run, a frame looked up), which come every few milliseconds of an import,
where modules alone can be a hundred milliseconds apart. When a step has held the lock for more than LATE_S,
the job waits for that step to end (at most MAX_WAIT_S, once a step). Steps that are not late leave the job
its turns, and its waits add up to at most SHARE of its time (plus one MAX_WAIT_S), so a loop of steps that
are all late (a large model's eager steps) does not starve it either. The job may hold locks while it waits (a
module's import lock, say): a step that needs one of them waits out the MAX_WAIT_S, no more.

Audit hooks cannot be removed, so one is added per process, the first time a block runs; outside the blocks
it looks at an empty list and returns.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
import time
from collections.abc import Iterator

from .step_lock import StepLock

LATE_S = 0.005  # a step that has run this long gets the interpreter to itself at the job's next checkpoint
MAX_WAIT_S = 0.1
SHARE = 0.5  # of the job's time, at most, spent giving way

_giving_way: list[_GiveWay] = []  # the blocks running now
_hook_lock = threading.Lock()
_hooked = False


class _GiveWay(importlib.abc.MetaPathFinder):
    """Finds nothing; on the job's thread, waits for a late step at each checkpoint (an import, an audit event)."""

    def __init__(self, lock: StepLock, thread: int) -> None:
        self.lock = lock
        self.thread = thread
        self.last_step = -1
        self.waits = 0
        self.waited_s = 0.0
        self.started = time.perf_counter()

    def find_spec(self, name, path, target=None) -> None:
        self.checkpoint()
        return None

    def checkpoint(self) -> None:
        """On the job's thread: wait for a late step this block has not waited for, within SHARE."""
        if threading.get_ident() != self.thread:
            return
        running = self.lock.running_step()
        if running is None or running[0] == self.last_step or running[1] <= LATE_S:
            return
        now = time.perf_counter()
        if self.waited_s > SHARE * (now - self.started):  # then this wait keeps it under SHARE + MAX_WAIT_S
            return
        self.last_step = running[0]
        self.waits += 1
        self.lock.wait_for_step(running[0], MAX_WAIT_S)
        self.waited_s += time.perf_counter() - now


def _on_audit_event(event: str, args: tuple) -> None:
    for give_way in _giving_way:
        give_way.checkpoint()


def _hook_audit_events() -> None:
    global _hooked
    with _hook_lock:
        if not _hooked:
            sys.addaudithook(_on_audit_event)
            _hooked = True


@contextlib.contextmanager
def late_steps_first(lock: StepLock) -> Iterator[_GiveWay]:
    """Within the block, this thread's Python gives way to a late step (the module's docstring)."""
    _hook_audit_events()
    finder = _GiveWay(lock, threading.get_ident())
    sys.meta_path.insert(0, finder)
    _giving_way.append(finder)
    try:
        yield finder
    finally:
        _giving_way.remove(finder)
        sys.meta_path.remove(finder)
