"""The model runner: packs a step's chunks, pads them to the plan's bucket, plans attention, runs forward.

The same runner serves the eager reference (forward = the model itself, no padding) and the
compiled model (forward = the CompiledModel, padded to decode batch or prefill token buckets).
With decode CUDA graphs, a decode step that fits a bucket is one graph replay instead, from input
ids to sampled ids; with prefill graphs (prefill_graph.py whole, or piecewise_graph.py), a
prefill or mixed step that fits a token bucket is replayed up to its hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphkiln.compiler.counters import Counters
from graphkiln.compiler.plan import GraphPlan
from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.models.transformer import CausalLM

from .attention.base import AttentionBackend
from .attention.metadata import SequenceSlice, build_metadata, pad_decode
from .cuda_graph import DecodeGraphs
from .piecewise_graph import PiecewiseGraphs
from .prefill_graph import PrefillGraphs
from .kv_cache import KVCache
from .sampler import SamplingBatch, sample
from .scheduler import ScheduledChunk
from .transfer import upload

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_decode(chunks: list[ScheduledChunk]) -> bool:
    """A pure decode step: one new token per sequence, each continuing a cached context."""
    return all(c.num_tokens == 1 and c.seq.num_computed > 0 for c in chunks)


def padded_size(num_tokens: int, plan: GraphPlan | None) -> int:
    """Pad to the plan's smallest bucket that holds the batch; beyond the largest, run unpadded."""
    bucket = plan.bucket(num_tokens) if plan else None
    return bucket or num_tokens


@dataclass(frozen=True)
class PendingIds:
    """Input tokens still on the device: batch rows `targets` take the previous step's `source[rows]`."""

    source: torch.Tensor
    targets: tuple[int, ...]
    rows: tuple[int, ...]

    def fill(self, input_ids: torch.Tensor) -> None:
        """Write them into a device buffer of input ids (queued on the stream, no host sync)."""
        n = len(self.targets)
        if self.targets == self.rows == tuple(range(n)):  # steady decode: the same sequences, in order
            input_ids[:n].copy_(self.source[:n])
            return
        device = input_ids.device
        input_ids[upload(self.targets, torch.int64, device)] = self.source[upload(self.rows, torch.int64, device)]


@dataclass(frozen=True)
class Batch:
    ids: list[int]
    positions: list[int]
    slices: list[SequenceSlice]
    decode: bool


def pack(chunks: list[ScheduledChunk]) -> Batch:
    ids: list[int] = []
    positions: list[int] = []
    slices = []
    for c in chunks:
        start = c.seq.num_computed
        ids += c.seq.tokens[start : start + c.num_tokens]
        positions += range(start, start + c.num_tokens)
        slices.append(SequenceSlice(c.num_tokens, start + c.num_tokens, tuple(c.seq.blocks)))
    return Batch(ids, positions, slices, is_decode(chunks))


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        backend: AttentionBackend,
        forward: Forward | None = None,
        plans: dict[str, GraphPlan] | None = None,
        graphs: DecodeGraphs | None = None,
        prefill_graphs: PrefillGraphs | PiecewiseGraphs | None = None,
        counters: Counters | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.forward = forward or model
        self.plans = plans or {}
        self.graphs = graphs
        self.prefill_graphs = prefill_graphs
        self.counters = counters or Counters()
        self.device = kv_cache.keys.device

    def execute(self, chunks: list[ScheduledChunk], rows: list[int] | None = None) -> torch.Tensor:
        """float32 logits of the given token rows (default: every token) of one step, without graphs
        for decode (the decode graphs end in the sampler)."""
        with torch.inference_mode():
            return self._logits(pack(chunks), rows)

    def sample(
        self, chunks: list[ScheduledChunk], rows: list[int], sampling: SamplingBatch, pending: PendingIds | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch one step and sample the given rows on the device: token ids [len(rows)] and logprobs
        (None in greedy mode), not synchronized. A decode step that fits a bucket is one graph
        replay, sampler included. `pending` input tokens are taken from the previous step's output."""
        batch = pack(chunks)
        with torch.inference_mode():
            if batch.decode and self.graphs is not None and self.graphs.bucket(len(batch.ids)) is not None:
                return self.graphs.replay(batch.ids, batch.positions, batch.slices, sampling, pending)
            logits = self._logits(batch, rows, pending)
            return sample(logits, sampling.tensors(self.device), sampling.mode)

    def _logits(self, batch: Batch, rows: list[int] | None, pending: PendingIds | None = None) -> torch.Tensor:
        if not batch.decode and self.prefill_graphs and self.prefill_graphs.bucket(len(batch.ids)):
            hidden = self.prefill_graphs.replay(batch.ids, batch.positions, batch.slices, pending)
        else:
            hidden = self._forward(batch, pending)
        if rows is not None:
            hidden = hidden.index_select(0, upload(rows, torch.int64, hidden.device))
        return self.model.compute_logits(hidden).float()

    def _forward(self, batch: Batch, pending: PendingIds | None = None) -> torch.Tensor:
        num_tokens = len(batch.ids)
        size = padded_size(num_tokens, self.plans.get("decode" if batch.decode else "prefill"))
        pad = [0] * (size - num_tokens)
        slices = pad_decode(batch.slices, size) if batch.decode else batch.slices
        meta = build_metadata(slices, self.kv_cache.block_size, size, self.device)
        input_ids = upload(batch.ids + pad, torch.int64, self.device)
        if pending is not None:
            pending.fill(input_ids)
        positions = upload(batch.positions + pad, torch.int64, self.device)
        with forward_context(ForwardContext(self.backend.plan(meta))):
            return self.forward(input_ids, positions)[:num_tokens]
