"""rope_attention: a layer's rotary embedding moves into its attention call.

A Dynamo-graph pass, before attention_split, on in CUDA compiles. It matches graphkiln::attention(q, k, v, out,
layer, scale) where q and k are the two parts of `rope(qk, table, positions).split([Hq, Hkv], dim=1)` and nothing
else reads the rotated heads (but `q.new_empty(...)`, which allocates out and reads only q's dtype and device), and
calls graphkiln::rope_attention(qk, v, out, table, positions, layer, scale) (models/rope_attention.py) instead.
The Triton backend's decode kernel then rotates q and the new key as it loads them in batches of up to 8 rows, and
such a decode step loses every layer's rope launch; other attention calls run the rope kernel first, as before.
"""

from __future__ import annotations

import torch

from graphkiln.models.attention import attention
from graphkiln.models.rope import rope
from graphkiln.models.rope_attention import rope_attention

from .base import GraphPass
from .silu_mul_linear import method_part

ATTENTIONS = (attention, attention.default)
ROPES = (rope, rope.default)


def _part(node, index: int) -> torch.fx.Node | None:
    """The split node, when `node` is part `index` of a two-way `t.split(sizes, dim=1)` (a method call)."""
    split = method_part(node, index, "split")
    if split is None:
        return None
    sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return split if isinstance(sizes, (list, tuple)) and len(sizes) == 2 and dim == 1 else None


def _allocates_only(user: torch.fx.Node, q: torch.fx.Node) -> bool:
    """Whether `user` reads q only as `q.new_empty(...)` does (its dtype and device)."""
    return user.op == "call_method" and user.target == "new_empty" and q not in user.args[1:]


def _rotated_source(attn: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the rope call, the nodes to erase after `attn`) when `attn` attends rope's split parts alone."""
    if len(attn.args) != 6 or attn.kwargs:
        return None
    q, k = attn.args[:2]
    split = _part(q, 0)
    if split is None or _part(k, 1) is not split or len(split.users) != 2:
        return None
    source = split.args[0]
    if source.op != "call_function" or source.target not in ROPES or len(source.args) != 3 or len(source.users) != 1:
        return None
    if list(k.users) != [attn] or not all(u is attn or _allocates_only(u, q) for u in q.users):
        return None
    return source, [k, q, split, source]


class RopeAttention(GraphPass):
    name = "rope_attention"
    default_devices = ("cuda",)  # the CPU's attention takes rotated heads: the op would only call rope itself

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph, matches = gm.graph, 0
        for attn in list(graph.nodes):
            if attn.op != "call_function" or attn.target not in ATTENTIONS:
                continue
            found = _rotated_source(attn)
            if found is None:
                continue
            source, erased = found
            qk, table, positions = source.args
            q = attn.args[0]
            v, out, layer, scale = attn.args[2:6]
            for user in list(q.users):
                if user is not attn:
                    user.replace_input_with(q, qk)
            with graph.inserting_before(attn):
                call = graph.call_function(rope_attention.default, (qk, v, out, table, positions, layer, scale))
            call.meta = dict(attn.meta)
            graph.erase_node(attn)
            for node in erased:
                graph.erase_node(node)
            matches += 1
        gm.recompile()
        return matches
