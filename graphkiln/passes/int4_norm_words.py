"""int4_norm_words: a residual add and RMSNorm feeding only int4 products write the words those products read.

A Dynamo-graph pass after add_rms_norm, on where that runs (CUDA compiles; on the CPU name both:
`CompileConfig(enabled_passes=("add_rms_norm", "int4_norm_words"))`). It matches graphkiln::add_rms_norm whose
normed output feeds nothing but graphkiln::int4_linear calls of one group size (a layer's q/k/v and gate/up
products), and calls graphkiln::add_rms_norm_int4, which at one row also writes that output as the dp4a GEMV's
x words, and int4_linear_words on them (models/int4_fused.py): a decode step at batch 1 then launches no words
kernel before those products; the numbers are the same.
"""

from __future__ import annotations

import torch

from graphkiln.models.int4_fused import add_rms_norm_int4, empty_words, int4_linear_words
from graphkiln.models.quantized_linear import int4_linear

from .base import GraphPass
from .norm_fusion import norm_outputs, replace_norm
from .silu_mul_linear import call_arguments

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
        matches = 0
        for pair, normed, out in norm_outputs(gm.graph):
            groups = {_group_size(user, normed) for user in normed.users}
            group_size = groups.pop() if len(groups) == 1 else None
            width = out.shape[-1]
            if group_size is None or width % group_size or width % 8:
                continue
            extras = empty_words(out, group_size)
            products = {user: (int4_linear_words.default, call_arguments(user)[1:]) for user in normed.users}
            replace_norm(gm.graph, pair, normed, add_rms_norm_int4.default, (*call_arguments(pair), group_size),
                         extras, products)
            matches += 1
        gm.recompile()
        return matches
