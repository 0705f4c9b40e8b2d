"""Tensor-parallel preparation in lockstep (runtime/lockstep.py) with jobs of the tests' own: a real gloo
group of 2 ranks, rank 1 in a process of its own, each job an all-reduce that fails on rank 1 after
or before its collective, or one whose part meant for off the step lock runs it (as the kernels' builds'
dry steps do)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graphkiln.errors import RankFailedError
from graphkiln.runtime.lockstep import Lockstep
from graphkiln.runtime.preparation import Preparation
from graphkiln.runtime.step_lock import StepLock


@dataclasses.dataclass
class SummingJob:
    """A preparation job that runs a collective, as a warm-up or a capture's warm-up does, then fails on
    `failing_rank` (as a capture can, after its warm-up ran); or fails there before its collective."""

    kind: str
    key: str
    failing_rank: int | None = None
    before_collective: bool = False
    withdrawn: bool = False

    def run(self) -> None:
        failing = dist.get_rank() == self.failing_rank
        if failing and self.before_collective:
            raise RuntimeError(f"failed before the collective of {self.key}")
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 2
        if failing:
            raise RuntimeError(f"no capture for {self.key} here")

    def withdraw(self) -> None:
        self.withdrawn = True


@dataclasses.dataclass
class BuildingJob:
    """A job shaped like the kernels' builds (KernelBuildsJob): a part meant for off the step lock that runs a
    collective, and a run that does that part where it has not run yet."""

    kind: str
    key: str
    built: bool = False

    def unlocked(self) -> None:
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 2
        self.built = True

    def run(self) -> None:
        if not self.built:
            self.unlocked()

    def withdraw(self) -> None:
        """Nothing to undo."""


def summing_jobs(before_collective: bool | None) -> list[SummingJob | BuildingJob]:
    """Jobs 1-3 with job 2 failing on rank 1 after or before its collective; None: a BuildingJob between
    two plain ones, failing nowhere."""
    if before_collective is None:
        return [SummingJob("sum", "1"), BuildingJob("kernels", "built"), SummingJob("sum", "3")]
    return [SummingJob("sum", "1"), SummingJob("sum", "2", 1, before_collective), SummingJob("sum", "3")]


def _follow_summing_jobs(store_path: str, before_collective: bool | None, timeout_s: float) -> None:
    from graphkiln.runtime.lockstep import receive
    from graphkiln.runtime.tensor_parallel import _init_groups, _joining_key

    store = dist.FileStore(store_path, 2)
    store.set(_joining_key(1), "1")
    control = _init_groups(1, 2, store, "cpu", timeout_s)
    preparation = Preparation(summing_jobs(before_collective), StepLock(), torch.device("cpu"), Lockstep(control))
    while (message := receive(control)) is not None:
        preparation.run_one(message.kind, message.key)
    dist.destroy_process_group()


@contextlib.contextmanager
def summing_group(tmp_path: Path, before_collective: bool | None,
                  timeout_s: float) -> Iterator[tuple[Preparation, list]]:  # fmt: skip
    """Rank 0 here and rank 1 in a process of its own, each preparing `summing_jobs`; rank 0's started
    (yielded with its jobs, which the preparation drops once they have run)."""
    from graphkiln.runtime.tensor_parallel import Peers, _init_groups, _wait_for_ranks

    store_path = str(tmp_path / "store")
    store = dist.FileStore(store_path, 2)
    args = (store_path, before_collective, timeout_s)
    worker = torch.multiprocessing.get_context("spawn").Process(target=_follow_summing_jobs, args=args)
    worker.start()
    _wait_for_ranks(store, {1: worker}, 60)
    control = _init_groups(0, 2, store, "cpu", timeout_s)
    peers = Peers(2, control, {1: worker}, None, timeout_s)
    jobs = summing_jobs(before_collective)
    preparation = Preparation(jobs, StepLock(), torch.device("cpu"), Lockstep(control, peers))
    preparation.start()
    try:
        yield preparation, jobs
    finally:
        peers.close()
    assert worker.exitcode is not None and not dist.is_initialized()


def test_a_job_failing_on_one_rank_is_skipped_on_all(tmp_path: Path) -> None:
    """Rank 1's job 2 fails after its collective: rank 0, where it succeeded, withdraws it and names rank 1;
    job 3 still runs on both ranks."""
    with summing_group(tmp_path, before_collective=False, timeout_s=60) as (preparation, jobs):
        assert preparation.wait(60)
    assert [job.withdrawn for job in jobs] == [False, True, False]
    assert [p.error for p in preparation.done] == [None, "rank 1: RuntimeError: no capture for 2 here", None]
    assert [[(r.rank, r.done, r.error is None) for r in p.ranks] for p in preparation.done] == [
        [(0, 1, True), (1, 1, True)], [(0, 2, True), (1, 2, False)], [(0, 3, True), (1, 3, True)]]  # fmt: skip


def test_a_job_failing_between_collectives_stops_the_group(tmp_path: Path) -> None:
    """Rank 1's job 2 fails before its collective: rank 0's times out, and the world group, out of step now,
    fails its check too: the preparation stops with RankFailedError after a few timeouts, no hang."""
    timeout_s = 2.0
    start = time.monotonic()
    with summing_group(tmp_path, before_collective=True, timeout_s=timeout_s) as (preparation, _):
        with pytest.raises(RankFailedError, match="preparing sum bucket 2"):
            preparation.wait(60)
    assert [p.key for p in preparation.done] == ["1"] and preparation.done[0].error is None
    assert time.monotonic() - start < 30


def test_a_jobs_collectives_off_the_step_lock_wait_for_its_announcement(tmp_path: Path) -> None:
    """A job whose part meant for off the step lock runs a collective (the kernels' builds' dry steps) runs it on
    rank 0 only once rank 1 is told of the job, as its other collectives: before it, rank 0's collective would
    wait for a rank waiting for the announcement (gloo times out; NCCL's communicator set-up waits for ever)."""
    with summing_group(tmp_path, before_collective=None, timeout_s=10) as (preparation, jobs):
        assert preparation.wait(60)
    assert [p.error for p in preparation.done] == [None, None, None]
    assert jobs[1].built and [[r.rank for r in p.ranks] for p in preparation.done] == [[0, 1]] * 3
