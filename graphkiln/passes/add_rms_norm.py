"""add_rms_norm: a residual add and the RMSNorm of its sum become one graphkiln::add_rms_norm call.

A Dynamo-graph pass, on by default in CUDA compiles (the decode step measured faster: README, "Passes and
dumps") and off on the CPU unless named (`CompileConfig(enabled_passes=("add_rms_norm",))`). It matches transformer.RMSNorm's ops, `weight * (s32 * rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(
dtype)` with s32 = s.float(), where s = a + b of two 2-D tensors of the weight's dtype, and calls the op on a, b,
the weight and eps: its first output takes the sum's other users (the residual stream), its second the
norm's. The norms of the embedding and of q/k heads, with no add before them, are left to Inductor. On CUDA
the op is one Triton launch per step that holds each row in registers and, with programmatic dependent
launch, loads the norm's weight while the product before it drains (kernels/rms_norm.py).
"""

from __future__ import annotations

import operator

import torch

from graphkiln.models.norm import add_rms_norm

from .base import GraphPass
from .silu_mul_linear import MULS, erase_unused

ADD_RMS_NORM = add_rms_norm.default
ADDS = (operator.add, torch.add)


def _call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _method(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _value(node: torch.fx.Node) -> torch.Tensor | None:
    value = node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None


def _norm_of(rsqrt) -> tuple | None:
    """(s32, weight, eps, out, dtype) when `rsqrt` is the rsqrt of an RMSNorm: s32 = s.float() of its input s, out
    the weight's product, dtype what the normalized rows are cast to before it."""
    if not (_call(rsqrt, (torch.rsqrt,)) and len(rsqrt.users) == 1):
        return None
    shifted = rsqrt.args[0]
    if not (_call(shifted, ADDS) and len(shifted.users) == 1):
        return None
    mean, eps = shifted.args
    if not (_method(mean, "mean") and isinstance(eps, float) and len(mean.users) == 1):
        return None
    if mean.args[1:] != (-1,) or mean.kwargs != {"keepdim": True}:
        return None
    square = mean.args[0]
    if not (_method(square, "pow") and square.args[1:] == (2,) and len(square.users) == 1):
        return None
    s32 = square.args[0]
    scaled = next(iter(rsqrt.users))
    if not (_method(s32, "float") and _call(scaled, MULS) and set(scaled.args) == {s32, rsqrt}
            and set(s32.users) == {square, scaled} and len(scaled.users) == 1):
        return None
    cast = next(iter(scaled.users))
    if not (_method(cast, "to") and len(cast.args) == 2 and isinstance(cast.args[1], torch.dtype)
            and len(cast.users) == 1):
        return None
    out = next(iter(cast.users))
    if not (_call(out, MULS) and len(out.args) == 2 and cast in out.args):
        return None
    weight = out.args[1] if out.args[0] is cast else out.args[0]
    return (s32, weight, eps, out, cast.args[1]) if isinstance(weight, torch.fx.Node) else None


def _takes(total: torch.fx.Node, weight: torch.fx.Node, dtype: torch.dtype) -> tuple | None:
    """(a, b) when `total` is a + b of two 2-D tensors of one shape and of `dtype`, the weight's and the cast's
    (as transformer.RMSNorm casts to its input's dtype), and the weight [H] as wide as a row; else None."""
    if not (_call(total, ADDS) and len(total.args) == 2 and not total.kwargs):
        return None
    a, b = total.args
    values = [_value(n) if isinstance(n, torch.fx.Node) else None for n in (a, b, total, weight)]
    if any(v is None for v in values):
        return None
    va, vb, vs, vw = values
    if va.dim() != 2 or va.shape != vb.shape or not (va.dtype == vb.dtype == vs.dtype == vw.dtype == dtype):
        return None
    if vw.dim() != 1 or vw.shape[0] != va.shape[1]:
        return None
    return a, b


class AddRmsNorm(GraphPass):
    name = "add_rms_norm"
    default_devices = ("cuda",)  # on the CPU the op runs its reference body, which Inductor fuses no further

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph, matches = gm.graph, 0
        for node in list(graph.nodes):
            norm = _norm_of(node)
            if not norm:
                continue
            s32, weight, eps, out, dtype = norm
            total = s32.args[0]
            operands = _takes(total, weight, dtype)
            if not operands:
                continue
            with graph.inserting_before(total):
                pair = graph.call_function(ADD_RMS_NORM, (*operands, weight, eps))
                pair.meta["example_value"] = (_value(total), _value(out))
                new_total = graph.call_function(operator.getitem, (pair, 0))
                new_total.meta["example_value"] = _value(total)
                normed = graph.call_function(operator.getitem, (pair, 1))
                normed.meta["example_value"] = _value(out)
            out.replace_all_uses_with(normed)
            total.replace_all_uses_with(new_total, delete_user_cb=lambda user: user is not s32)
            erase_unused(graph, out)  # the norm's ops, then the add, which now feeds only them
            matches += 1
        gm.recompile()
        return matches
