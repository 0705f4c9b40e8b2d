"""The engine's step lock: steps and background preparation (graph captures, warm-ups) take turns.

Re-entrant for its holder (a step may drain, a score steps). A background turn that asks gets
the lock before any step that asks later, so a loop that steps without pause cannot starve the
captures, and a step waits for at most the one capture running when it asks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class StepLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._background_waiting = 0

    @contextlib.contextmanager
    def __call__(self, background: bool = False) -> Iterator[None]:
        self._acquire(background)
        try:
            yield
        finally:
            self._release()

    def _acquire(self, background: bool) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            self._background_waiting += background
            try:
                while self._owner is not None or (not background and self._background_waiting):
                    self._cond.wait()
            finally:
                self._background_waiting -= background
            self._owner, self._depth = me, 1

    def _release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()
