"""Split the Dynamo graph at every graphkiln::attention call into pieces: piece, attn, piece, attn, ..., piece.

Every attention call gets a submodule of its own; the nodes between two calls form one piece.
`split_module(keep_original_order=True)` keeps mutations (the op writes `out`) in program order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.passes.split_module import split_module

ATTENTION_OP = "graphkiln.attention"


def is_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).removesuffix(".default") == ATTENTION_OP


@dataclass
class SplitGraph:
    """The stitching graph and, in call order, the names of its submodules and whether each is attention."""

    gm: torch.fx.GraphModule
    submodules: list[tuple[str, bool]]

    @property
    def pieces(self) -> list[str]:
        return [name for name, attn in self.submodules if not attn]


def split_at_attention(gm: torch.fx.GraphModule) -> SplitGraph:
    partition: dict[torch.fx.Node, int] = {}
    part = 0
    for node in gm.graph.nodes:
        if is_attention(node):
            partition[node] = part + 1
            part += 2
        else:
            partition[node] = part
    split = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    order = [n.target for n in split.graph.nodes if n.op == "call_module"]
    submodules = [(name, any(is_attention(n) for n in split.get_submodule(name).graph.nodes)) for name in order]
    return SplitGraph(split, submodules)
