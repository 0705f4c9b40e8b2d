"""Whole prefill CUDA graphs: one graph per token bucket, attention inside.

For attention backends that can capture their prefill (`capturable_prefill`; the others run
prefill piecewise, piecewise_graph.py). A prefill or mixed step (prefill chunks and decode rows
together) that fits a token bucket copies its batch into static buffers (StaticBatch), re-plans
attention on them and replays the bucket's graph: token ids to final hidden states in one
launch. The LM head and sampler run after it, on the rows that sample. Padded token rows belong
to no sequence. Graphs are captured largest first into the shared pool.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from graphkiln.compiler.counters import Counters
from graphkiln.compiler.plan import smallest_bucket
from graphkiln.models.attention import ForwardContext, forward_context

from .attention.base import AttentionBackend
from .attention.metadata import SequenceSlice
from .cuda_graph import CaptureStats, reserved_after_sync
from .kv_cache import DUMMY_BLOCK
from .static_batch import StaticBatch


def dummy_slices(num_tokens: int, block_size: int, max_blocks: int) -> list[SequenceSlice]:
    """Sequences in the dummy block, none longer than a block table row, `num_tokens` tokens in all."""
    longest = max_blocks * block_size
    slices = []
    for start in range(0, num_tokens, longest):
        n = min(longest, num_tokens - start)
        slices.append(SequenceSlice(n, n, (DUMMY_BLOCK,) * -(-n // block_size)))
    return slices


class PrefillGraphs:
    def __init__(
        self,
        forward,
        backend: AttentionBackend,
        sizes: tuple[int, ...],
        block_size: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        counters: Counters,
        pool,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.backend = backend
        self.sizes = tuple(sorted(sizes))
        self.counters = counters
        self.pool = pool
        self.batch = StaticBatch(self.sizes[-1], min(max_seqs, self.sizes[-1]), max_blocks_per_seq, block_size, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays: Counter[int] = Counter()
        self.stats: CaptureStats | None = None

    def bucket(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.sizes, num_tokens)

    def _load(self, ids: list[int], positions: list[int], slices: list[SequenceSlice], size: int, pending=None):
        """Copy a batch into the buffers and plan attention on them (outside any capture)."""
        with self.batch.staging_turn():
            meta = self.batch.fill("prefill", ids, positions, slices, size, min(self.batch.max_seqs, size))
        if pending is not None:
            pending.fill(self.batch.input_ids)
        return self.backend.plan(meta)

    def capture(self) -> CaptureStats:
        """Plan, warm up and capture every bucket, largest first, on one side stream into the shared pool."""
        start = time.perf_counter()
        reserved_before = reserved_after_sync()
        stream = torch.cuda.Stream()
        batch = self.batch
        with torch.inference_mode():
            for size in reversed(self.sizes):
                slices = dummy_slices(size, batch.block_size, batch.block_tables.shape[1])
                attention = ForwardContext(self._load([0] * size, [0] * size, slices, size))
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream), forward_context(attention):
                    self.forward(batch.input_ids[:size], batch.positions[:size])
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream), forward_context(attention):
                    hidden = self.forward(batch.input_ids[:size], batch.positions[:size])
                self.graphs[size] = (graph, hidden)
                self.counters.cudagraphs_captured += 1
        torch.cuda.synchronize()
        self.stats = CaptureStats(len(self.graphs), time.perf_counter() - start, reserved_after_sync() - reserved_before)
        return self.stats

    def replay(self, ids: list[int], positions: list[int], slices: list[SequenceSlice], pending=None) -> torch.Tensor:
        """Hidden states [len(ids), hidden] of one prefill (or mixed) step that fits a bucket; `pending`
        (runner.PendingIds) fills input tokens still on the device."""
        n = len(ids)
        size = self.bucket(n)
        self._load(ids, positions, slices, size, pending)
        graph, hidden = self.graphs[size]
        graph.replay()
        self.replays[size] += 1
        return hidden[:n]
