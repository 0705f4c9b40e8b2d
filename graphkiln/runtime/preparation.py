"""What an engine prepares after `load` returns: its CUDA graphs (or, without graphs, one warm-up run per
bucket), one job at a time, in a background thread or at once.

In the background each job takes the engine's step lock (step_lock.py), so a job never runs
beside a step and a step waits for at most one job; the smallest buckets come first, being the
most used. A step whose bucket is not ready yet runs in a larger ready one or without a graph.
A job that raises is logged and recorded, its bucket stays unready (steps run without it), and
the jobs after it still run. `stop()` (the engine's close) lets the running job finish and skips
the rest.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from graphkiln.models.weights_reader import indexed

from .step_lock import StepLock

log = logging.getLogger("graphkiln.runtime")


class Job(Protocol):
    """One bucket's preparation: `kind` ("decode", "prefill", "decode-warmup", ...), `key` (its bucket)."""

    @property
    def kind(self) -> str: ...

    key: str
    run: Callable[[], None]


@dataclass(frozen=True)
class WarmupJob:
    kind: str
    key: str
    run: Callable[[], None]


@dataclass(frozen=True)
class PreparedBucket:
    """One finished job: its kind and bucket, its seconds, when it finished (seconds after the engine
    was built) and, if it raised, the error."""

    kind: str
    key: str
    seconds: float
    done_at_s: float
    error: str | None = None


class Preparation:
    def __init__(self, jobs: list[Job], lock: StepLock, device: torch.device) -> None:
        self.jobs = list(jobs)
        self.planned = len(self.jobs)  # the jobs themselves are dropped once run or stopped
        self.lock = lock
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
            for job in self.jobs:
                if self._stop.is_set():
                    return
                with self.lock(background=background):
                    if self._stop.is_set():
                        return
                    self._run(job)
        finally:
            self.jobs = []  # each holds its graph set: none may outlive the engine
            self.finished_at = time.perf_counter()
            self._finished.set()

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        error = None
        try:
            with torch.inference_mode():
                job.run()
        except Exception as e:  # noqa: BLE001  (recorded and logged: the engine serves on without this bucket)
            self.errors.append(e)
            error = f"{type(e).__name__}: {e}"
            log.error("preparing %s bucket %s failed; its steps run without it:\n%s", job.kind, job.key,
                      traceback.format_exc())  # fmt: skip
        now = time.perf_counter()
        self.done.append(PreparedBucket(job.kind, job.key, now - start, now - self.started, error))

    @property
    def ready(self) -> bool:
        """Every job has run (or the preparation was stopped)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job has run; False if `timeout` seconds passed first."""
        return self._finished.wait(timeout)

    def stop(self) -> None:
        """Skip the jobs not started, wait for the running one (unless called from the job's own thread),
        and drop the jobs: they hold the graph sets and their static buffers, which must not outlive the
        engine's close."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.jobs = []
