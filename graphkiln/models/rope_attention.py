"""Attention given its query and key heads before the rotary embedding.

`graphkiln::rope_attention(qk, v, out, table, positions, layer_index, scale)` is graphkiln::attention(q, k, v, out,
layer_index, scale) with (q, k) = rope(qk, table, positions) split after out's heads: the model's rope and attention
as one op, which passes/rope_attention.py puts in the graph. Where the planned attention rotates q and the new keys
as it loads them (its function has `with_rope`: the Triton backend's decode), the rope launch goes; elsewhere the op
runs rope, then attention, as the graph did.
"""

from __future__ import annotations

import torch

from .attention import current_forward_context
from .ops import define
from .rope import rope


def _rope_attention(qk: torch.Tensor, v: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                    positions: torch.Tensor, layer_index: int, scale: float) -> None:
    """qk [T, Hq + Hkv, D] (the query heads, then the key heads), v [T, Hkv, D], out [T, Hq, D]."""
    run = current_forward_context().run_attention
    heads = [out.shape[1], qk.shape[1] - out.shape[1]]
    fused = getattr(run, "with_rope", None)
    if fused is not None:
        q, k = qk.split(heads, dim=1)
        fused(layer_index, q, k, v, out, scale, table, positions)
        return
    q, k = rope(qk, table, positions).split(heads, dim=1)
    run(layer_index, q, k, v, out, scale)


def _rope_attention_shape(qk, v, out, table, positions, layer_index, scale) -> None:
    return None


rope_attention = define(
    "rope_attention(Tensor qk, Tensor v, Tensor(a!) out, Tensor table, Tensor positions, int layer_index, "
    "float scale) -> ()",
    _rope_attention, _rope_attention_shape,
)
