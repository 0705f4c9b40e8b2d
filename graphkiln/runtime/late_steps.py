"""A background job's imports give way to a late step.

The pieces job imports Inductor, seconds of Python, beside the engine's eager steps, and the two take turns at
the interpreter lock: a step's Python runs several times slower meanwhile, and a long C call of the job's
(unmarshalling a module) holds the lock throughout. While the block of `late_steps_first` runs, each module
the job's thread imports first looks at the step lock: when a step has held it for more than LATE_S, the
job waits for that step to end (at most MAX_WAIT_S, once a step). Steps that are not late leave the job its
turns, so a loop that steps without pause does not starve it. The job may hold other modules' import locks
while it waits: a step that needs one of them waits out the MAX_WAIT_S, no more.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from collections.abc import Iterator

from .step_lock import StepLock

LATE_S = 0.02  # a step that has run this long gets the interpreter to itself at the job's next import
MAX_WAIT_S = 0.1


class _GiveWay(importlib.abc.MetaPathFinder):
    """Finds nothing; on the job's thread, waits for a late step before the import goes on."""

    def __init__(self, lock: StepLock, thread: int) -> None:
        self.lock = lock
        self.thread = thread
        self.last_step = -1
        self.waits = 0

    def find_spec(self, name, path, target=None) -> None:
        if threading.get_ident() != self.thread:
            return None
        running = self.lock.running_step()
        if running is not None and running[0] != self.last_step and running[1] > LATE_S:
            self.last_step = running[0]
            self.waits += 1
            self.lock.wait_for_step(running[0], MAX_WAIT_S)
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
