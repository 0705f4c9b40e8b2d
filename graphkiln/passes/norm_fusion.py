"""What the passes fusing a product's input preparation into the norm before it share (fp8_norm_quant,
int4_norm_words): finding graphkiln::add_rms_norm calls and their normed output, and putting a norm with more
outputs, and products reading them, in their place."""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch

from graphkiln.models.norm import add_rms_norm

from .add_rms_norm import _value

NORMS = (add_rms_norm, add_rms_norm.default)


def _normed_output(pair: torch.fx.Node) -> torch.fx.Node | None:
    """The getitem node of `pair`'s second output (the norm), where every user of `pair` is a getitem."""
    items = [u for u in pair.users if u.op == "call_function" and u.target is operator.getitem]
    if len(items) != len(pair.users):
        return None
    return next((u for u in items if u.args[1] == 1), None)


def norm_outputs(graph: torch.fx.Graph) -> Iterator[tuple[torch.fx.Node, torch.fx.Node, torch.Tensor]]:
    """(the add_rms_norm call, its normed output's node, that output's example value) of each norm in the graph
    whose normed output something reads."""
    for pair in list(graph.nodes):
        if pair.op != "call_function" or pair.target not in NORMS:
            continue
        normed = _normed_output(pair)
        out = _value(normed) if normed is not None else None
        if out is not None and normed.users:
            yield pair, normed, out


def replace_norm(graph: torch.fx.Graph, pair: torch.fx.Node, normed: torch.fx.Node, target, args: tuple,
                 extras: tuple[torch.Tensor, ...], products: dict[torch.fx.Node, tuple]) -> None:
    """Put target(*args) in place of the add_rms_norm call `pair`: its first two outputs are the pair's, then
    outputs whose example values are `extras`; and each reader of the normed output in `products`, mapped to
    (op, rest), by op(normed, *those outputs, *rest)."""
    with graph.inserting_after(pair):
        fused = graph.call_function(target, args)
    fused.meta["example_value"] = (*pair.meta["example_value"], *extras)
    with graph.inserting_after(fused):
        items = [graph.call_function(operator.getitem, (fused, 2 + i)) for i in range(len(extras))]
    for item, value in zip(items, extras):
        item.meta["example_value"] = value
    for user, (op, rest) in products.items():
        with graph.inserting_before(user):
            call = graph.call_function(op, (normed, *items, *rest))
        call.meta = dict(user.meta)
        user.replace_all_uses_with(call)
        graph.erase_node(user)
    pair.replace_all_uses_with(fused)
    graph.erase_node(pair)
