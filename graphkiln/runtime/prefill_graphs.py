"""Prefill CUDA graphs per token bucket: whole, or piecewise around attention.

A prefill or mixed step (prefill chunks and decode rows together) that fits a token bucket
copies its padded batch into static buffers (StaticBatch), plans attention on them and replays.

- `PrefillGraphs`, for backends that can capture their prefill (`capturable_prefill`): one graph
  per bucket, token ids to final hidden states, attention inside.
- `PiecewisePrefillGraphs`, for the others (FlashInfer plans each batch on the host): one graph
  per (bucket, piece); attention runs eagerly between them with the real batch. Its forward is
  the compiled model with each piece wrapped once, when the engine is built: while a capture or
  a replay of a bucket runs, a wrapped piece captures or replays its graph for that bucket and
  returns the same output tensors, so every later piece and attention call sees the addresses
  it was captured with.

The LM head and sampler run after the graph, on the rows that sample.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.models.attention import ForwardContext, forward_context

from .attention.metadata import SequenceSlice
from .batch import Batch, InputIds
from .graphs import CaptureJob, CaptureSetup, GraphSet
from .kv_cache import DUMMY_BLOCK
from .static_batch import StaticBatch

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def dummy_slices(num_tokens: int, block_size: int, max_blocks: int) -> list[SequenceSlice]:
    """Sequences in the dummy block, none longer than a block table row, `num_tokens` tokens in all."""
    longest = max_blocks * block_size
    slices = []
    for start in range(0, num_tokens, longest):
        n = min(longest, num_tokens - start)
        slices.append(SequenceSlice(n, n, (DUMMY_BLOCK,) * -(-n // block_size)))
    return slices


class _StaticPrefill(ABC):
    """The buffers and batch loading both prefill strategies share."""

    def __init__(self, setup: CaptureSetup, graphs: GraphSet, max_seqs: int) -> None:
        self.graphs = graphs
        self.backend = setup.backend
        largest = graphs.sizes[-1]
        self.batch = StaticBatch(largest, min(max_seqs, largest), setup.max_blocks_per_seq, setup.block_size, setup.device)

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest captured bucket holding `num_tokens`."""
        return self.graphs.ready_bucket(num_tokens)

    def jobs(self) -> list[CaptureJob]:
        """One capture per token bucket, smallest first."""
        return [CaptureJob(self.graphs, str(size), partial(self._capture_timed, size), size, self._warm(size))
                for size in self.graphs.sizes]  # fmt: skip

    def _warm(self, size: int) -> Callable[[], None] | None:
        """The bucket's warm-up, to run apart from its capture; None where the capture warms up as it goes."""
        return None

    def _capture_timed(self, size: int) -> None:
        with self.graphs.capturing(size):
            self._capture_bucket(size)

    @abstractmethod
    def _capture_bucket(self, size: int) -> None:
        """Plan a dummy batch of `size` tokens, warm up and capture the bucket's graph(s)."""

    @abstractmethod
    def _seq_rows(self, batch: Batch, size: int) -> int:
        """Sequence rows the attention metadata spans for `batch` in bucket `size`."""

    def _load(self, batch: Batch, size: int, pending: InputIds | None = None) -> ForwardContext:
        """Copy a batch padded to `size` into the buffers and plan attention on them (outside any capture)."""
        with self.batch.staging_turn():
            meta = self.batch.fill("prefill", batch.padded(size), self._seq_rows(batch, size))
        if pending is not None:
            pending.fill(self.batch.input_ids)
        return ForwardContext(self.backend.plan(meta))

    def _dummy(self, size: int) -> Batch:
        slices = dummy_slices(size, self.batch.block_size, self.batch.block_tables.shape[1])
        return Batch([0] * size, [0] * size, slices, decode=False)

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch.input_ids[:size], self.batch.positions[:size]


class PrefillGraphs(_StaticPrefill):
    def __init__(self, setup: CaptureSetup, sizes: tuple[int, ...], forward: Forward, max_seqs: int) -> None:
        super().__init__(setup, GraphSet("prefill", sizes, setup.pool), max_seqs)
        self.forward = forward

    def _seq_rows(self, batch: Batch, size: int) -> int:
        """As many as the bucket can hold: a captured grid is fixed by them, whatever batch a replay brings."""
        return min(self.batch.max_seqs, size)

    def _capture_bucket(self, size: int) -> None:
        self.graphs.capture(size, self._planned_step(size))

    def _warm(self, size: int) -> Callable[[], None]:
        return lambda: self.graphs.warm(self._planned_step(size), size)

    def dry_steps(self) -> list[Callable[[], torch.Tensor]]:
        """Each bucket's step on its dummy batch, to run once outside any capture (kernel_builds.py)."""
        return [partial(self._dry_step, size) for size in self.graphs.sizes]

    def _dry_step(self, size: int) -> torch.Tensor:
        return self._planned_step(size)()

    def _planned_step(self, size: int) -> Callable[[], torch.Tensor]:
        """The bucket's forward, attention planned for its dummy batch."""
        attention = self._load(self._dummy(size), size)

        def step() -> torch.Tensor:
            with forward_context(attention):
                return self.forward(*self._inputs(size))

        return step

    def run(self, batch: Batch, pending: InputIds | None, size: int) -> torch.Tensor:
        """Hidden states [batch tokens, hidden] of a prefill (or mixed) step in bucket `size` (`bucket`)."""
        self._load(batch, size, pending)
        return self.graphs.replay(size)[: batch.num_tokens]


@dataclass
class _Action:
    """What the wrapped pieces do during the current call: "capture" or "replay" the bucket `size`, or
    call straight through (None)."""

    kind: str | None = None
    size: int = 0


class _GraphedPiece:
    """A compiled piece that captures or replays its graph for the bucket the shared action names."""

    def __init__(self, name: str, piece: Callable, graphs: GraphSet, action: _Action) -> None:
        self.name, self.piece, self.graphs, self.action = name, piece, graphs, action

    def __call__(self, *args):
        key = (self.action.size, self.name)
        if self.action.kind == "replay":
            return self.graphs.replay(key)
        if self.action.kind == "capture":
            return self.graphs.capture(key, lambda: self.piece(*args))
        return self.piece(*args)


class PiecewisePrefillGraphs(_StaticPrefill):
    def __init__(self, setup: CaptureSetup, sizes: tuple[int, ...], compiled: CompiledModel, max_seqs: int) -> None:
        super().__init__(setup, GraphSet("prefill-piecewise", sizes, setup.pool), max_seqs)
        self.action = _Action()
        graphs, action = self.graphs, self.action
        self.forward = compiled.with_pieces(lambda name, piece: _GraphedPiece(name, piece, graphs, action))

    def _seq_rows(self, batch: Batch, size: int) -> int:
        """The batch's own: attention runs eagerly and plans each batch as it is."""
        return len(batch.slices)

    def _run(self, kind: str, size: int, attention: ForwardContext) -> torch.Tensor:
        self.action.kind, self.action.size = kind, size
        try:
            with forward_context(attention):
                return self.forward(*self._inputs(size))
        finally:
            self.action.kind = None

    def _capture_bucket(self, size: int) -> None:
        """Every piece of the bucket; attention runs between pieces on the side stream."""
        with torch.cuda.stream(self.graphs.pool.stream):
            self._run("capture", size, self._load(self._dummy(size), size))

    def run(self, batch: Batch, pending: InputIds | None, size: int) -> torch.Tensor:
        """Hidden states [batch tokens, hidden] of a prefill (or mixed) step in bucket `size` (`bucket`)."""
        return self._run("replay", size, self._load(batch, size, pending))[: batch.num_tokens]
