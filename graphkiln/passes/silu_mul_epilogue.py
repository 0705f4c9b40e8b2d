"""silu_mul_epilogue: the MLP's `silu(gate) * up` of one fused gate/up product becomes that product's epilogue.

A Dynamo-graph pass, on by default. It matches `silu(a) * b` where a and b are the two halves of one
`chunk(2, dim=-1)` of `linear(x, w)` (no bias), `graphkiln::fp8_linear` or `graphkiln::int8_linear`, the chunk
the product's only user, and calls graphkiln::linear_silu_mul, fp8_linear_silu_mul or int8_linear_silu_mul
on the product's arguments instead. At one row on CUDA their GEMV takes a gate row and its up row in each
program and applies the activation to its own outputs, so the step loses the SiLU-and-mul launch of every
layer without computing a sigmoid more than once per output (computing it in the down projection's GEMV,
as silu_mul_linear does, makes every program compute it over all of K, which the fp8 GEMV measured slower
for); at more rows the ops are the product and one SiLU-and-mul launch, as before. It runs before silu_mul_linear, which takes what
it leaves (a gate/up product with a bias) and, with this pass disabled, every layer's activation.
"""

from __future__ import annotations

import torch

from graphkiln.models.int8_linear import int8_linear, int8_linear_silu_mul
from graphkiln.models.linear import linear_silu_mul
from graphkiln.models.quantized_linear import fp8_linear, fp8_linear_silu_mul

from .base import GraphPass
from .silu_mul_linear import LINEARS, call_arguments, gated_input, rewrite

ACTIVATED = {op: activated.default for product, activated in ((fp8_linear, fp8_linear_silu_mul),
                                                                (int8_linear, int8_linear_silu_mul))
             for op in (product, product.default)}  # a quantized product -> the same with its activation


def _activated_call(product: torch.fx.Node) -> tuple | None:
    """(op, args) computing silu(gate) * up of `product`'s halves, when `product` is a product this pass takes."""
    if product.op != "call_function" or len(product.users) != 1:
        return None
    if product.target in ACTIVATED:
        return ACTIVATED[product.target], call_arguments(product)
    if product.target in LINEARS:
        x, weight, *rest = product.args
        if (rest[0] if rest else product.kwargs.get("bias")) is None:
            return linear_silu_mul.default, (x, weight)
    return None


def _epilogue_call(node: torch.fx.Node) -> tuple | None:
    """(op, args) taking `node`, when it is silu(gate) * up of a product this pass takes."""
    product = gated_input(node)
    return product and _activated_call(product)


class SiluMulEpilogue(GraphPass):
    name = "silu_mul_epilogue"

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        return rewrite(gm, _epilogue_call)
