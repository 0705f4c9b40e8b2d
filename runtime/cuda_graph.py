"""Decode CUDA graphs: per decode batch bucket, the whole step from input ids to sampled ids.

Each bucket has one graph per sampling mode (greedy, sample, filter; see sampler.py), attention,
LM head and sampler inside. Static buffers (token ids, positions, slot mapping, sequence lengths,
block tables, per-row sampling parameters) are sized once for the largest bucket; every graph
reads views of them. Graphs are captured largest first into one shared memory pool. A replay
copies the batch into the buffers (padded rows are one-token greedy sequences in the dummy
block), re-plans the backend on the same buffers, and replays the mode's graph.
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
from .attention.metadata import BatchMetadata, SequenceSlice
from .kv_cache import DUMMY_BLOCK
from .sampler import MODES, NEUTRAL_ROW, SamplingBatch, SamplingTensors, sample


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
        self.block_size = block_size
        self.counters = counters
        self.pool = pool
        device = next(model.parameters()).device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), DUMMY_BLOCK * block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((largest, max_blocks_per_seq), DUMMY_BLOCK, dtype=torch.int32, device=device)
        self.sampling = SamplingTensors.empty(largest, device)
        self.staging = {
            name: torch.zeros_like(getattr(self, name), device="cpu").pin_memory()
            for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
        }
        self.sampling_staging = SamplingTensors(*(torch.zeros_like(t, device="cpu").pin_memory() for t in self.sampling))
        self.staged: torch.cuda.Event | None = None  # the last replay's copies from the staging buffers
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.replays: Counter[tuple[int, str]] = Counter()  # (bucket, sampling mode)
        self.stats: CaptureStats | None = None

    def metadata(self, size: int, seq_lens: tuple[int, ...] | None = None) -> BatchMetadata:
        """Views of the static buffers for a batch of `size` rows."""
        return BatchMetadata(
            query_lens=(1,) * size,
            seq_lens=seq_lens or (1,) * size,
            num_tokens=size,
            block_size=self.block_size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens_t=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
        )

    def _step(self, size: int, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        with forward_context(ForwardContext(self.backend.plan(self.metadata(size)))):
            hidden = self.forward(self.input_ids[:size], self.positions[:size])
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
        slots: list[int],
        sampling: SamplingBatch,
        pending=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled ids [len(slices)] (and logprobs unless greedy) of one decode step that fits a bucket.

        The batch goes through pinned staging buffers with one asynchronous copy per field; the
        block-table copy covers only the columns this batch uses (kernels never read past a
        sequence's length), and a greedy step copies no sampling parameters. `pending`
        (runner.PendingIds) then overwrites input ids still on the device. The engine launches a
        step before the previous one ran, so the previous replay's copies from the staging
        buffers are waited for (an event recorded after them) before the buffers are rewritten.
        """
        n = len(slices)
        size = self.bucket(n)
        pad = size - n
        if self.staged is not None:
            self.staged.synchronize()
        host = {name: t.numpy() for name, t in self.staging.items()}
        host["input_ids"][:size] = ids + [0] * pad
        host["positions"][:size] = positions + [0] * pad
        host["slot_mapping"][:size] = slots + [DUMMY_BLOCK * self.block_size] * pad
        seq_lens = [s.seq_len for s in slices] + [1] * pad
        host["seq_lens"][:size] = seq_lens
        width = max(len(s.blocks) for s in slices)
        tables = host["block_tables"]
        tables[:size, :width] = DUMMY_BLOCK
        for row, s in enumerate(slices):
            tables[row, : len(s.blocks)] = s.blocks
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            getattr(self, name)[:size].copy_(self.staging[name][:size], non_blocking=True)
        self.block_tables[:size, :width].copy_(self.staging["block_tables"][:size, :width], non_blocking=True)
        if pending is not None:
            pending.fill(self.input_ids)
        mode = sampling.mode
        if mode != "greedy":
            for column, host_column, target, fill in zip(
                sampling.columns(), self.sampling_staging, self.sampling, NEUTRAL_ROW
            ):
                host_column.numpy()[:size] = list(column) + [fill] * pad
                target[:size].copy_(host_column[:size], non_blocking=True)
        self.staged = torch.cuda.Event()
        self.staged.record()
        self.backend.plan(self.metadata(size, tuple(seq_lens)))
        graph, sampled, logprobs = self.graphs[size, mode]
        graph.replay()
        self.replays[size, mode] += 1
        return sampled[:n], None if logprobs is None else logprobs[:n]
