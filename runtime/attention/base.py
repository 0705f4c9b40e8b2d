"""The interface every attention backend implements.

`plan(meta)` runs outside any graph, before every forward call, and returns the function the
graphkiln::attention op calls for each layer. For CUDA-graph decode the runner allocates the
metadata tensors once at the largest bucket and passes views of them: the returned function
must then read only device tensors and sizes fixed by the bucket, so a captured replay sees
whatever the runner (and a repeated `plan` on the same buffers) wrote there before it.
Padded decode rows arrive as one-token sequences in the dummy block; padded prefill rows
belong to no sequence and their outputs are ignored.
"""

from __future__ import annotations

from typing import Protocol

from graphkiln.models.attention import AttentionFn

from .metadata import BatchMetadata


class AttentionBackend(Protocol):
    name: str
    capturable: bool

    def plan(self, meta: BatchMetadata) -> AttentionFn: ...
