"""What the Dynamo-graph pattern passes share: the targets they look for, a node test, dead-node cleanup."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

LINEARS = (torch._C._nn.linear, F.linear)
MULS = (operator.mul, torch.mul)


def is_call(node, *targets) -> bool:
    """`node` is a call_function or call_method node of one of `targets` (a method by its name)."""
    return isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def erase_unused(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase `node` and, transitively, the pure ops that fed only it."""
    work, erased = [node], set()
    while work:
        n = work.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or n.is_impure():
            continue
        work.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
