"""fp8_mlp: an fp8 MLP's down projection and the activated gate/up product feeding it become one graphkiln::fp8_mlp.

A Dynamo-graph pass, after silu_mul_epilogue. It matches `fp8_linear(h, w, s, None)` (a dynamic activation
scale) where h is a `graphkiln::fp8_linear_silu_mul` call used by nothing else, and calls graphkiln::fp8_mlp on
both products' arguments. Where the down product quantizes its input in a kernel of its own (more than FEW_ROWS
rows: decode batches past 16, prefill), that kernel then applies the SiLU-and-mul as it loads the gate/up
product: the activation is never written in the model's dtype and read back, one launch fewer a layer. At fewer
rows the op is the two products as before.
"""

from __future__ import annotations

import torch

from graphkiln.models.quantized_linear import fp8_linear, fp8_linear_silu_mul, fp8_mlp

from .base import GraphPass
from .silu_mul_linear import call_arguments, rewrite

PRODUCTS = (fp8_linear, fp8_linear.default)
ACTIVATED = (fp8_linear_silu_mul, fp8_linear_silu_mul.default)


def _mlp_call(node: torch.fx.Node) -> tuple | None:
    """(fp8_mlp, args) taking `node`, when it is a dynamically scaled fp8_linear of an activated product used by
    nothing else."""
    if node.op != "call_function" or node.target not in PRODUCTS:
        return None
    h, weight, weight_scale, input_scale = call_arguments(node)
    if (input_scale is not None or not isinstance(h, torch.fx.Node) or h.op != "call_function"
            or h.target not in ACTIVATED or len(h.users) != 1):
        return None
    return fp8_mlp.default, (*call_arguments(h), weight, weight_scale)


class Fp8Mlp(GraphPass):
    name = "fp8_mlp"

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        return rewrite(gm, _mlp_call)
