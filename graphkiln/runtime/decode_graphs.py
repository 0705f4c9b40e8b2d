"""Decode CUDA graphs: per decode batch bucket, the whole step from input ids to sampled ids.

Each bucket has one graph per sampling mode (greedy, sample, filter; see sampler.py), attention,
LM head and sampler inside; or, without `sampler_inside`, one graph up to the logits, sampled after each
replay (the eager model's graph while a background load brings the pieces: one capture a bucket). The
batch (static_batch.StaticBatch) and per-row sampling parameters live in buffers sized once for the
largest bucket; every graph reads views of them. A replay copies the padded batch into the buffers,
re-plans the backend on the same buffers, and replays the mode's graph.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from graphkiln.models.attention import ForwardContext, forward_context

from .batch import Batch, InputIds
from .graphs import CaptureJob, CaptureSetup, GraphSet
from .sampler import MODES, Sampled, SamplingBatch, SamplingTensors, sample
from .static_batch import StaticBatch

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LOGITS = "logits"  # the graph key's mode of a graph that ends at the logits


class DecodeGraphs:
    def __init__(self, setup: CaptureSetup, sizes: tuple[int, ...], forward: Forward, compute_logits: Forward,
                 sampler_inside: bool = True) -> None:  # fmt: skip
        self.graphs = GraphSet("decode", sizes, setup.pool)
        self.modes = MODES if sampler_inside else (LOGITS,)
        self.backend = setup.backend
        self.forward = forward
        self.compute_logits = compute_logits
        largest = self.graphs.sizes[-1]
        self.batch = StaticBatch(largest, largest, setup.max_blocks_per_seq, setup.block_size, setup.device)
        self.sampling = SamplingTensors.empty(largest, setup.device)
        self.sampling_staging = SamplingTensors(*(self.batch.pinned_like(t) for t in self.sampling))

    def bucket(self, num_seqs: int, mode: str) -> int | None:
        """The smallest bucket holding `num_seqs` whose graph for `mode` is captured."""
        return self.graphs.ready_bucket(num_seqs, lambda size: (size, self._graph_mode(mode)))

    def _graph_mode(self, mode: str) -> str:
        return mode if mode in self.modes else LOGITS

    def _step(self, size: int, mode: str) -> Sampled | torch.Tensor:
        meta = self.batch.metadata("decode", size, size, (1,) * size, (1,) * size)
        with forward_context(ForwardContext(self.backend.plan(meta))):
            hidden = self.forward(self.batch.input_ids[:size], self.batch.positions[:size])
            logits = self.compute_logits(hidden)
            return logits if mode == LOGITS else sample(logits, self.sampling.rows(size), mode)

    def _warm_one(self, size: int, mode: str) -> None:
        self.graphs.warm(partial(self._step, size, mode), (size, mode))

    def _capture_one(self, size: int, mode: str) -> None:
        with self.graphs.capturing((size, mode)):
            self.graphs.capture((size, mode), partial(self._step, size, mode))

    def dry_steps(self) -> list[Callable[[], Sampled]]:
        """Steps to run once outside any capture (kernel_builds.py): each bucket's greedy step (the model's
        kernels are the same in every sampling mode), and the smallest bucket's in each other mode inside the
        graphs, whose first calls (the sampler's kernels, the random generator's device state) a capture would
        otherwise pay under the step lock."""
        first = self.graphs.sizes[0]
        return [partial(self._step, size, "greedy") for size in self.graphs.sizes] + [
            partial(self._step, first, mode) for mode in self.modes if mode not in ("greedy", LOGITS)]  # fmt: skip

    def jobs(self) -> list[CaptureJob]:
        """One capture per bucket and graph mode, smallest bucket first."""
        return [CaptureJob(self.graphs, f"{size}/{mode}", partial(self._capture_one, size, mode), (size, mode),
                           partial(self._warm_one, size, mode)) for size in self.graphs.sizes for mode in self.modes]

    def run(self, batch: Batch, sampling: SamplingBatch, pending: InputIds | None, size: int) -> Sampled:
        """The sampled rows (ids; log-probabilities unless greedy) of a decode step in bucket `size` (`bucket`).

        A greedy step copies no sampling parameters. `pending` then overwrites input ids still on the device
        (or, on a tensor-parallel rank, sends them to the others or receives them: lockstep.py).
        """
        n = len(batch.slices)
        mode = sampling.mode
        with self.batch.staging_turn():
            meta = self.batch.fill("decode", batch.padded(size), size)
            if mode != "greedy":
                for column, host, target in zip(sampling.padded(size).columns(), self.sampling_staging, self.sampling):
                    host.numpy()[:size] = column
                    target[:size].copy_(host[:size], non_blocking=True)
        if pending is not None:
            pending.fill(self.batch.input_ids)
        self.backend.plan(meta)
        graph_mode = self._graph_mode(mode)
        out = self.graphs.replay((size, graph_mode))
        if graph_mode == LOGITS:  # sampled here as inside a graph, padded rows too
            out = sample(out, self.sampling.rows(size), mode)
        return out.rows(n)
