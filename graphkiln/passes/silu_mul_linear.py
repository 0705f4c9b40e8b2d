"""silu_mul_linear: the MLP's `down_proj(silu(gate) * up)` becomes graphkiln::silu_mul_linear(gate_up, w).

A Dynamo-graph pass. It matches `linear(silu(a) * b, w[, bias])` where a and b are the two halves
of one `chunk(2, dim=-1)`, and calls the op on the chunked tensor instead (plus the bias, if
any). At one row on CUDA the op computes the activation inside its GEMV as the weight streams
by, so a decode step at batch 1 loses the SiLU-and-mul launch of every layer; at more rows it
is one Triton SiLU-and-mul launch and cuBLAS, as Inductor's fused kernel and mm were. Likewise
`graphkiln::int4_linear(silu(a) * b, ...)` becomes graphkiln::int4_silu_mul_linear (models/int4_fused.py), whose
one-row product applies the activation as it writes its input's words: one launch fewer a layer there too.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F

import graphkiln.models.linear  # noqa: F401  (registers graphkiln::silu_mul_linear)

from graphkiln.compat import TORCH_LINEAR
from graphkiln.models.int4_fused import int4_silu_mul_linear
from graphkiln.models.quantized_linear import int4_linear

from .base import GraphPass

SILU_MUL_LINEAR = torch.ops.graphkiln.silu_mul_linear.default
INT4_SILU_MUL_LINEAR = int4_silu_mul_linear.default
INT4_LINEARS = (int4_linear, int4_linear.default)
LINEARS = (TORCH_LINEAR, F.linear)
MULS = (operator.mul, torch.mul)


def method_part(node, index: int, method: str) -> torch.fx.Node | None:
    """The `t.<method>(...)` call node, when `node` is part `index` of its result (a getitem of it)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    call, i = node.args
    return call if i == index and call.op == "call_method" and call.target == method else None


def _half(node, index: int) -> torch.fx.Node | None:
    """The chunked tensor, when `node` is half `index` of `t.chunk(2, dim=-1)`."""
    chunk = method_part(node, index, "chunk")
    if chunk is None:
        return None
    source, *rest = chunk.args
    dim = rest[1] if len(rest) > 1 else chunk.kwargs.get("dim", 0)
    chunks = rest[0] if rest else chunk.kwargs.get("chunks")
    ndim = source.meta["example_value"].dim()
    return source if chunks == 2 and dim in (-1, ndim - 1) else None


def gated_input(mul) -> torch.fx.Node | None:
    """t, when `mul` is silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1] (either operand order)."""
    if not (isinstance(mul, torch.fx.Node) and mul.op == "call_function" and mul.target in MULS):
        return None
    for silu, up in (mul.args, mul.args[::-1]):
        if isinstance(silu, torch.fx.Node) and silu.target is F.silu and not silu.kwargs.get("inplace", False):
            source = _half(silu.args[0], 0)
            if source is not None and _half(up, 1) is source:
                return source
    return None


def call_arguments(node: torch.fx.Node) -> tuple:
    """A custom op call's arguments in schema order, however they were passed."""
    op = node.target.default if isinstance(node.target, torch._ops.OpOverloadPacket) else node.target
    given = node.args
    return (*given, *(node.kwargs.get(a.name, a.default_value) for a in op._schema.arguments[len(given):]))


def replace(graph: torch.fx.Graph, node: torch.fx.Node, target, args: tuple, bias=None) -> None:
    """A call of `target` on `args` (plus `bias`, when given) in place of `node`: inserted before it with its
    example value, its users routed to the call, and `node` and the pure ops that fed only it erased."""
    with graph.inserting_before(node):
        result = graph.call_function(target, args)
        result.meta["example_value"] = node.meta["example_value"]
        if bias is not None:
            result = graph.call_function(operator.add, (result, bias))
            result.meta["example_value"] = node.meta["example_value"]
    node.replace_all_uses_with(result)
    erase_unused(graph, node)


def rewrite(gm: torch.fx.GraphModule, call_for: Callable[[torch.fx.Node], tuple | None]) -> int:
    """Replace (`replace`) every node for which `call_for` gives (target, args[, bias]) by that call; recompile
    `gm` and return how many were replaced."""
    matches = 0
    for node in list(gm.graph.nodes):
        call = call_for(node)
        if call:
            replace(gm.graph, node, *call)
            matches += 1
    gm.recompile()
    return matches


def erase_unused(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase `node` and, transitively, the pure ops that fed only it (the old chunk, silu, mul)."""
    work, erased = [node], set()
    while work:
        n = work.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or n.is_impure():
            continue
        work.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)


def _gated_down_call(node: torch.fx.Node) -> tuple | None:
    """(op, args, bias) of silu_mul_linear or int4_silu_mul_linear for `node`, when it is a linear or an int4
    product of a gated input."""
    if node.op != "call_function" or node.target not in (*LINEARS, *INT4_LINEARS):
        return None
    if node.target in INT4_LINEARS:
        x, *weights = call_arguments(node)
        gate_up = gated_input(x)
        return None if gate_up is None else (INT4_SILU_MUL_LINEAR, (gate_up, *weights), None)
    x, weight, *rest = node.args
    gate_up = gated_input(x)
    if gate_up is None:
        return None
    return SILU_MUL_LINEAR, (gate_up, weight), rest[0] if rest else node.kwargs.get("bias")


class SiluMulLinear(GraphPass):
    name = "silu_mul_linear"

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        return rewrite(gm, _gated_down_call)
