"""int4_norm_words: a residual add and RMSNorm feeding only int4 products write the words those products read.

A Dynamo-graph pass after add_rms_norm, on where that runs (CUDA compiles; on the CPU name both:
`CompileConfig(enabled_passes=("add_rms_norm", "int4_norm_words"))`). It matches graphkiln::add_rms_norm whose
normed output feeds nothing but graphkiln::int4_linear calls of one group size (a layer's q/k/v and gate/up
products), and calls graphkiln::add_rms_norm_int4, which at one row also writes that output as the dp4a GEMV's
x words, and int4_linear_words on them (models/int4_fused.py): a decode step at batch 1 then launches no words
kernel before those products; the numbers are the same.
"""

from __future__ import annotations

import operator

import torch

from graphkiln.models.int4_fused import add_rms_norm_int4, int4_linear_words
from graphkiln.models.norm import add_rms_norm
from graphkiln.models.quantized_linear import int4_linear

from .add_rms_norm import _value
from .base import GraphPass
from .fp8_norm_quant import _normed_output
from .silu_mul_linear import call_arguments

NORMS = (add_rms_norm, add_rms_norm.default)
PRODUCTS = (int4_linear, int4_linear.default)


def _group_size(user: torch.fx.Node, normed: torch.fx.Node) -> int | None:
    """The group size of `user`, when it is an int4 product of `normed`."""
    if user.op != "call_function" or user.target not in PRODUCTS:
        return None
    x, *_, group_size, _, _ = call_arguments(user)
    return group_size if x is normed and isinstance(group_size, int) else None


class Int4NormWords(GraphPass):
    name = "int4_norm_words"
    default_devices = ("cuda",)  # after add_rms_norm, which runs in CUDA compiles

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph, matches = gm.graph, 0
        for pair in list(graph.nodes):
            if pair.op != "call_function" or pair.target not in NORMS:
                continue
            normed = _normed_output(pair)
            out = _value(normed) if normed is not None else None
            if out is None or not normed.users:
                continue
            groups = {_group_size(user, normed) for user in normed.users}
            group_size = groups.pop() if len(groups) == 1 else None
            if group_size is None or out.shape[-1] % group_size or out.shape[-1] % 8:
                continue
            with graph.inserting_after(pair):
                fused = graph.call_function(add_rms_norm_int4.default, (*call_arguments(pair), group_size))
            words = (out.new_empty(4, out.shape[-1] // 8, dtype=torch.int32),
                     *(out.new_empty(out.shape[-1] // group_size, dtype=torch.float32) for _ in range(2)))
            fused.meta["example_value"] = (*pair.meta["example_value"], *words)
            with graph.inserting_after(fused):
                items = [graph.call_function(operator.getitem, (fused, i)) for i in (2, 3, 4)]
            for item, value in zip(items, words):
                item.meta["example_value"] = value
            for user in list(normed.users):
                x, *weights = call_arguments(user)
                with graph.inserting_before(user):
                    call = graph.call_function(int4_linear_words.default, (normed, *items, *weights))
                call.meta = dict(user.meta)
                user.replace_all_uses_with(call)
                graph.erase_node(user)
            pair.replace_all_uses_with(fused)
            graph.erase_node(pair)
            matches += 1
        gm.recompile()
        return matches
