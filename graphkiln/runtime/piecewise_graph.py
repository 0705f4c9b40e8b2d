"""Piecewise prefill CUDA graphs: one graph per (token bucket, piece), attention run eagerly between them.

For attention backends whose prefill cannot be captured (FlashInfer plans each batch on the
host); the others replay one whole graph per bucket (prefill_graph.py).

A capture pass runs the stitching graph once per bucket (largest first) on static input
buffers; each piece call is captured into its own graph in one shared pool and keeps its
output tensors. A replay pass runs the same stitching graph: each piece replays its graph and
returns those same tensors, so every later piece and attention call sees the addresses it was
captured with. Attention between pieces plans and runs eagerly with the real batch metadata.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.compiler.counters import Counters
from graphkiln.compiler.plan import smallest_bucket
from graphkiln.models.attention import ForwardContext, forward_context

from .attention.base import AttentionBackend
from .attention.metadata import BatchMetadata, SequenceSlice, build_metadata
from .cuda_graph import CaptureStats, reserved_after_sync
from .kv_cache import DUMMY_BLOCK


class GraphedPiece:
    """Calls through to a compiled piece, or captures / replays it for the bucket the owner set."""

    def __init__(self, piece, owner: PiecewiseGraphs) -> None:
        self.piece = piece
        self.owner = owner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}

    def __call__(self, *args):
        mode, size = self.owner.mode
        if mode == "replay":
            graph, outputs = self.graphs[size]
            graph.replay()
            return outputs
        if mode == "capture":
            self.piece(*args)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.owner.pool)
            try:
                outputs = self.piece(*args)
            finally:
                graph.capture_end()
            self.graphs[size] = (graph, outputs)
            self.owner.counters.cudagraphs_captured += 1
            return outputs
        return self.piece(*args)


class PiecewiseGraphs:
    def __init__(
        self,
        compiled: CompiledModel,
        backend: AttentionBackend,
        sizes: tuple[int, ...],
        block_size: int,
        counters: Counters,
        pool,
    ) -> None:
        self.compiled = compiled
        self.backend = backend
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self.counters = counters
        self.mode: tuple[str | None, int] = (None, 0)
        self.pool = pool
        device = next(iter(compiled.tensors.values())).device
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self.replays: Counter[int] = Counter()
        compiled.wrap_pieces(lambda name, piece: GraphedPiece(piece, self))
        self.stats: CaptureStats | None = None

    def bucket(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.sizes, num_tokens)

    def _run(self, mode: str, size: int, meta: BatchMetadata) -> torch.Tensor:
        self.mode = (mode, size)
        try:
            with forward_context(ForwardContext(self.backend.plan(meta))):
                return self.compiled(self.input_ids[:size], self.positions[:size])
        finally:
            self.mode = (None, 0)

    def capture(self) -> CaptureStats:
        """Capture every piece for every bucket, largest first, on one side stream and pool."""
        start = time.perf_counter()
        reserved_before = reserved_after_sync()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        device = self.input_ids.device
        with torch.inference_mode(), torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                blocks = (DUMMY_BLOCK,) * -(-size // self.block_size)
                meta = build_metadata([SequenceSlice(size, size, blocks)], self.block_size, size, device)
                self._run("capture", size, meta)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graphs = len(self.sizes) * len(self.compiled.pieces)
        self.stats = CaptureStats(graphs, time.perf_counter() - start, reserved_after_sync() - reserved_before)
        return self.stats

    def replay(self, ids: list[int], positions: list[int], slices: list[SequenceSlice], pending=None) -> torch.Tensor:
        """Hidden states [len(ids), hidden] of one prefill (or mixed) step that fits a bucket; `pending`
        (runner.PendingIds) fills input tokens still on the device."""
        n = len(ids)
        size = self.bucket(n)
        pad = [0] * (size - n)
        self.input_ids[:size].copy_(torch.tensor(ids + pad), non_blocking=True)
        if pending is not None:
            pending.fill(self.input_ids)
        self.positions[:size].copy_(torch.tensor(positions + pad), non_blocking=True)
        meta = build_metadata(slices, self.block_size, size, self.input_ids.device)
        self.replays[size] += 1
        return self._run("replay", size, meta)[:n]
