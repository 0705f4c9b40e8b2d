"""What an engine prepares after `load` returns: its CUDA graphs (or, without graphs, one warm-up run per
bucket), one job at a time, in a background thread or at once.

In the background each job takes the engine's step lock (step_lock.py), so a job never runs
beside a step and a step waits for at most one job; the smallest buckets come first, being the
most used. A step whose bucket is not ready yet runs in a larger ready one or without a graph.
A job that raises is logged and recorded, its bucket stays unready (steps run without it), and
the jobs after it still run. `stop()` (the engine's close) lets the running job finish and skips
the rest. A capture's warm-up and the capture itself take the lock one after the other, so that a step
waits for the longer of the two at most.

A background load's first job is a `PiecesJob`: it loads the compiled pieces (importing Inductor) off
the step lock, so steps go on, served by the model itself, then switches the runner over under it
and adds the capture or warm-up jobs, which run after it.

In a tensor-parallel group every rank runs the same jobs in the same order (lockstep.py): rank 0
announces each job, every rank runs it, all exchange a `RankReport`, and a job that failed on any rank
is withdrawn on every rank. No part of a job runs before its announcement, the part meant for off the
step lock (the kernels' builds, whose dry steps run the model's collectives) included: a rank running
collectives that the others were not told of would wait for them for ever (NCCL's first collective
creates its communicator, which needs every rank). A group that fails meanwhile (a rank died) ends the
preparation: `wait` and `run_now` raise its RankFailedError.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from graphkiln.errors import GraphkilnError, RankFailedError
from graphkiln.models.switch_interval import lowered_switch_interval
from graphkiln.models.weights_reader import indexed

from .capture_pause import captures_paused, paused_here
from .gc_pauses import collections_deferred
from .late_steps import late_steps_first
from .lockstep import Lockstep, RankReport
from .step_lock import StepLock

log = logging.getLogger("graphkiln.runtime")


class Job(Protocol):
    """One bucket's preparation: `kind` ("decode", "prefill", "decode-warmup", ...), `key` (its bucket);
    `withdraw()` makes the bucket unready again (another rank's job failed)."""

    @property
    def kind(self) -> str: ...

    key: str
    run: Callable[[], None]

    def withdraw(self) -> None: ...


@dataclass(frozen=True)
class WarmupJob:
    kind: str
    key: str
    run: Callable[[], None]

    def withdraw(self) -> None:
        """Nothing to undo: a warm-up readies no bucket, it only runs the code once."""


class PiecesJob:
    """The compiled pieces of an engine that serves eagerly until they are in: `load` (importing Inductor,
    seconds) runs off the step lock, so steps go on meanwhile; `install` then, under the lock, makes the
    runner use them and returns the jobs that prepare their graphs, which run after this one."""

    kind = "pieces"
    key = "compiled"

    def __init__(self, load: Callable[[], object], install: Callable[[object], list[Job]]) -> None:
        self.load = load
        self.install = install
        self.loaded: object = None
        self.finished = threading.Event()  # set once the runner uses the pieces, or either part raised
        self.error: Exception | None = None

    def unlocked(self) -> None:
        try:
            self.loaded = self.load()
        except Exception as e:
            self._fail(e)
            raise

    def run(self) -> list[Job]:
        try:
            jobs = self.install(self.loaded)
        except Exception as e:
            self._fail(e)
            raise
        self.finished.set()
        return jobs

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.finished.set()

    def withdraw(self) -> None:
        """Only one rank loads this way: nothing to undo."""


@dataclass(frozen=True)
class PreparedBucket:
    """One finished job: its kind and bucket, its seconds, when it finished (seconds after the engine
    was built), the longest it ran at once under the step lock (its warm-up or the rest: about what a step
    could wait behind it) and, if it raised (on any rank), the error."""

    kind: str
    key: str
    seconds: float
    done_at_s: float
    error: str | None = None
    ranks: tuple[RankReport, ...] = ()  # tensor parallel: every rank's own report of the job, rank 0 first
    longest_locked_s: float = 0.0


class Preparation:
    """`switch_interval`: the interpreter's switch interval (at most) while a job's part off the step lock runs
    (switch_interval.py): that part is seconds of Python (Inductor's import, the kernels' dry steps), and under
    the default 5 ms a step's every handover of the interpreter lock can wait that long for it."""

    def __init__(self, jobs: list[Job], lock: StepLock, device: torch.device, lockstep: Lockstep | None = None,
                 switch_interval: float | None = None) -> None:  # fmt: skip
        self.jobs = list(jobs)
        self.switch_interval = switch_interval
        self.planned = len(self.jobs)  # the jobs themselves are dropped once run or stopped
        self.lock = lock
        self.lockstep = lockstep
        self.failure: RankFailedError | None = None  # the tensor-parallel group failed: no job runs any more
        self.device = indexed(device)  # selected by the thread the jobs run on
        self.started = time.perf_counter()
        self.done: list[PreparedBucket] = []
        self.finished_at: float | None = None  # time.perf_counter() once every job has run
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    def run_now(self) -> None:
        """Every job in this thread, in order (the caller holds nothing that a job needs)."""
        self._run_jobs(background=False)
        if self.failure is not None:
            raise RankFailedError(*self.failure.args)  # a new one each time: no traceback piles up on it

    def run_one(self, kind: str, key: str) -> None:
        """The job rank 0 announced, on another rank of its group (which runs nothing else meanwhile)."""
        job = next((job for job in self.jobs if (job.kind, job.key) == (kind, key)), None)
        if job is None:
            raise RankFailedError(f"rank 0 announced {kind} bucket {key}, which this rank does not prepare "
                                  f"(it has {[(j.kind, j.key) for j in self.jobs]}): the ranks' engines differ")  # fmt: skip
        self._run(job)

    def skip(self) -> None:
        """No jobs to run: ready at once."""
        self.finished_at = time.perf_counter()
        self._finished.set()

    def start(self) -> None:
        """Run the jobs on a daemon thread; `stop()` or the interpreter's exit ends it."""
        self._thread = threading.Thread(target=self._run_jobs, args=(True,), name="graphkiln-prepare", daemon=True)
        self._thread.start()

    def _run_jobs(self, background: bool) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            for job in self.jobs:  # grows as it goes: a job's run may return the jobs that follow from it
                if self._stop.is_set():
                    return
                start = time.perf_counter()
                error = None
                if hasattr(job, "unlocked") and self.lockstep is None:  # the pieces (Inductor's import), the kernels'
                    # builds: beside the steps; in a group with the job, after its announcement (module docstring)
                    with (late_steps_first(self.lock), collections_deferred(),
                          lowered_switch_interval(self.switch_interval)):
                        error = self._attempt(job.unlocked, job)
                warm = getattr(job, "warm", None)
                warm_s = 0.0
                if warm is not None and self.lockstep is None:  # (a group's warm-ups talk: they run with the job)
                    with captures_paused(), self.lock(background=background):
                        if self._stop.is_set():
                            return
                        warm_start = time.perf_counter()
                        error = self._attempt(warm, job)
                        warm_s = time.perf_counter() - warm_start
                with captures_paused(), self.lock(background=background):  # in this order: capture_pause.py
                    if self._stop.is_set():
                        return
                    self._run(job, start, error, warm_s)
        except RankFailedError as failure:  # the group stopped: no job can run on it any more
            self.failure = RankFailedError(*failure.args)  # kept without the traceback, which holds the engine
            self.errors.append(self.failure)
            log.error("preparation stopped: %s", failure)
        finally:
            self.jobs = []  # each holds its graph set: none may outlive the engine
            self.finished_at = time.perf_counter()
            self._finished.set()

    def _attempt(self, part: Callable[[], object], job: Job) -> str | None:
        """Run one part of a job; None, or the error it raised (recorded and logged: the engine serves on
        without this bucket). Jobs it returns run after the ones already planned."""
        try:
            with torch.inference_mode():
                added = part()
        except Exception as e:  # noqa: BLE001
            self.errors.append(e)
            if self._stop.is_set() or _interpreter_exiting():  # closed meanwhile, or the process is ending (imports
                self._stop.set()  # then fail): nobody waits for this job
                return f"{type(e).__name__}: {e}"
            detail = str(e) if isinstance(e, GraphkilnError) else traceback.format_exc()  # a typed error says it all
            log.error("preparing %s bucket %s failed; its steps run without it: %s", job.kind, job.key, detail)
            return f"{type(e).__name__}: {e}"
        if isinstance(added, list):
            self.jobs.extend(added)
            self.planned += len(added)
        return None

    def _run(self, job: Job, start: float | None = None, error: str | None = None, warm_s: float = 0.0) -> None:
        if self.lockstep is not None:
            self.lockstep.announce(job.kind, job.key)
        start = time.perf_counter() if start is None else start
        run_start = time.perf_counter()
        if error is None:
            error = self._attempt(job.run, job)
        locked_s = max(warm_s, time.perf_counter() - run_start)
        seconds = time.perf_counter() - start
        ranks: tuple[RankReport, ...] = ()
        if self.lockstep is not None:
            report = RankReport(self.lockstep.rank, len(self.done) + 1, seconds, error)
            ranks = self.lockstep.agree(report, job.kind, job.key, self.device)
            failed = [r for r in ranks if r.error is not None]
            if failed and error is None:
                job.withdraw()
                error = "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
                log.error("preparing %s bucket %s failed on another rank (%s); its steps run without it on every rank",
                          job.kind, job.key, error)  # fmt: skip
        self.done.append(PreparedBucket(job.kind, job.key, seconds, time.perf_counter() - self.started, error, ranks,
                                        locked_s))  # fmt: skip

    @property
    def ready(self) -> bool:
        """Every job has run (or the preparation was stopped)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job has run; False if `timeout` seconds passed first. A tensor-parallel group
        that failed meanwhile raises its RankFailedError."""
        finished = self._finished.wait(timeout)
        if self.failure is not None:
            raise RankFailedError(*self.failure.args)  # a new one each time: no traceback piles up on it
        return finished

    def stop(self) -> None:
        """Skip the jobs not started, wait for the running one (unless called from the job's own thread, or
        from inside `captures_paused()`, which the thread may be waiting for),
        and drop the jobs: they hold the graph sets and their static buffers, which must not outlive the
        engine's close."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread() and not paused_here():
            self._thread.join()
        self.jobs = []


def _interpreter_exiting() -> bool:
    """The main thread has ended (the daemon job thread still runs while the interpreter shuts down)."""
    return sys.is_finalizing() or not threading.main_thread().is_alive()
