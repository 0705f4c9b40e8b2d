"""Graph plans: how the runtime runs each phase of the one compiled model, as data.

PREFILL is compiled piecewise (split at attention) and padded to a token bucket; the runtime
replays it as one CUDA graph per bucket where the attention backend can capture its prefill,
else one graph per piece and bucket with attention called eagerly between them. DECODE runs the
whole step as one unit padded to a batch bucket (one CUDA graph per bucket, attention inside).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

PIECEWISE = "piecewise"
FULL = "full"


def smallest_bucket(sizes: tuple[int, ...], count: int) -> int | None:
    """The smallest of the increasing `sizes` that holds `count`, or None beyond the largest."""
    i = bisect.bisect_left(sizes, count)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphPlan:
    phase: str
    sizes: tuple[int, ...]
    cuda_graph: str

    def bucket(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.sizes, num_tokens)


def plans_for(decode_batch_sizes: tuple[int, ...], prefill_token_buckets: tuple[int, ...]) -> dict[str, GraphPlan]:
    return {
        "decode": GraphPlan("decode", decode_batch_sizes, FULL),
        "prefill": GraphPlan("prefill", prefill_token_buckets, PIECEWISE),
    }
