"""The interface every attention backend implements.

`plan(meta)` runs outside any graph, before every forward call, and returns the function the
graphkiln::attention op calls for each layer. For CUDA graphs (decode when `capturable_decode`,
prefill and mixed steps when `capturable_prefill`; otherwise prefill runs piecewise, attention
eager between graphed pieces) the runner allocates the metadata tensors once and passes views
of them with `meta.graph` set: the returned function must then launch shapes fixed by those
views, so a captured replay sees whatever the runner (and a repeated `plan` on the same
buffers) wrote there before it. Padded decode rows arrive as one-token sequences in the dummy
block; padded prefill rows belong to no sequence and their outputs are ignored. A prefill step of the
runner's whose `attention_work` reaches `eager_prefill_work` (None: none does) runs outside the prefill
graphs, its metadata marked `long_prefill`: the backend plans it with kernels a graph cannot hold
(long_prefill.py). Warm-ups, dry steps and captures never mark theirs.
"""

from __future__ import annotations

from typing import Protocol

from graphkiln.models.attention import AttentionFn

from .metadata import BatchMetadata


class AttentionBackend(Protocol):
    name: str
    capturable_decode: bool
    capturable_prefill: bool
    concurrent_plans: bool  # two threads may plan and run forwards at once (the plan keeps no state of its own)
    prompt_lengths: tuple[int, ...]  # prefills of these token counts launch every kernel variant of its own
    eager_prefill_work: int | None  # prefill steps of this much attention work or more run outside graphs

    def plan(self, meta: BatchMetadata) -> AttentionFn: ...

    def release(self) -> None:
        """Drop the device buffers it allocated for itself; the engine is closing and the backend unusable after.
        Whatever still holds the backend (a plan kept by a reference cycle) then holds no device memory: a
        small buffer left in the tail of the allocator segment the KV cache took would keep all of it reserved."""
