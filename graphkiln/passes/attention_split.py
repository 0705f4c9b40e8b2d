"""attention_split: cut the Dynamo graph at every graphkiln::attention (or rope_attention) call.

In place, the graph becomes a stitching graph that calls submodules piece, attention, piece,
..., piece (`split_module(keep_original_order=True)` keeps the op's write to `out` in program
order). Disabled, compiler/split.py makes the whole graph one piece and Inductor compiles
attention inside it. `boundaries` and `summary` describe a split for the dump and the tests:
the ops each submodule holds and the tensors (with symbolic shapes) that cross each cut.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch.fx.passes.split_module import split_module

from .base import GraphPass

ATTENTION_OPS = ("graphkiln.attention", "graphkiln.rope_attention")


def is_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).removesuffix(".default") in ATTENTION_OPS


def assign_pieces(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Submodule index of every node: even for pieces, odd for the attention call between them."""
    pieces, part = {}, 0
    for node in graph.nodes:
        if is_attention(node):
            pieces[node] = part + 1
            part += 2
        else:
            pieces[node] = part
    return pieces


class AttentionSplit(GraphPass):
    name = "attention_split"

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        pieces = assign_pieces(gm.graph)
        split = split_module(gm, None, pieces.__getitem__, keep_original_order=True, keep_original_node_name=True)
        for name, submodule in split.named_children():
            gm.add_submodule(name, submodule)
        gm.graph = split.graph
        return sum(piece % 2 for piece in pieces.values())


def describe(t: torch.Tensor) -> str:
    """`float32[s72, 4, 16]`: dtype and (symbolic) shape of a fake tensor."""
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, t.shape))}]"


def _produced(split: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """The node inside a submodule that computes a stitching-graph value, or None for inputs and tuples."""
    call, index = node, None
    if node.op == "call_function" and node.target is operator.getitem:
        call, index = node.args
    if call.op != "call_module":
        return None
    returned = split.get_submodule(call.target).graph.output_node().args[0]
    inner = returned if index is None else returned[index]
    return inner if isinstance(inner, torch.fx.Node) else None


def boundaries(split: torch.fx.GraphModule) -> list[list[tuple[str, str]]]:
    """For each cut between consecutive submodules, the (name, shape) of every tensor computed
    before the cut and read after it (by a later submodule or as the graph's result)."""
    order = {n: i for i, n in enumerate(n for n in split.graph.nodes if n.op == "call_module")}
    cuts: list[list[tuple[str, str]]] = [[] for _ in range(len(order) - 1)]
    for node in split.graph.nodes:
        inner = _produced(split, node)
        if inner is None or not isinstance(inner.meta.get("example_value"), torch.Tensor):
            continue
        source = order[node] if node in order else order[node.args[0]]
        last = max(order.get(u, len(order) - 1) for u in node.users)
        for cut in range(source, last):
            cuts[cut].append((inner.name, describe(inner.meta["example_value"])))
    return cuts


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def summary(split: torch.fx.GraphModule, attention: dict[str, bool], keys: dict[str, str]) -> str:
    """Markdown: one row per submodule with its ops, then the tensors crossing each cut."""
    cuts = boundaries(split)
    lines = [
        "# attention split",
        "",
        f"{sum(not a for a in attention.values())} pieces, {sum(attention.values())} attention submodules; "
        f"{sum(map(len, cuts))} tensors cross {len(cuts)} cuts.",
        "",
        "| submodule | kind | Inductor key | ops |",
        "|---|---|---|---|",
    ]
    for name, attn in attention.items():
        ops = Counter(_op_name(n) for n in split.get_submodule(name).graph.nodes if n.op.startswith("call"))
        listed = ", ".join(f"{op} x{k}" if k > 1 else op for op, k in ops.items())
        lines.append(f"| {name} | {'attention' if attn else 'piece'} | {keys.get(name, '')} | {listed} |")
    lines += ["", "## tensors crossing each cut", ""]
    names = list(attention)
    for i, cut in enumerate(cuts):
        lines.append(f"- {names[i]} | {names[i + 1]}: {len(cut)} " + " ".join(f"`{n}: {s}`" for n, s in cut))
    return "\n".join(lines) + "\n"
