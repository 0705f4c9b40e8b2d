"""fp8_norm_quant: a residual add and RMSNorm feeding only fp8 products quantize the norm's output themselves.

A Dynamo-graph pass after add_rms_norm, on where that runs (CUDA compiles; on the CPU name both:
`CompileConfig(enabled_passes=("add_rms_norm", "fp8_norm_quant"))`). It matches graphkiln::add_rms_norm whose
normed output feeds nothing but graphkiln::fp8_linear(out, weight, weight_scale, None) and graphkiln::fp8_mlp(out,
gate_up_weight, gate_up_scale, None, ...) with one weight scale per output channel (a layer's q/k/v and gate/up
products), and calls graphkiln::add_rms_norm_fp8, which also writes that output quantized per token, and
fp8_linear_quantized / fp8_mlp_quantized on it (models/norm_fp8.py). Past one row a product then reads the fp8
rows the norm wrote instead of launching its own quantization; the numbers are the same.
"""

from __future__ import annotations

import torch

from graphkiln.models.norm_fp8 import add_rms_norm_fp8, fp8_linear_quantized, fp8_mlp_quantized
from graphkiln.models.quantized_linear import FP8, fp8_linear, fp8_mlp

from .add_rms_norm import _value
from .base import GraphPass
from .norm_fusion import norm_outputs, replace_norm
from .silu_mul_linear import call_arguments

PRODUCTS = {fp8_linear: fp8_linear_quantized.default, fp8_linear.default: fp8_linear_quantized.default,
            fp8_mlp: fp8_mlp_quantized.default, fp8_mlp.default: fp8_mlp_quantized.default}


def _weights(user: torch.fx.Node, normed: torch.fx.Node) -> tuple | None:
    """The arguments after x of the quantized op replacing `user` (the weights and their scales), when `user` is an
    fp8 product of `normed` that quantizes it per token: a dynamic activation scale, per-channel weight scales."""
    if user.op != "call_function" or user.target not in PRODUCTS:
        return None
    x, weight, weight_scale, input_scale, *rest = call_arguments(user)
    value = _value(weight_scale)
    if x is not normed or input_scale is not None or value is None or value.dim() != 1:
        return None
    return (weight, weight_scale, *rest)


class Fp8NormQuant(GraphPass):
    name = "fp8_norm_quant"
    default_devices = ("cuda",)  # after add_rms_norm, which runs in CUDA compiles

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        matches = 0
        for pair, normed, out in norm_outputs(gm.graph):
            weights = {user: _weights(user, normed) for user in normed.users}
            if any(w is None for w in weights.values()):
                continue
            extras = (out.new_empty(out.shape, dtype=FP8), out.new_empty(out.shape[0], 1, dtype=torch.float32))
            products = {user: (PRODUCTS[user.target], rest) for user, rest in weights.items()}
            replace_norm(gm.graph, pair, normed, add_rms_norm_fp8.default, call_arguments(pair), extras, products)
            matches += 1
        gm.recompile()
        return matches
