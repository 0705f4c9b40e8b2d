"""The engine's step lock: steps and background preparation (graph captures, warm-ups) take turns.

Re-entrant for its holder (a step may drain, a score steps). Turns alternate while both sides
ask: a background turn that asks gets the lock before the next step, and a step that waited gets
it before the next background turn. So a loop that steps without pause cannot starve the
captures, and a step waits for at most one capture. Taking the lock gives the seconds this taker
waited for it (0 when it was free), which the engine keeps for its steps (`StepWaits`): the stall a
request felt behind a capture.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class StepWaits:
    """Steps that found the lock taken, by a capture, a warm-up or another thread's call: how many, their
    seconds waiting in all, and the longest wait."""

    count: int = 0
    total_s: float = 0.0
    longest_s: float = 0.0

    def add(self, seconds: float) -> StepWaits:
        return StepWaits(self.count + 1, self.total_s + seconds, max(self.longest_s, seconds))


class _Held:
    """Whether one acquisition took the lock (so its release lets it go)."""

    __slots__ = ("taken",)

    def __init__(self) -> None:
        self.taken = False


class StepLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._background = False  # whether the holder took a background turn
        self._background_waiting = 0
        self._steps_waiting = 0
        self._step_turn = False  # a background turn just ended while a step waited: that step goes next
        self._steps = 0  # steps that took the lock so far
        self._step_since = 0.0  # when the step holding the lock took it

    @contextlib.contextmanager
    def __call__(self, background: bool = False) -> Iterator[float]:
        """Hold the lock for the block; the block gets the seconds it waited for it (0.0 if it was free).

        An interrupt (KeyboardInterrupt) at any point lets go of exactly what was taken: `held` is set in the
        same run of plain assignments that takes the lock, with no call between them where Python could raise
        the interrupt."""
        held = _Held()
        try:
            yield self._acquire(background, held)
        finally:
            if held.taken:
                self._release()

    def _acquire(self, background: bool, held: _Held) -> float:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                held.taken = True
                return 0.0
            if background:
                self._background_waiting += 1
            else:
                self._steps_waiting += 1
            asked = time.perf_counter()
            waited = False
            try:
                while self._owner is not None or (
                    self._step_turn if background else self._background_waiting and not self._step_turn
                ):
                    waited = True
                    self._cond.wait()
            finally:
                if background:
                    self._background_waiting -= 1
                else:
                    self._steps_waiting -= 1
            now = time.perf_counter()
            self._owner, self._depth, self._background = me, 1, background
            held.taken = True
            if not background:
                self._step_turn = False
                self._steps += 1
                self._step_since = now
            return now - asked if waited else 0.0

    def _release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._step_turn = self._background and self._steps_waiting > 0
                self._cond.notify_all()

    def running_step(self) -> tuple[int, float] | None:
        """(which step, seconds it has held the lock) of the step holding it; None when no step does."""
        with self._cond:
            if self._owner is None or self._background:
                return None
            return self._steps, time.perf_counter() - self._step_since

    def wait_for_step(self, step: int, timeout: float) -> None:
        """Wait until step number `step` has let the lock go, or `timeout` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._steps != step or self._owner is None or self._background, timeout)
