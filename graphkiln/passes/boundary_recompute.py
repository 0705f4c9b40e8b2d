"""boundary_recompute: recompute cheap values from graph inputs in each piece instead of carrying them.

A value computed only from graph inputs (parameters, buffers, input_ids, positions) by a short
chain of cheap ops (indexing, dtype casts, views) and read by later pieces is recomputed at
its first use in each of those pieces. In our models that is the rope gather
`rope_cache[positions]`: computed in piece 0, it used to cross every cut of the split; now
every layer's piece gathers its own rows (Inductor fuses the gather into the rope kernel as an
indirect load), and each cut carries one tensor fewer. An input that any op mutates is never
read twice this way.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .attention_split import assign_pieces
from .base import GraphPass

CHEAP_METHODS = frozenset({"to", "float", "view", "reshape", "unsqueeze"})


@dataclass(frozen=True)
class BoundaryRecomputeConfig:
    """`max_nodes`: the longest chain of ops recomputed for one value."""

    max_nodes: int = 2


def _mutated(placeholder: torch.fx.Node) -> bool:
    for user in placeholder.users:
        schema = getattr(user.target, "_schema", None)
        if (user.op == "call_method" and user.target.endswith("_")) or (schema is not None and schema.is_mutable):
            return True
    return False


def _cheap(node: torch.fx.Node) -> bool:
    if not isinstance(node.meta.get("example_value"), torch.Tensor):
        return False
    return (node.op == "call_method" and node.target in CHEAP_METHODS) or (
        node.op == "call_function" and node.target is operator.getitem
    )


class BoundaryRecompute(GraphPass):
    name = "boundary_recompute"

    def __init__(self, config: BoundaryRecomputeConfig = BoundaryRecomputeConfig()) -> None:
        self.config = config

    def _chain(self, node: torch.fx.Node) -> list[torch.fx.Node] | None:
        """The nodes (in graph order) that recompute `node` from unmutated graph inputs, or None."""
        chain: list[torch.fx.Node] = []

        def visit(n: torch.fx.Node) -> bool:
            if n.op == "placeholder":
                return not _mutated(n)
            if n in chain:
                return True
            if not _cheap(n) or not all(visit(a) for a in n.all_input_nodes):
                return False
            chain.append(n)
            return len(chain) <= self.config.max_nodes

        return chain if _cheap(node) and visit(node) else None

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph, matches = gm.graph, 0
        pieces = assign_pieces(graph)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in order:
            later = {}
            for user in node.users:
                if pieces[user] > pieces[node] and pieces[user] % 2 == 0:
                    later.setdefault(pieces[user], []).append(user)
            chain = self._chain(node) if later else None
            if chain is None:
                continue
            for users in later.values():
                first = min(users, key=order.__getitem__)
                env: dict[torch.fx.Node, torch.fx.Node] = {}
                with graph.inserting_before(first):
                    for n in chain:
                        env[n] = graph.node_copy(n, lambda a: env.get(a, a))
                        pieces[env[n]] = pieces[first]
                for user in users:
                    user.replace_input_with(node, env[node])
                matches += 1
            for n in reversed(chain):
                if not n.users:
                    graph.erase_node(n)
        return matches
