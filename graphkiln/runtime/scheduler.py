"""Continuous batching: which tokens of which sequences run in the next step.

Every step has a token budget. Running sequences that wait for one decode token come first;
the rest of the budget goes to prompt chunks (a prompt longer than the budget is prefilled over
several steps, continuing its cached prefix). KV blocks are taken as tokens are scheduled; when
none are left, the youngest running sequence is preempted: its blocks are freed and it is
recomputed from its tokens later. After a step of several sequences failed, each of them runs
alone for one step before anything else, so the engine can tell which one is at fault.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphkiln.errors import CapacityError, ConfigError, RequestError

from .kv_cache import BlockAllocator
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .readback import TokenEvent, TokenLogprobs

PENDING = -1  # a sampled token still on the device: its step was launched, not yet read back


@dataclass(eq=False)
class Sequence:
    """One request's tokens (prompt, then output) and its state in the KV cache (compared by identity)."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    tokens: list[int] = field(init=False, default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one a token, when its params ask
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None  # what failed its step, when finish_reason is "error"
    events: deque[TokenEvent] | None = None  # kept for a consumer that reads them one by one (a stream)
    arrival: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        """Generated tokens read back so far (a pending one is left out)."""
        end = len(self.tokens) - (self.tokens[-1] == PENDING)
        return self.tokens[len(self.prompt_ids) : end]

    @property
    def num_output(self) -> int:
        """Generated tokens, the pending one included: the output index of the next draw."""
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so the next token is sampled from it."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_context: int, max_num_batched_tokens: int, max_num_seqs: int):
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}; it must be a positive integer")
        self.allocator = allocator
        self.max_context = max_context
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.isolated: deque[Sequence] = deque()  # to run alone, one step each
        self._ids = itertools.count()

    def next_request_id(self) -> int:
        return next(self._ids)

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise what `add` would for a request of this size; reads only what is fixed at construction."""
        n = num_prompt_tokens
        if n == 0:
            raise RequestError("empty prompt: give at least one token")
        if n > self.max_context:
            raise RequestError(
                f"prompt of {n} tokens is longer than the model's context of {self.max_context} tokens; shorten it"
            )
        needed = self.allocator.blocks_for(min(n + params.max_tokens - 1, self.max_context))
        if needed > self.allocator.capacity:
            raise CapacityError(
                f"a prompt of {n} tokens with max_tokens={params.max_tokens} needs {needed} KV blocks but the "
                f"cache holds {self.allocator.capacity}; lower max_tokens or give the KV cache more memory"
            )

    def add(self, seq: Sequence) -> None:
        self.check(len(seq.prompt_ids), seq.params)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def isolate(self, seqs: list[Sequence]) -> None:
        """Run each of `seqs` (the sequences of a failed step) alone for one step, before anything else."""
        self.isolated.extend(s for s in seqs if s.finish_reason is None and s not in self.isolated)

    def schedule(self) -> list[ScheduledChunk]:
        while self.isolated:
            seq = self.isolated.popleft()
            if not self._closing(seq):
                return self._alone(seq)
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in sorted(self.running, key=lambda s: s.request_id):
            if self._closing(seq) or seq not in self.running or budget == 0:
                continue
            take = min(seq.num_pending, budget)
            if not self._reserve(seq, take, chunks):
                continue
            chunks.append(ScheduledChunk(seq, take))
            budget -= take
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            take = min(seq.num_pending, budget)
            if not self.allocator.grow(seq.blocks, seq.num_computed + take):
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.scheduled_time is None:
                seq.scheduled_time = time.perf_counter()
            chunks.append(ScheduledChunk(seq, take))
            budget -= take
        return chunks

    def _alone(self, seq: Sequence) -> list[ScheduledChunk]:
        if seq in self.waiting:  # preempted while another ran alone
            self.waiting.remove(seq)
            self.running.append(seq)
        take = min(seq.num_pending, self.max_num_batched_tokens)
        return [ScheduledChunk(seq, take)] if self._reserve(seq, take, []) else []

    def _closing(self, seq: Sequence) -> bool:
        """Its pending token is its last (max_tokens or the context reached): nothing more to schedule."""
        last_pending = seq.tokens[-1] == PENDING
        return last_pending and (seq.num_output >= seq.params.max_tokens or seq.num_tokens >= self.max_context)

    def _reserve(self, seq: Sequence, take: int, scheduled: list[ScheduledChunk]) -> bool:
        """Grow `seq`'s blocks, preempting the youngest other running sequences if needed."""
        while not self.allocator.grow(seq.blocks, seq.num_computed + take):
            busy = {c.seq.request_id for c in scheduled}
            victims = [s for s in self.running if s is not seq and not self._closing(s) and s.request_id not in busy]
            victim = max(victims or [seq], key=lambda s: s.request_id)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.free(seq.blocks)
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Leave the scheduler for good (a sequence preempted while its last step ran may be waiting)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.isolated:
            self.isolated.remove(seq)
        self.allocator.free(seq.blocks)
        seq.finish_reason = reason
