"""linear_op: route the decoder's weight products through graphkiln::linear (models/linear.py).

A post-grad pass. Every `mm(x, permute(w, [1, 0]))` and `addmm(c, x, permute(w, [1, 0]))` whose
w is a 2-D graph input (a weight) becomes `graphkiln::linear(x, w)`, plus `add(c, ...)` for an
addmm. The op picks its kernel per call, so one dynamic-shape compile serves both a decode
bucket of one row (Triton GEMV) and every larger bucket (cuBLAS). The residual add that cuBLAS
took as `addmm`'s epilogue (after a copy of the residual into the output, one more launch)
joins the RMSNorm reduction kernel that reads the residual anyway.
"""

from __future__ import annotations

import torch

import graphkiln.models.linear  # noqa: F401  (registers graphkiln::linear)

from .base import PostGradPass

aten = torch.ops.aten
LINEAR = torch.ops.graphkiln.linear.default
TRANSPOSES = (aten.permute.default, aten.t.default)


def _weight(transposed: torch.fx.Node) -> torch.fx.Node | None:
    """w, when `transposed` is w^T of a 2-D graph input w."""
    if not (isinstance(transposed, torch.fx.Node) and transposed.target in TRANSPOSES):
        return None
    if transposed.target is aten.permute.default and list(transposed.args[1]) != [1, 0]:
        return None
    weight = transposed.args[0]
    if weight.op != "placeholder" or weight.meta["val"].dim() != 2:
        return None
    return weight


def _matmul(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None] | None:
    """(x, w, addend) of a weight product y = x @ w^T (+ addend), else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.mm.default:
        (x, transposed), addend = node.args, None
    elif node.target is aten.addmm.default and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        addend, x, transposed = node.args
    else:
        return None
    weight = _weight(transposed)
    return None if weight is None else (x, weight, addend)


class LinearOp(PostGradPass):
    name = "linear_op"

    def __call__(self, graph: torch.fx.Graph) -> int:
        matches = 0
        for node in list(graph.nodes):
            found = _matmul(node)
            if found is None:
                continue
            x, weight, addend = found
            fake = node.meta["val"]
            with graph.inserting_before(node), fake.fake_mode:
                product = graph.call_function(LINEAR, (x, weight))
                product.meta["val"] = LINEAR(x.meta["val"], weight.meta["val"])
                result = product
                if addend is not None:
                    result = graph.call_function(aten.add.Tensor, (addend, product))
                    result.meta["val"] = addend.meta["val"] + product.meta["val"]
            node.replace_all_uses_with(result)
            transposed = node.args[-1]
            graph.erase_node(node)
            if not transposed.users:
                graph.erase_node(transposed)
            matches += 1
        return matches
