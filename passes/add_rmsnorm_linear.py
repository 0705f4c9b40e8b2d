"""add_rmsnorm_linear: `linear(rms_norm(a + b), w)` becomes graphkiln::add_rmsnorm_linear(a, b, g, w, eps).

A Dynamo-graph pass. It matches the RMSNorm of models/transformer.py (`rms_norm` in
models/linear.py, as Dynamo inlines it) whose input is a residual add and whose one user is a
linear of a weight (a graph input), and calls the op where the add was; the add's other users (the next residual add) read the sum the
op returns. At one row on CUDA the op is one GEMV that also adds, normalizes and stores the sum,
so a decode step at batch 1 loses both norm launches of every layer but the first; at more rows
it is one Triton add-and-RMSNorm launch and cuBLAS, as Inductor's fused kernel and mm were.
"""

from __future__ import annotations

import operator

import torch

import graphkiln.models.linear  # noqa: F401  (registers graphkiln::add_rmsnorm_linear)

from .base import GraphPass
from .fx_match import LINEARS, MULS, erase_unused, is_call

ADD_RMSNORM_LINEAR = torch.ops.graphkiln.add_rmsnorm_linear.default


def rms_norm_parts(out: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, float] | None:
    """(h, h32, g, eps) when `out` is g * (h32 * rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype),
    h32 = h.float(), g a 1-D graph input: models/linear.py's rms_norm as Dynamo records it."""
    if not is_call(out, *MULS):
        return None
    weight, cast = out.args
    if not (isinstance(weight, torch.fx.Node) and weight.op == "placeholder" and is_call(cast, "to")):
        return None
    scaled = cast.args[0]
    if not is_call(scaled, *MULS):
        return None
    h32, rsqrt = scaled.args
    if not (is_call(h32, "float") and is_call(rsqrt, torch.rsqrt) and is_call(rsqrt.args[0], operator.add)):
        return None
    mean, eps = rsqrt.args[0].args
    if not (is_call(mean, "mean") and mean.args[1:] == (-1,) and mean.kwargs == {"keepdim": True}
            and isinstance(eps, float)):
        return None
    square = mean.args[0]
    if not (is_call(square, "pow") and square.args == (h32, 2)):
        return None
    h = h32.args[0]
    dtype, size = h.meta["example_value"].dtype, h.meta["example_value"].shape[-1]
    if cast.args[1:] != (dtype,) or cast.kwargs or tuple(weight.meta["example_value"].shape) != (size,):
        return None
    return h, h32, weight, eps


def _residual_add(h: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(a, b), when `h` is a + b of two tensors of h's shape and dtype."""
    if not (is_call(h, operator.add) and len(h.args) == 2 and not h.kwargs):
        return None
    want = h.meta["example_value"]
    for arg in h.args:
        value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.shape != want.shape or value.dtype != want.dtype:
            return None
    return h.args


class AddRmsNormLinear(GraphPass):
    name = "add_rmsnorm_linear"

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph, matches = gm.graph, 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in LINEARS:
                continue
            normed, weight, *rest = node.args
            bias = rest[0] if rest else node.kwargs.get("bias")
            parts = rms_norm_parts(normed) if isinstance(normed, torch.fx.Node) else None
            if parts is None or len(normed.users) != 1 or getattr(weight, "op", None) != "placeholder":
                continue
            h, h32, norm_weight, eps = parts
            summands = _residual_add(h)
            if summands is None:
                continue
            with graph.inserting_after(h):  # where the sum was, so every reader of it comes after
                fused = graph.call_function(ADD_RMSNORM_LINEAR, (*summands, norm_weight, weight, eps))
                fused.meta["example_value"] = (node.meta["example_value"], h.meta["example_value"])
            with graph.inserting_after(fused):
                total = graph.call_function(operator.getitem, (fused, 1))
                total.meta["example_value"] = h.meta["example_value"]
            with graph.inserting_before(node):
                result = graph.call_function(operator.getitem, (fused, 0))
                result.meta["example_value"] = node.meta["example_value"]
                if bias is not None:
                    result = graph.call_function(operator.add, (result, bias))
                    result.meta["example_value"] = node.meta["example_value"]
            h.replace_all_uses_with(total, delete_user_cb=lambda user, norm_input=h32: user is not norm_input)
            node.replace_all_uses_with(result)
            erase_unused(graph, node)  # the linear, the norm, then the add
            matches += 1
        gm.recompile()
        return matches
