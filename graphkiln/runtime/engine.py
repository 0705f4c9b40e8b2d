"""The engine: requests in, one scheduled step at a time, sampled tokens out.

It owns the scheduler and drives a runner (eager reference, or compiled), which samples on the
device. Steps are pipelined one deep: `step()` launches the next step, then reads back the
previous one's token ids, so the host schedules and packs step N+1 while the device still runs
step N. A token not read back yet sits in its sequence as PENDING; the step that consumes it
takes it from the previous step's device output. A sequence that stops on a token found only at
read-back had one more step launched for it: that row is dropped.

A step that raises fails only the requests involved. Sequences change only once a launch went
through, so a failed launch leaves them as they were: a step of one request fails it (finish_reason
"error", the error on `Sequence.error`, its blocks freed); the requests of a step of several run
alone next, one step each, so only the one at fault fails. An interrupt (KeyboardInterrupt) leaves
no half-done state either: a read-back it cuts short stays in flight, and the next read skips the
rows already read.

Graphs are prepared in the background after the engine is built (preparation.py): every step,
score, stats read and close holds the step lock (step_lock.py), which a capture holds between steps.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Sequence as Seq

import torch

from graphkiln.errors import CapacityError, ConfigError, RankFailedError, RequestError

from .batch import PendingIds
from .config import EngineConfig
from .gc_pauses import collect_all
from .kv_cache import BlockAllocator
from .preparation import PiecesJob, Preparation
from .readback import LaunchedStep, ReadBack, TokenEvent, token_logprobs
from .runner import ModelRunner
from .sampler import SamplingBatch
from .sampling_params import MAX_LOGPROBS, SamplingParams
from .scheduler import PENDING, ScheduledChunk, Scheduler, Sequence
from .stats import EngineStats, GraphStats
from .step_lock import StepLock, StepWaits

log = logging.getLogger("graphkiln.runtime")


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        eos_token_ids: Seq[int],
        vocab_size: int,
        config: EngineConfig,
        lock: StepLock | None = None,
        preparation: Preparation | None = None,
    ) -> None:
        self.runner = runner
        self.lock = lock or StepLock()
        if preparation is None:
            preparation = Preparation([], self.lock, runner.device)
            preparation.skip()
        self.preparation = preparation
        self.pieces = next((job for job in preparation.jobs if isinstance(job, PiecesJob)), None)
        self.first_token_at: float | None = None  # time.perf_counter() when the first token was read back
        self.step_waits = StepWaits()  # steps held up by a capture or warm-up (or another thread's call)
        self.scheduler = scheduler
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.requests: dict[int, Sequence] = {}
        self.read_back = ReadBack(scheduler.max_num_seqs, min(MAX_LOGPROBS, vocab_size), runner.device)
        self.in_flight: deque[LaunchedStep] = deque()  # launched, not read back: one (two after an interrupted read)

    @property
    def allocator(self) -> BlockAllocator:
        return self.scheduler.allocator

    def stats(self) -> EngineStats:
        with self.lock():
            return self._stats()

    def _stats(self) -> EngineStats:
        runner = self.runner
        graphs = runner.graph_sets()
        return EngineStats(
            device=str(runner.device),
            attention_backend=runner.backend.name,
            config=self.config,
            max_context=self.scheduler.max_context,
            kv_cache_blocks=runner.kv_cache.num_blocks,
            kv_cache_bytes=runner.kv_cache.nbytes,
            free_blocks=self.allocator.num_free,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            graphs={g.graphs.kind: GraphStats.of(g.graphs) for g in graphs},
            steps_without_graph=dict(runner.steps_without_graph),
            prepared=tuple(self.preparation.done),
            ready=self.preparation.ready,
            step_waits=self.step_waits,
        )

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until the runner uses the compiled pieces a background load loads after it returns (at once
        for every other engine); False on timeout or if the preparation stopped before. The error that kept
        them out (an ArtifactError naming the piece, for one) is raised."""
        job = self.pieces
        if job is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while not job.finished.wait(0.05):
            if self.preparation.ready or (deadline is not None and time.monotonic() > deadline):
                return job.finished.is_set()
        if job.error is not None:
            raise job.error
        return True

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every graph (or warm-up) the background preparation owes is done; False on timeout."""
        return self.preparation.wait(timeout)

    def cuda_graph(self, kind: str, key) -> torch.cuda.CUDAGraph:
        """One captured graph, to replay by hand (benchmarks time replays): `kind` as in `stats().graphs`,
        `key` a bucket size, or (size, sampling mode) for decode, (size, piece name) for piecewise prefill."""
        with self.lock():
            sets = {s.graphs.kind: s.graphs for s in self.runner.graph_sets()}
            if kind not in sets or key not in sets[kind].graphs:
                keys = {k: list(g.graphs) for k, g in sets.items()}
                raise ConfigError(f"no captured {kind!r} graph {key!r}; this engine holds {keys}")
            return sets[kind].graphs[key][0]

    def recapture(self) -> None:
        """Capture every graph again (same sizes): for benchmarks that change kernel settings in between."""
        self.wait_ready()
        with self.lock():
            self.drain()
            self.runner.recapture()

    def close(self) -> None:
        """Abort every request and give the KV cache, graphs and weights back to the device now (the
        engine is unusable after). Lazy imports inside torch leave reference cycles through the frames
        that ran them, some of which hold this engine's weights or a view of its KV cache: a garbage collection
        frees those. On CUDA it always runs: a cycle may hold buffers these checks do not see, and one small
        buffer in the tail of an allocator segment keeps all of it reserved, the KV cache's included (the
        attention backend's own buffers `release` drops either way).
        A capture running in the background finishes first; those not started are skipped."""
        self.preparation.stop()
        with self.lock():
            self._close()

    def _close(self) -> None:
        self.drain()
        for seq in list(self.requests.values()):
            self.abort(seq)
        cuda = self.runner.device.type == "cuda"
        cache = self.runner.kv_cache
        held = [weakref.ref(t) for t in (next(self.runner.model.parameters()), cache.keys, cache.values)]
        self.runner.release()
        self.pieces = None  # a background load's pieces job: its loader and what it loaded hold the model
        if cuda or any(ref() is not None for ref in held):  # still held: by such cycles, or by the caller
            collect_all()  # frozen ones too (gc_pauses.py)
        if cuda:
            torch.cuda.empty_cache()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = False) -> Sequence:
        """Queue one request. `stream`: keep its TokenEvents on `seq.events` for its consumer to pop, whichever
        caller drives the steps that produce them (another's generate, a score that reads a step back)."""
        self.check_request(prompt_ids, params)
        rid = self.scheduler.next_request_id()
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()))  # torch.manual_seed decides
        seq = Sequence(rid, list(prompt_ids), params, seed, arrival=time.perf_counter())
        if stream:
            seq.events = deque()
        self.scheduler.add(seq)
        self.requests[rid] = seq
        return seq

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise the RequestError or CapacityError `add_request` would, changing nothing. It reads only what
        is fixed when the engine is built, so another thread may call it while this one steps (a server
        checks requests before they queue for the engine's thread)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params={params!r} is a {type(params).__name__}; give a graphkiln.SamplingParams")
        self._check_ids(prompt_ids)
        if params.stop_token_ids:
            self._check_ids(params.stop_token_ids, "SamplingParams.stop_token_ids")
        self.scheduler.check(len(prompt_ids), params)

    def _check_ids(self, ids: Seq[int], what: str = "prompt") -> None:
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise RequestError(f"{what}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def abort(self, seq: Sequence) -> None:
        if seq.finish_reason is None:
            self._finish(seq, "abort", time.perf_counter())

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        """Leave the engine; tokens not read back (an abort's or a failure's) leave with it."""
        while seq.tokens[-1] == PENDING:
            seq.tokens.pop()
        seq.finish_time = now
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or any(step.live() for step in self.in_flight)

    def step(self) -> list[TokenEvent]:
        """Launch the next step (if any is scheduled), then return the tokens of the one before it."""
        with self.lock() as waited_s:
            if waited_s:
                self.step_waits = self.step_waits.add(waited_s)
            return self._step()

    def _step(self) -> list[TokenEvent]:
        events = self._read_back(keep=1)  # none, unless an interrupt cut the last read short
        chunks = self.scheduler.schedule()
        failure = None
        if chunks:
            try:
                self.in_flight.append(self._launch(chunks, self.in_flight[-1] if self.in_flight else None))
            except RankFailedError:  # not one request's fault: no request can be served any more
                raise
            except Exception as error:
                failure = error
        events += self._read_back(keep=int(bool(chunks) and failure is None))
        if failure is not None:  # after the read-back: the tokens sampled before the failure are kept
            self._step_failed([c.seq for c in chunks], failure)
        return events

    def drain(self) -> list[TokenEvent]:
        """Read back the steps in flight, launching nothing."""
        with self.lock():
            return self._read_back(keep=0)

    def _read_back(self, keep: int) -> list[TokenEvent]:
        """Read the oldest steps in flight until `keep` are left (a step leaves only once fully read)."""
        events = []
        while len(self.in_flight) > keep:
            events += self._read(self.in_flight[0])
            self.in_flight.popleft()
        return events

    def _step_failed(self, seqs: list[Sequence], error: Exception) -> None:
        """A launch raised: with one request, that request is at fault; with several, each runs alone next."""
        if len(seqs) == 1:
            self._fail(seqs, error)
            return
        log.warning("a step of requests %s raised %r; running each alone once", [s.request_id for s in seqs], error)
        self.scheduler.isolate(seqs)

    def _fail(self, seqs: list[Sequence], error: Exception) -> None:
        """Finish the still running `seqs` with finish_reason "error", keeping the error for their caller."""
        failed = [seq for seq in seqs if seq.finish_reason is None]  # some may have stopped at read-back
        if not failed:
            return
        log.error("requests %s failed: %r", [s.request_id for s in failed], error)
        now = time.perf_counter()
        for seq in failed:
            seq.error = error
            self._finish(seq, "error", now)

    def _launch(self, chunks: list[ScheduledChunk], previous: LaunchedStep | None) -> LaunchedStep:
        """Start one step on the device. Nothing before the sampler returns changes a sequence, so a launch
        that raises leaves every sequence as it was."""
        sampling = [c for c in chunks if c.samples]
        rows = SamplingBatch.of(
            [c.seq.params for c in sampling], [c.seq.seed for c in sampling], [c.seq.num_output for c in sampling]
        )
        pending = _pending_ids(chunks, previous)
        out = self.runner.sample(chunks, _sample_rows(chunks), rows, pending)
        host, ready = self.read_back.start(out, rows.logprobs)
        launched = []
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        for c in sampling:
            c.seq.tokens.append(PENDING)
            launched.append((c.seq, c.seq.num_tokens - 1))
        return LaunchedStep(launched, out.ids, host, ready)

    def _read(self, step: LaunchedStep) -> list[TokenEvent]:
        try:
            results = step.results()
        except Exception as error:  # a device fault surfacing at the sync: none of the step's rows can be trusted
            self._fail([seq for seq, _ in step.rows], error)
            return []
        now = time.perf_counter()
        events = []
        for row, ((seq, index), token) in enumerate(zip(step.rows, results[0])):
            if seq.finish_reason is not None or seq.tokens[index] != PENDING:  # stopped or aborted; or read already
                continue
            seq.tokens[index] = token
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = token_logprobs(results, row, seq.params.logprobs)
                seq.logprobs.append(logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
            reason = self._finish_reason(seq, token, index)
            if reason:
                del seq.tokens[index + 1 :]  # the step launched after this one computed past the stop
                self._finish(seq, reason, now)
            event = TokenEvent(seq.request_id, token, logprobs, reason)
            events.append(event)
            if seq.events is not None:
                seq.events.append(event)
        return events

    def _finish_reason(self, seq: Sequence, token: int, index: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if index + 1 - len(seq.prompt_ids) >= p.max_tokens or index + 1 >= self.scheduler.max_context:
            return "length"
        return None

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of one prompt, computed chunk by chunk (a step in
        flight is read back first: its events reach streamed requests through `seq.events`)."""
        with self.lock():
            return self._score(token_ids)

    def _score(self, token_ids: list[int]) -> torch.Tensor:
        self.drain()
        seq = Sequence(-1, list(token_ids), SamplingParams(max_tokens=1), seed=0)
        self._check_ids(seq.prompt_ids)
        self.scheduler.add(seq)
        self.scheduler.waiting.remove(seq)
        budget = self.scheduler.max_num_batched_tokens
        pieces = []
        try:
            while seq.num_pending:
                take = min(seq.num_pending, budget)
                if not self.allocator.grow(seq.blocks, seq.num_computed + take):
                    raise CapacityError("score() needs free KV blocks; call it when no generation is running")
                pieces.append(self.runner.execute([ScheduledChunk(seq, take)]))
                seq.num_computed += take
        finally:
            self.allocator.free(seq.blocks)
        return torch.cat(pieces)


def _sample_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """Row index of the last token of every chunk that samples."""
    rows, end = [], 0
    for c in chunks:
        end += c.num_tokens
        if c.samples:
            rows.append(end - 1)
    return rows


def _pending_ids(chunks: list[ScheduledChunk], previous: LaunchedStep | None) -> PendingIds | None:
    """Where this step's PENDING input tokens are: rows of the previous step's device output."""
    if previous is None:
        return None
    source = {(id(seq), index): row for row, (seq, index) in enumerate(previous.rows)}
    targets, rows, offset = [], [], 0
    for c in chunks:
        last = c.seq.num_computed + c.num_tokens - 1
        if c.seq.tokens[last] == PENDING:  # only the newest token can be pending
            targets.append(offset + c.num_tokens - 1)
            rows.append(source[id(c.seq), last])
        offset += c.num_tokens
    return PendingIds(previous.ids, tuple(targets), tuple(rows)) if targets else None
