"""The pieces the attention_split pass cut the graph into: piece, attn, piece, attn, ..., piece.

With that pass disabled the graph has no submodules and becomes one piece, attention inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.passes.split_module import split_module

from graphkiln.passes.attention_split import is_attention


@dataclass
class SplitGraph:
    """The stitching graph and, in call order, the names of its submodules and whether each is attention."""

    gm: torch.fx.GraphModule
    submodules: list[tuple[str, bool]]

    @property
    def pieces(self) -> list[str]:
        return [name for name, attn in self.submodules if not attn]


def split_pieces(gm: torch.fx.GraphModule) -> SplitGraph:
    """Wrap `gm` after the passes in a fresh GraphModule, without the attributes Dynamo set on it."""
    if any(n.op == "call_module" for n in gm.graph.nodes):
        split = torch.fx.GraphModule(dict(gm.named_children()), gm.graph)
    else:
        split = split_module(gm, None, lambda n: 0, keep_original_order=True)
    order = [n.target for n in split.graph.nodes if n.op == "call_module"]
    return SplitGraph(split, [(name, _only_attention(split.get_submodule(name))) for name in order])


def _only_attention(gm: torch.fx.GraphModule) -> bool:
    calls = [n for n in gm.graph.nodes if n.op.startswith("call")]
    return bool(calls) and all(is_attention(n) for n in calls)
