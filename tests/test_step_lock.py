"""The engine's step lock: steps and background turns alternate, a taker gets its wait, and a background
job's Python gives way to a late step (runtime/late_steps.py) for at most its share of the job's time."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from graphkiln.runtime.late_steps import LATE_S, MAX_WAIT_S, SHARE, late_steps_first
from graphkiln.runtime.step_lock import StepLock


@contextlib.contextmanager
def taken_over_and_over(lock: StepLock, background: bool) -> Iterator[list[float]]:
    """A thread that takes `lock` (as a step, or as a background turn) without pause; the times of its turns."""
    turns, stop = [], threading.Event()

    def take() -> None:
        while not stop.is_set():
            with lock(background=background):
                turns.append(time.perf_counter())
                time.sleep(0.002)

    thread = threading.Thread(target=take)
    thread.start()
    try:
        time.sleep(0.02)
        yield turns
    finally:
        stop.set()
        thread.join()


def test_a_waiting_background_turn_comes_before_the_next_step() -> None:
    """A thread that steps without pause cannot starve a background turn: it gets the lock within one step."""
    lock = StepLock()
    with taken_over_and_over(lock, background=False) as steps:
        asked = time.perf_counter()
        with lock(background=True):
            got = time.perf_counter()
            before = len(steps)
        assert len([t for t in steps[:before] if t > asked]) <= 1  # at most the step that held the lock
        assert got - asked < 1.0


def test_reentrant_for_its_holder() -> None:
    """A holder takes the lock again without waiting on itself (a lock that is not reentrant fails here, in a
    thread given a second, rather than hanging the run)."""
    lock = StepLock()
    done = threading.Event()

    def take_twice() -> None:
        with lock(), lock():
            pass
        with lock(background=True), lock():
            pass
        done.set()

    threading.Thread(target=take_twice, daemon=True).start()
    assert done.wait(1.0), "the lock's holder waited on itself"


class InterruptedOnce(threading.Condition):
    """A condition whose first `with` raises KeyboardInterrupt as it ends, as Python does with a Ctrl-C that
    came while its holder was inside: the interrupt lands after the lock was taken, before its taker returns."""

    armed = True

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


@pytest.mark.parametrize("background", [False, True])
def test_an_interrupt_as_the_lock_is_taken_lets_it_go(background: bool) -> None:
    lock = StepLock()
    lock._cond = InterruptedOnce()
    with pytest.raises(KeyboardInterrupt), lock(background):
        pytest.fail("the block ran although taking the lock was interrupted")
    taken = threading.Event()

    def take() -> None:
        with lock():
            taken.set()

    threading.Thread(target=take, daemon=True).start()
    assert taken.wait(1.0), "the interrupted taker kept the lock"


def test_a_waiting_step_comes_before_the_next_background_turn() -> None:
    """Background turns back to back (a preparation's jobs) let a waiting step in after the current one."""
    lock = StepLock()
    with taken_over_and_over(lock, background=True) as turns:
        asked = time.perf_counter()
        with lock():
            before = len(turns)
        assert len([t for t in turns[:before] if t > asked]) <= 1


def test_a_taker_held_up_by_a_background_turn_gets_its_wait() -> None:
    """A taker that finds the lock free waited 0 s; one that waits behind a background turn gets its wait."""
    lock = StepLock()
    with lock() as waited:
        assert waited == 0.0
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock(background=True):
            taken.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    threading.Timer(0.1, release.set).start()
    with lock() as waited:
        pass
    holder.join()
    assert 0.09 <= waited < 10


def _import_fresh(folder: Path, name: str) -> float:
    """Seconds to import a new module `name` written into `folder` (on sys.path)."""
    (folder / f"{name}.py").write_text("VALUE = 1\n")
    return _timed_import(name)


def _timed_import(name: str) -> float:
    start = time.perf_counter()
    __import__(name)
    return time.perf_counter() - start


def test_a_jobs_imports_give_way_to_a_late_step_and_only_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside late_steps_first, an import waits for a step that has held the lock past LATE_S (once a step, at
    most MAX_WAIT_S), not for a step that has just begun, nor for a background turn; other threads' imports
    never wait."""
    monkeypatch.syspath_prepend(str(tmp_path))
    lock = StepLock()
    held, release = threading.Event(), threading.Event()

    def hold(background: bool) -> None:
        with lock(background=background):
            held.set()
            release.wait(10)

    def timed_import_while_held(name: str, background: bool, age_s: float, release_after_s: float) -> tuple:
        held.clear(), release.clear()
        holder = threading.Thread(target=hold, args=(background,))
        holder.start()
        assert held.wait(10)
        time.sleep(age_s)
        (tmp_path / f"{name}.py").write_text("VALUE = 1\n")  # outside: writing it is a checkpoint too
        with late_steps_first(lock) as finder:
            threading.Timer(release_after_s, release.set).start()  # just before: a busy machine keeps the order
            seconds = _timed_import(name)
        holder.join()
        return seconds, finder.waits

    seconds, waits = timed_import_while_held("gk_late_step", False, LATE_S * 2, 0.05)
    assert waits == 1 and seconds >= 0.04  # waited for the late step to end
    seconds, waits = timed_import_while_held("gk_long_step", False, LATE_S * 2, 1.0)
    assert waits == 1 and MAX_WAIT_S * 0.9 <= seconds < 0.9  # no longer than MAX_WAIT_S
    seconds, waits = timed_import_while_held("gk_background_turn", True, LATE_S * 2, 0.2)
    assert waits == 0 and seconds < 0.1
    release.clear(), held.clear()
    holder = threading.Thread(target=hold, args=(False,))
    holder.start()
    assert held.wait(10)
    time.sleep(LATE_S * 2)
    with late_steps_first(lock) as finder:
        elsewhere = threading.Thread(target=_import_fresh, args=(tmp_path, "gk_other_thread"))
        start = time.perf_counter()
        elsewhere.start()
        elsewhere.join()
        assert time.perf_counter() - start < 0.1 and finder.waits == 0  # another thread's import: no wait
    release.set()
    holder.join()


def test_a_job_among_late_steps_gives_way_for_at_most_its_share(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps back to back, each late (a large model's eager steps): the job's imports give way to some of them,
    and its waits add up to at most SHARE of its time plus one MAX_WAIT_S."""
    monkeypatch.syspath_prepend(str(tmp_path))
    lock, stop = StepLock(), threading.Event()

    def steps() -> None:
        while not stop.is_set():
            with lock():
                time.sleep(LATE_S * 4)

    stepping = threading.Thread(target=steps)
    stepping.start()
    try:
        start = time.perf_counter()
        with late_steps_first(lock) as finder:
            for i in range(30):
                _import_fresh(tmp_path, f"gk_among_steps_{i}")
                time.sleep(0.01)
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        stepping.join()
    assert finder.waits > 1
    assert finder.waited_s <= SHARE * elapsed + MAX_WAIT_S + 0.02


def test_a_jobs_long_module_body_gives_way_to_a_step_that_turns_late_inside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module whose body runs long (here: code compiled and run in a loop, as dataclasses do) looks at the
    step lock at its audit events, not only at its imports: a step that starts during the body and turns late
    pauses the body until it ends."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "gk_long_body.py").write_text(
        "import time\nTIMES = []\nwhile not TIMES or time.perf_counter() - TIMES[0] < 0.6:\n"
        "    exec('x = 1')\n    TIMES.append(time.perf_counter())\n    time.sleep(0.002)\n"
    )
    lock = StepLock()
    window = []

    def step() -> None:
        time.sleep(0.15)
        with lock():
            window.append(time.perf_counter())
            time.sleep(0.08)
            window.append(time.perf_counter())

    stepping = threading.Thread(target=step)
    stepping.start()
    with late_steps_first(lock) as finder:
        import gk_long_body  # noqa: PLC0415
    stepping.join()
    times = gk_long_body.TIMES
    gaps = [(b - a, a) for a, b in zip(times, times[1:])]
    longest, at = max(gaps)
    assert finder.waits == 1
    assert longest >= 0.08 - LATE_S - 0.01  # paused from the step's turning late to its end
    assert window[0] <= at <= window[1]
