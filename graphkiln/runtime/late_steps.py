"""A background job's imports give way to a late step.

The pieces job imports Inductor, seconds of Python, beside the engine's eager steps, and the two take turns at
the interpreter lock: a step's Python runs several times slower meanwhile, and a long C call of the job's
(unmarshalling a module) holds the lock throughout. While the block of `late_steps_first` runs, each module
the job's thread imports first looks at the step lock: when a step has held it for more than LATE_S, the
job waits for that step to end (at most MAX_WAIT_S, once a step). Steps that are not late leave the job its
turns, and its waits add up to at most SHARE of its time (plus one MAX_WAIT_S), so a loop of steps that are
all late (a large model's eager steps) does not starve it either. The job may hold other modules' import
locks while it waits: a step that needs one of them waits out the MAX_WAIT_S, no more.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
import time
from collections.abc import Iterator

from .step_lock import StepLock

LATE_S = 0.02  # a step that has run this long gets the interpreter to itself at the job's next import
MAX_WAIT_S = 0.1
SHARE = 0.5  # of the job's time, at most, spent giving way


class _GiveWay(importlib.abc.MetaPathFinder):
    """Finds nothing; on the job's thread, waits for a late step before the import goes on."""

    def __init__(self, lock: StepLock, thread: int) -> None:
        self.lock = lock
        self.thread = thread
        self.last_step = -1
        self.waits = 0
        self.waited_s = 0.0
        self.started = time.perf_counter()

    def find_spec(self, name, path, target=None) -> None:
        if threading.get_ident() != self.thread:
            return None
        running = self.lock.running_step()
        if running is None or running[0] == self.last_step or running[1] <= LATE_S:
            return None
        now = time.perf_counter()
        if self.waited_s > SHARE * (now - self.started):  # then this wait keeps it under SHARE + MAX_WAIT_S
            return None
        self.last_step = running[0]
        self.waits += 1
        self.lock.wait_for_step(running[0], MAX_WAIT_S)
        self.waited_s += time.perf_counter() - now
        return None


@contextlib.contextmanager
def late_steps_first(lock: StepLock) -> Iterator[_GiveWay]:
    """Within the block, this thread's imports give way to a late step (the module's docstring)."""
    finder = _GiveWay(lock, threading.get_ident())
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
