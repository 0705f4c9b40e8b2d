"""The attention custom op, graphkiln's only split point, and the forward context it reads.

`graphkiln::attention(q, k, v, out, layer_index, scale)` writes the new keys and values into the
paged KV cache and the attention result into `out`. Which kernels do that, and on which batch
(sequence lengths, block tables, slot mapping), is decided by the runtime: it binds a backend
and the planned batch into a `ForwardContext` around each forward call. The compiled graph sees
an opaque op that mutates `out`; the KV cache lives in the context, outside the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .ops import define

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


@dataclass(frozen=True)
class ForwardContext:
    """What one forward call's attention needs: a callable bound to a backend, a KV cache and a batch."""

    run_attention: AttentionFn


def zero_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   scale: float) -> None:
    """An attention that writes zeros and touches no cache: for traces and kernel warm-ups."""
    out.zero_()


_current: ContextVar[ForwardContext | None] = ContextVar("graphkiln_forward_context", default=None)


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def current_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "graphkiln::attention called outside a forward context; run the model through a runtime runner"
        )
    return ctx


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_index: int, scale: float
) -> None:
    """q/out [T, Hq, D], k/v [T, Hkv, D] for T packed tokens of the current batch."""
    current_forward_context().run_attention(layer_index, q, k, v, out, scale)


def _attention_shape(q, k, v, out, layer_index, scale) -> None:
    return None


attention = define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int layer_index, float scale) -> ()",
    _attention, _attention_shape,
)
