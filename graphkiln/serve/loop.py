"""The engine's own thread: the one place that touches the engine while a server runs.

The engine is not thread-safe, so one thread owns it. HTTP handlers, on the asyncio loop, put
submissions and aborts on a queue (`submit`, `abort`) and wake the thread; the thread adds and aborts
requests in arrival order, runs `Engine.step()` while there is work and sleeps on a condition
otherwise (no polling), and after every step hands the new TokenEvents of all requests to the asyncio
loop in one `call_soon_threadsafe`, which puts each request's `Update` on its handler's asyncio queue.
A request that fails inside a step finishes with finish_reason "error" and its error (the engine fails
only the request at fault); anything else a step raises fails the requests then running, and the thread
serves on, but for RankFailedError: a tensor-parallel group that stopped serves nothing more, so the thread ends
(/health says 503) and tells `on_engine_stopped`. Stopping the loop fails what is left with ServerStopping.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from graphkiln.errors import GraphkilnError, RankFailedError
from graphkiln.runtime.engine import Engine
from graphkiln.runtime.readback import TokenEvent
from graphkiln.runtime.sampling_params import SamplingParams
from graphkiln.runtime.scheduler import Sequence

log = logging.getLogger("graphkiln.serve")
SNAPSHOT_EVERY_S = 0.05


class ServerStopping(GraphkilnError):
    """The server stopped (or its engine thread died) before the request finished."""


@dataclass(eq=False)
class Job:
    """One engine request (one prompt, one choice) of an HTTP request, as its handler sees it. The timing
    and count fields are written on the asyncio loop as updates arrive."""

    index: int  # the choice's index in the response
    prompt_ids: list[int]
    params: SamplingParams
    updates: asyncio.Queue[Update]  # shared by the jobs of one HTTP request
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    num_tokens: int = 0
    finish_reason: str | None = None  # as the client saw it (a stop string ends a job the engine saw aborted)
    seq: Sequence | None = field(default=None, repr=False)  # the engine thread's


@dataclass(frozen=True)
class Update:
    """New tokens of one job; the job's last update carries its finish_reason (and error, if it failed)."""

    job: Job
    events: list[TokenEvent]
    finish_reason: str | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine as its thread last saw it, for /metrics (read on the asyncio loop, written whole)."""

    running: int = 0
    waiting: int = 0
    kv_blocks: int = 0
    kv_blocks_used: int = 0
    graph_replays: dict[str, int] = field(default_factory=dict)  # kind -> replays
    steps_without_graph: dict[str, int] = field(default_factory=dict)  # kind -> steps


class EngineLoop:
    """Owns `engine` on a thread of its own; `submit` and `abort` are called on the asyncio loop `start` got."""

    def __init__(self, engine: Engine, on_finish: Callable[[Job], None] = lambda job: None,
                 on_engine_stopped: Callable[[BaseException], None] = lambda error: None) -> None:  # fmt: skip
        self.engine = engine
        self.on_finish = on_finish
        self.on_engine_stopped = on_engine_stopped
        self.snapshot = EngineSnapshot()
        self.unfinished = 0  # jobs submitted and not finished: what the server's queue bound counts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Condition()
        self._inbox: list[tuple[bool, Job]] = []  # (submit?, job), in arrival order
        self._stopping = False
        self._jobs: list[Job] = []  # the engine thread's: jobs in the engine
        self._snapshot_at = 0.0
        self._thread = threading.Thread(target=self._run, name="graphkiln-engine", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._take_snapshot()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, jobs: list[Job]) -> None:
        now = time.perf_counter()
        for job in jobs:
            job.submitted = now
        with self._wake:
            if self._stopping or not self._thread.is_alive():
                raise ServerStopping("the engine thread is not running")
            self._inbox += [(True, job) for job in jobs]
            self._wake.notify()
        self.unfinished += len(jobs)

    def abort(self, jobs: list[Job]) -> None:
        """Abort the jobs not finished yet; their blocks are freed at the thread's next turn."""
        with self._wake:
            self._inbox += [(False, job) for job in jobs if job.finished is None]
            self._wake.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail what is left with ServerStopping and end the thread (the engine is free to close after)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # The engine thread.

    def _run(self) -> None:
        error: BaseException = ServerStopping("the server is shutting down")
        try:
            while True:
                idle = not self.engine.has_work()
                if idle:
                    self._take_snapshot()
                commands = self._take(wait=idle)
                if commands is None:
                    break
                for submit, job in commands:
                    self._add(job) if submit else self._abort(job)
                if self.engine.has_work():
                    self._step()
                self._deliver()
                if time.perf_counter() - self._snapshot_at > SNAPSHOT_EVERY_S:
                    self._take_snapshot()
        except BaseException as e:  # the thread is dying: every handler still waiting must hear why
            log.exception("the engine thread stopped")
            error = ServerStopping(f"the engine thread stopped ({type(e).__name__}: {e})")
            self.on_engine_stopped(e)
        finally:
            with self._wake:
                self._stopping = True
                left = [job for submit, job in self._inbox if submit]
            for job in self._jobs + left:
                self._fail(job, error)
            self._jobs = []

    def _take(self, wait: bool) -> list[tuple[bool, Job]] | None:
        """The commands that arrived (waiting for one if `wait`), or None once stopping."""
        with self._wake:
            while wait and not self._inbox and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            commands, self._inbox = self._inbox, []
        return commands

    def _add(self, job: Job) -> None:
        try:
            job.seq = self.engine.add_request(job.prompt_ids, job.params, stream=True)
        except GraphkilnError as e:  # the handler checked the request; an engine that disagrees fails it alone
            self._send([Update(job, [], "error", e)])
            return
        self._jobs.append(job)

    def _abort(self, job: Job) -> None:
        if job.seq is not None and job.seq.finish_reason is None:
            self.engine.abort(job.seq)

    def _step(self) -> None:
        try:
            self.engine.step()
        except RankFailedError:
            raise
        except Exception as e:  # the engine fails a request at fault itself; this is a fault of the engine's own
            log.exception("an engine step raised; failing the requests it was running")
            for job in [job for job in self._jobs if job.seq.finish_reason is None]:
                self._jobs.remove(job)
                self._fail(job, e)

    def _fail(self, job: Job, error: BaseException) -> None:
        try:
            self._abort(job)
        except Exception:  # the engine is past helping; the handler must hear anyway
            log.exception("aborting request %s failed", job.seq and job.seq.request_id)
        self._send([Update(job, [], "error", error)])

    def _deliver(self) -> None:
        """Hand every job's new events to the asyncio loop, in one call for all of them."""
        updates, running = [], []
        for job in self._jobs:
            seq = job.seq
            events = list(seq.events)
            seq.events.clear()
            if seq.finish_reason is not None:
                updates.append(Update(job, events, seq.finish_reason, seq.error))
            else:
                running.append(job)
                if events:
                    updates.append(Update(job, events))
        self._jobs = running
        self._send(updates)

    def _send(self, updates: list[Update]) -> None:
        if updates:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, updates)
            except RuntimeError:  # the asyncio loop is closed: no handler is left to tell
                pass

    def _take_snapshot(self) -> None:
        stats, capacity = self.engine.stats(), self.engine.allocator.capacity
        self.snapshot = EngineSnapshot(
            running=stats.running, waiting=stats.waiting, kv_blocks=capacity,
            kv_blocks_used=capacity - stats.free_blocks,
            graph_replays={kind: sum(g.replays.values()) for kind, g in stats.graphs.items()},
            steps_without_graph=dict(stats.steps_without_graph),
        )  # fmt: skip
        self._snapshot_at = time.perf_counter()

    # The asyncio loop.

    def _dispatch(self, updates: list[Update]) -> None:
        now = time.perf_counter()
        for update in updates:
            job = update.job
            if update.events:
                job.num_tokens += len(update.events)
                if job.first_token is None:
                    job.first_token = now
            if update.finish_reason is not None and job.finished is None:
                job.finished = now
                job.finish_reason = job.finish_reason or update.finish_reason
                self.unfinished -= 1
                self.on_finish(job)
            job.updates.put_nowait(update)
