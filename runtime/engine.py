"""The engine: requests in, one scheduled step at a time, sampled tokens out.

It owns the scheduler and drives a runner (eager reference, or compiled), which samples on the
device. The only host synchronisation per step is reading the sampled token ids.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from graphkiln.errors import CapacityError, RequestError

from .kv_cache import BlockAllocator
from .sampler import SamplingBatch
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, Sequence


@dataclass(frozen=True)
class TokenEvent:
    """One new token of one request, as a step produced it."""

    request_id: int
    token_id: int
    logprob: float | None
    finish_reason: str | None


class Engine:
    def __init__(self, runner, scheduler: Scheduler, eos_token_ids: Seq[int], vocab_size: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.requests: dict[int, Sequence] = {}

    @property
    def allocator(self) -> BlockAllocator:
        return self.scheduler.allocator

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self._check_ids(prompt_ids)
        rid = self.scheduler.next_request_id()
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()))  # torch.manual_seed decides
        seq = Sequence(rid, list(prompt_ids), params, seed, arrival=time.perf_counter())
        self.scheduler.add(seq)
        self.requests[rid] = seq
        return seq

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        self.requests.pop(seq.request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenEvent]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        sampling = [c for c in chunks if c.samples]
        rows = SamplingBatch.of(
            [c.seq.params for c in sampling], [c.seq.seed for c in sampling], [c.seq.num_output for c in sampling]
        )
        token_ids, logprobs = self.runner.sample(chunks, _sample_rows(chunks), rows)
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        if not sampling:
            return []
        tokens = token_ids.tolist()
        chosen_logprobs = logprobs.tolist() if logprobs is not None else [None] * len(tokens)
        now = time.perf_counter()
        events = []
        for c, token, logprob in zip(sampling, tokens, chosen_logprobs):
            seq = c.seq
            seq.tokens.append(token)
            if seq.params.logprobs:
                seq.logprobs.append(logprob)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, token)
            if reason:
                seq.finish_time = now
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id)
            events.append(TokenEvent(seq.request_id, token, logprob, reason))
        return events

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if seq.num_output >= p.max_tokens or seq.num_tokens >= self.scheduler.max_context:
            return "length"
        return None

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of one prompt, computed chunk by chunk."""
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
