"""The model runner: packs a step's chunks, replays a captured graph when one fits, else plans and runs forward.

The same runner serves the eager reference (forward = the model itself, no padding) and the
compiled model (forward = the CompiledModel, padded to the engine's capture sizes even without
graphs, so the CPU runs the same padded batches a GPU replays). With decode graphs, a decode step
that fits a bucket is one replay from input ids to sampled ids; with prefill graphs (whole or
piecewise), a prefill or mixed step that fits a token bucket is replayed up to its hidden states,
unless the backend runs steps of its attention work outside graphs (`eager_prefill_work`).
On rank 0 of a tensor-parallel group (`peers`), every forward's batch goes to the other ranks
first (runtime/tensor_parallel.py), with the bucket of the graph it replays, if any, and the input
ids once they are in place; the other ranks' runners `follow` it: the same graph, or the same
forward, and the same logits (lockstep.py says why they never differ).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphkiln.errors import ConfigError
from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.models.transformer import CausalLM

from .attention.base import AttentionBackend
from .attention.metadata import attention_work, build_metadata
from .batch import Batch, InputIds, PendingIds, pack
from .decode_graphs import DecodeGraphs
from .graphs import capture_all, smallest_bucket
from .kv_cache import KVCache
from .lockstep import PublishedIds, ReceivedIds, Step
from .prefill_graphs import PiecewisePrefillGraphs, PrefillGraphs
from .sampler import Sampled, SamplingBatch, sample
from .scheduler import ScheduledChunk
from .transfer import upload

if TYPE_CHECKING:
    from .tensor_parallel import Peers

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Padding:
    """The token counts a forward without graphs pads to: the capture sizes of each kind of step."""

    decode: tuple[int, ...]
    prefill: tuple[int, ...]

    def size(self, batch: Batch) -> int:
        """The smallest size of the batch's kind that holds it; beyond the largest, its own size."""
        bucket = smallest_bucket(self.decode if batch.decode else self.prefill, batch.num_tokens)
        return bucket or batch.num_tokens


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        backend: AttentionBackend,
        *,
        forward: Forward | None = None,
        padding: Padding | None = None,
        decode_graphs: DecodeGraphs | None = None,
        prefill_graphs: PrefillGraphs | PiecewisePrefillGraphs | None = None,
        peers: Peers | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.forward = forward or model
        self.padding = padding
        self.decode_graphs = decode_graphs
        self.eager_graphs: DecodeGraphs | None = None  # the eager model's, replayed where decode_graphs has no bucket
        self.eager_prefill_graphs: PrefillGraphs | None = None  # likewise where prefill_graphs has none
        self.prefill_graphs = prefill_graphs
        self.peers = peers
        self.device = kv_cache.keys.device
        self.steps_without_graph: Counter[str] = Counter()  # "decode" / "prefill" / "long_prefill" (_long_prefill)

    def graph_sets(self) -> list:
        """The captured graph strategies (prefill first, decode last; the eager model's graphs of a kind until
        the compiled model's are planned)."""
        return [g for g in (self.prefill_graphs or self.eager_prefill_graphs, self.decode_graphs or self.eager_graphs)
                if g is not None]  # fmt: skip

    def release_eager_graphs(self, kind: str | None = None) -> None:
        """Drop the eager model's graphs of `kind` ("decode" or "prefill"; both by default), once the compiled
        model's are captured."""
        if kind in (None, "decode") and self.eager_graphs is not None:
            self.eager_graphs.graphs.release()
            self.eager_graphs = None
        if kind in (None, "prefill") and self.eager_prefill_graphs is not None:
            self.eager_prefill_graphs.graphs.release()
            self.eager_prefill_graphs = None

    def recapture(self) -> None:
        """Capture every graph again, same sizes, same pool (after kernel settings changed)."""
        if self.peers is not None:
            raise ConfigError("recapture() is for one rank: a tensor-parallel group captures its graphs together "
                              "while it loads; load the model again instead")  # fmt: skip
        for strategy in self.graph_sets():
            strategy.graphs.release()
        capture_all([job for strategy in self.graph_sets() for job in strategy.jobs()])

    def release(self) -> None:
        """Drop the graphs, the KV cache and the model, so their device memory can go back at once."""
        for graphs in (self.decode_graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.graphs.release()
        self.decode_graphs = self.prefill_graphs = None
        self.release_eager_graphs()
        self.kv_cache.release()
        self.backend.release()
        self.backend = self.forward = self.model = None
        if self.peers is not None:
            self.peers.close()

    def execute(self, chunks: list[ScheduledChunk], rows: list[int] | None = None) -> torch.Tensor:
        """float32 logits of the given token rows (default: every token) of one step, without graphs
        for decode (the decode graphs end in the sampler)."""
        with torch.inference_mode():
            return self._logits(pack(chunks), rows)

    def sample(
        self, chunks: list[ScheduledChunk], rows: list[int], sampling: SamplingBatch, pending: PendingIds | None = None
    ) -> Sampled:
        """Launch one step and sample the given rows on the device: token ids [len(rows)] and log-probabilities
        (None in greedy mode), not synchronized. A decode step that fits a bucket is one graph
        replay, sampler included. `pending` input tokens are taken from the previous step's output."""
        batch = pack(chunks)
        with torch.inference_mode():
            graphs = self.decode_graphs
            size = graphs.bucket(batch.num_tokens, sampling.mode) if batch.decode and graphs is not None else None
            if size is None and batch.decode and self.eager_graphs is not None:  # (one rank only)
                graphs = self.eager_graphs
                size = graphs.bucket(batch.num_tokens, sampling.mode)
            if size is not None:
                if self.peers is None:
                    return graphs.run(batch, sampling, pending, size)
                with self.peers.watch():
                    published = PublishedIds(Step(batch, batch.num_tokens, None, size, sampling), pending, self.peers)
                    return graphs.run(batch, sampling, published, size)
            logits = self._logits(batch, rows, pending)
            return sample(logits, sampling.tensors(self.device), sampling.mode)

    def _logits(self, batch: Batch, rows: list[int] | None, pending: PendingIds | None = None) -> torch.Tensor:
        graphs = self.prefill_graphs
        kind = "decode" if batch.decode else "long_prefill" if self._long_prefill(batch) else "prefill"
        with self.peers.watch() if self.peers is not None else contextlib.nullcontext():
            size = graphs.bucket(batch.num_tokens) if kind == "prefill" and graphs is not None else None
            if size is None and kind == "prefill" and self.eager_prefill_graphs is not None:  # (one rank only)
                graphs = self.eager_prefill_graphs
                size = graphs.bucket(batch.num_tokens)
            if size is not None:
                step = None if self.peers is None else Step(batch, batch.num_tokens, rows, size)
                hidden = graphs.run(batch, self._published(step, pending), size)
            else:
                self.steps_without_graph[kind] += 1
                hidden = self._forward(batch, rows, pending, long_prefill=kind == "long_prefill")
            return self._rows_logits(hidden, rows)

    def _long_prefill(self, batch: Batch) -> bool:
        """A prefill step the backend runs outside the graphs (`eager_prefill_work`, attention/base.py)."""
        limit = self.backend.eager_prefill_work
        if limit is None or batch.decode:
            return False
        return attention_work((s.query_len for s in batch.slices), (s.seq_len for s in batch.slices)) >= limit

    def _published(self, step: Step | None, pending: PendingIds | None) -> InputIds | None:
        """The step's pending ids; on rank 0 of a group, also sent to the other ranks with `step` (None on one rank)."""
        return pending if self.peers is None else PublishedIds(step, pending, self.peers)

    def _rows_logits(self, hidden: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
        if rows is not None:
            hidden = hidden.index_select(0, upload(rows, torch.int64, hidden.device))
        return self.model.compute_logits(hidden).float()

    def _forward(self, batch: Batch, rows: list[int] | None, pending: PendingIds | None, long_prefill: bool
                 ) -> torch.Tensor:  # fmt: skip
        padded = batch.padded(self.padding.size(batch)) if self.padding else batch
        input_ids = upload(padded.ids, torch.int64, self.device)
        step = None if self.peers is None else Step(padded, batch.num_tokens, rows)
        ids = self._published(step, pending)
        if ids is not None:
            ids.fill(input_ids)
        return self._run(padded, input_ids, batch.num_tokens, long_prefill)

    def _run(self, padded: Batch, input_ids: torch.Tensor, num_tokens: int, long_prefill: bool) -> torch.Tensor:
        meta = build_metadata(padded.slices, self.kv_cache.block_size, padded.num_tokens, self.device, long_prefill)
        positions = upload(padded.positions, torch.int64, self.device)
        with forward_context(ForwardContext(self.backend.plan(meta))):
            return self.forward(input_ids, positions)[:num_tokens]

    def follow(self, step: Step) -> None:
        """A tensor-parallel worker's part of rank 0's step, for their collectives: the graph rank 0 replays
        (its bucket, whatever this rank's readiness says), or the same forward; then the same logits."""
        ids = ReceivedIds(step.ids)
        with torch.inference_mode():
            if step.graph is not None and step.batch.decode:
                self.decode_graphs.run(step.batch, step.sampling, ids, step.graph)
                return
            if step.graph is not None:
                hidden = self.prefill_graphs.run(step.batch, ids, step.graph)
            else:
                input_ids = torch.empty(step.ids, dtype=torch.int64, device=self.device)
                ids.fill(input_ids)
                hidden = self._run(step.batch, input_ids, step.num_tokens, self._long_prefill(step.batch))
            self._rows_logits(hidden, step.rows)
