"""Decode CUDA graphs: per decode batch bucket, the whole step from input ids to sampled ids.

Each bucket has one graph per sampling mode (greedy, sample, filter; see sampler.py), attention,
LM head and sampler inside. The batch (static_batch.StaticBatch) and per-row sampling parameters
live in buffers sized once for the largest bucket; every graph reads views of them. Graphs are
captured largest first into one shared memory pool. A replay copies the batch into the buffers
(padded rows are one-token greedy sequences in the dummy block), re-plans the backend on the
same buffers, and replays the mode's graph.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from graphkiln.compiler.counters import Counters
from graphkiln.compiler.plan import smallest_bucket
from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.models.transformer import CausalLM

from .attention.base import AttentionBackend
from .attention.metadata import BatchMetadata, SequenceSlice, pad_decode
from .sampler import MODES, NEUTRAL_ROW, SamplingBatch, SamplingTensors, sample
from .static_batch import StaticBatch


def reserved_after_sync() -> int:
    """Bytes the caching allocator holds once idle cache is released: graph pools stay, the rest goes."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


@dataclass(frozen=True)
class CaptureStats:
    graphs: int
    seconds: float
    pool_bytes: int


class DecodeGraphs:
    def __init__(
        self,
        forward,
        model: CausalLM,
        backend: AttentionBackend,
        sizes: tuple[int, ...],
        block_size: int,
        max_blocks_per_seq: int,
        counters: Counters,
        pool,
    ) -> None:
        self.forward = forward
        self.model = model
        self.backend = backend
        self.sizes = tuple(sorted(sizes))
        self.counters = counters
        self.pool = pool
        device = next(model.parameters()).device
        largest = self.sizes[-1]
        self.batch = StaticBatch(largest, largest, max_blocks_per_seq, block_size, device)
        self.sampling = SamplingTensors.empty(largest, device)
        self.sampling_staging = SamplingTensors(*(self.batch.pinned_like(t) for t in self.sampling))
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.replays: Counter[tuple[int, str]] = Counter()  # (bucket, sampling mode)
        self.stats: CaptureStats | None = None

    def metadata(self, size: int) -> BatchMetadata:
        """Views of the static buffers for a capture of `size` one-token rows (replays plan from `fill`)."""
        return self.batch.metadata("decode", size, size, (1,) * size, (1,) * size)

    def _step(self, size: int, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        with forward_context(ForwardContext(self.backend.plan(self.metadata(size)))):
            hidden = self.forward(self.batch.input_ids[:size], self.batch.positions[:size])
            return sample(self.model.compute_logits(hidden), self.sampling.rows(size), mode)

    def capture(self) -> CaptureStats:
        """Warm up and capture every bucket and sampling mode, largest bucket first, into one pool."""
        start = time.perf_counter()
        reserved_before = reserved_after_sync()
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                for mode in MODES:
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        self._step(size, mode)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        ids, logprobs = self._step(size, mode)
                    self.graphs[size, mode] = (graph, ids, logprobs)
                    self.counters.cudagraphs_captured += 1
        torch.cuda.synchronize()
        self.stats = CaptureStats(len(self.graphs), time.perf_counter() - start, reserved_after_sync() - reserved_before)
        return self.stats

    def bucket(self, num_seqs: int) -> int | None:
        return smallest_bucket(self.sizes, num_seqs)

    def replay(
        self,
        ids: list[int],
        positions: list[int],
        slices: list[SequenceSlice],
        sampling: SamplingBatch,
        pending=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled ids [len(slices)] (and logprobs unless greedy) of one decode step that fits a bucket.

        Padded rows are one-token greedy sequences in the dummy block. A greedy step copies no
        sampling parameters. `pending` (runner.PendingIds) then overwrites input ids still on the device.
        """
        n = len(slices)
        size = self.bucket(n)
        pad = size - n
        mode = sampling.mode
        with self.batch.staging_turn():
            meta = self.batch.fill("decode", ids + [0] * pad, positions + [0] * pad, pad_decode(slices, size), size, size)
            if mode != "greedy":
                for column, host_column, target, fill in zip(
                    sampling.columns(), self.sampling_staging, self.sampling, NEUTRAL_ROW
                ):
                    host_column.numpy()[:size] = list(column) + [fill] * pad
                    target[:size].copy_(host_column[:size], non_blocking=True)
        if pending is not None:
            pending.fill(self.batch.input_ids)
        self.backend.plan(meta)
        graph, sampled, logprobs = self.graphs[size, mode]
        graph.replay()
        self.replays[size, mode] += 1
        return sampled[:n], None if logprobs is None else logprobs[:n]
