"""The preparation's own mechanism, with jobs of the tests' own (no model): a failing job is recorded and the
rest run; a job's longest hold of the step lock is recorded."""

from __future__ import annotations

import time

import torch

from graphkiln.runtime.preparation import Preparation, WarmupJob
from graphkiln.runtime.step_lock import StepLock


def test_a_failing_job_is_recorded_and_the_rest_still_run() -> None:
    """The preparation with jobs of its own: one raises; it is logged and recorded, the others run."""
    ran = []

    def fail() -> None:
        raise RuntimeError("no graph for you")

    jobs = [WarmupJob("decode", "1", lambda: ran.append(1)), WarmupJob("decode", "2", fail),
            WarmupJob("decode", "4", lambda: ran.append(4))]  # fmt: skip
    preparation = Preparation(jobs, StepLock(), torch.device("cpu"))
    preparation.start()
    assert preparation.wait(30)
    assert ran == [1, 4]
    assert [(p.key, p.error) for p in preparation.done] == [("1", None), ("2", "RuntimeError: no graph for you"),
                                                            ("4", None)]  # fmt: skip
    assert isinstance(preparation.errors[0], RuntimeError)


class _ThreePartJob:
    """A job with a part off the step lock and a warm-up and a run under it, each sleeping its seconds."""

    kind, key = "decode", "8"

    def __init__(self, unlocked_s: float, warm_s: float, run_s: float) -> None:
        self.unlocked = lambda: time.sleep(unlocked_s)
        self.warm = lambda: time.sleep(warm_s)
        self.run = lambda: time.sleep(run_s)

    def withdraw(self) -> None:
        """Nothing to undo."""


def test_a_jobs_longest_hold_of_the_step_lock_is_recorded() -> None:
    """A job's record says the longest it ran at once under the step lock (the warm-up here), what a step could
    wait behind it, apart from its seconds in all (the part off the lock included)."""
    preparation = Preparation([_ThreePartJob(0.3, 0.12, 0.04)], StepLock(), torch.device("cpu"))
    preparation.start()
    assert preparation.wait(30)
    [done] = preparation.done
    assert done.error is None and done.seconds >= 0.46
    assert 0.12 <= done.longest_locked_s < 0.3
