"""noop_elimination: drop Dynamo-graph ops that return their input unchanged.

A `.view`/`.reshape` to the same shape, `.to` the same dtype and device, `.float()` on float32,
`.contiguous()` on a contiguous tensor, and `x[..., :]`-style slices of whole dims are removed
when the node's `example_value` has its input's dtype, device, shape, strides and storage
offset: the op would return the input itself or an identical view of it. A `.view`/`.reshape`
of a `.view`/`.reshape` of a contiguous tensor is rewired to reshape that tensor directly.

Inductor's own `remove_noop_ops` and AOTAutograd already drop these before codegen, so the
kernels do not change; what changes is the FX graph the split and the dumps see: fewer nodes,
and a value and its no-op alias no longer both cross a piece boundary.
"""

from __future__ import annotations

import operator

import torch

from .base import GraphPass

ALIAS_METHODS = frozenset({"view", "reshape", "contiguous", "to", "float"})
VIEW_METHODS = frozenset({"view", "reshape"})


def _fake(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _geometry(t: torch.Tensor) -> tuple:
    return t.dtype, t.device, tuple(map(str, t.shape)), tuple(map(str, t.stride())), str(t.storage_offset())


def _whole_slices(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is Ellipsis or isinstance(p, slice) for p in parts)


def _is_alias(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ALIAS_METHODS and not node.kwargs.get("copy", False)
    return node.op == "call_function" and node.target is operator.getitem and _whole_slices(node.args[1])


def _is_noop(node: torch.fx.Node) -> bool:
    if not _is_alias(node):
        return False
    out, source = _fake(node), _fake(node.args[0])
    return out is not None and source is not None and _geometry(out) == _geometry(source)


def _collapse_view_chain(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """view(view(x, a), b) -> view(x, b) when x is contiguous (then every view of it is valid)."""
    inner = node.args[0] if node.op == "call_method" and node.target in VIEW_METHODS else None
    if not (isinstance(inner, torch.fx.Node) and inner.op == "call_method" and inner.target in VIEW_METHODS):
        return False
    base = _fake(inner.args[0])
    if base is None or not base.is_contiguous():
        return False
    node.args = (inner.args[0], *node.args[1:])
    if not inner.users:
        graph.erase_node(inner)
    return True


class NoopElimination(GraphPass):
    name = "noop_elimination"

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        matches = 0
        for node in list(gm.graph.nodes):
            matches += _collapse_view_chain(gm.graph, node)
            if _is_noop(node):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                matches += 1
        return matches
