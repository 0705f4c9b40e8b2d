"""int8 weight products: the custom ops, their reference bodies and the layer.

`graphkiln::int8_linear(x, weight, weight_scale, input_scale, quantize_input)`: weight [N, K] int8 with
a float32 scale per output channel ([N]) or, weight-only, per group of 128 inputs ([N, ceil(K/128)]).
With `quantize_input` (W8A8) the activations are quantized to int8, symmetric, with a scale per token
(amax / 127) or the one static scale `input_scale` [1], and rounded to the nearest integer; without
it (W8A16) they stay as they are.
`graphkiln::int8_linear_silu_mul(...)`: silu(gate) * up of int8_linear's [gate | up]
(passes/silu_mul_epilogue.py).

On CUDA the ops call kernels/int8_linear.py, which quantizes W8A8 activations that way past
FEW_ROWS rows, per 1 x 128 group up to it, and not at one row; elsewhere the weight is dequantized
to float32 and the activations quantized per token at every row count.
"""

from __future__ import annotations

import torch

from .linear import silu_mul_reference
from .ops import define
from .quantized_linear import MIN_SCALE, Fp8Linear

INT8_MAX = 127.0
GROUP = 128  # the inputs a group scale covers


def dequantize_int8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight an int8 weight and its per-channel or per-group scales stand for."""
    scale = weight_scale.float()
    if scale.dim() == 1:
        return weight.float() * scale[:, None]
    return weight.float() * scale.repeat_interleave(GROUP, 1)[:, :weight.shape[1]]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scales [N]): symmetric, each row's largest magnitude maps to 127."""
    w = weight.float()
    scale = w.abs().amax(-1).clamp(min=MIN_SCALE) / INT8_MAX
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_activations_int8(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x in float32 after the round trip through int8 the kernels make: one static scale, or one per token."""
    x = x.float()
    if input_scale is not None:
        scale = input_scale.float().reshape(())
    else:
        scale = x.abs().amax(-1, keepdim=True).clamp(min=MIN_SCALE * INT8_MAX) / INT8_MAX
    return torch.floor(x / scale + 0.5).clamp(-INT8_MAX, INT8_MAX) * scale


def _int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                 quantize_input: bool, activated: bool = False) -> torch.Tensor:
    """x [M, K] @ dequantized weight [N, K]^T -> [M, N] in x.dtype (`activated`: silu(gate) * up of it)."""
    if x.is_cuda:  # triton is optional: the kernel is imported only where it runs
        from graphkiln.kernels.int8_linear import int8_linear as kernel

        return kernel(x, weight, weight_scale, input_scale, quantize_input, activated)
    xq = quantize_activations_int8(x, input_scale) if quantize_input else x.float()
    y = torch.mm(xq, dequantize_int8(weight, weight_scale).t()).to(x.dtype)
    return silu_mul_reference(y) if activated else y


def _int8_linear_silu_mul(x, weight, weight_scale, input_scale, quantize_input) -> torch.Tensor:
    return _int8_linear(x, weight, weight_scale, input_scale, quantize_input, activated=True)


def _shape(x, weight, weight_scale, input_scale, quantize_input) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _activated_shape(x, weight, weight_scale, input_scale, quantize_input) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


ARGS = "(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, bool quantize_input) -> Tensor"
int8_linear = define(f"int8_linear{ARGS}", _int8_linear, _shape)
int8_linear_silu_mul = define(f"int8_linear_silu_mul{ARGS}", _int8_linear_silu_mul, _activated_shape)


class Int8Linear(Fp8Linear):
    """int8 weight with a float32 scale per output channel (`weight_scale` [N]) or, with `group_size` (GROUP, weight-
    only), per group of inputs ([N, ceil(K/GROUP)]). `quantize_input` (W8A8): the activations are quantized to int8
    per token as they come, or by a static scale (`static_input`, `input_scale` [1]); otherwise (W8A16) they are
    not. `source`: "compile" (quantized by compile-model, quantize_int8) or the checkpoint format
    (int8_checkpoints.py), "compressed-tensors" or GPTQ's; `packed`: its compressed-tensors weights are
    pack-quantized int32 words."""

    weight_dtype = torch.int8

    def __init__(self, in_features: int, parts: tuple[int, ...], bias: bool, dtype: torch.dtype,
                 static_input: bool = False, quantize_input: bool = True, packed: bool = False,
                 source: str = "compressed-tensors", group_size: int | None = None) -> None:
        self.group_size = group_size
        super().__init__(in_features, parts, bias, dtype, static_input)
        self.quantize_input = quantize_input
        self.packed = packed
        self.source = source

    @property
    def grouped(self) -> bool:
        return self.group_size is not None

    def scale_shape(self) -> tuple[int, ...]:
        return (self.out_features, -(-self.in_features // GROUP)) if self.grouped else (self.out_features,)

    def describe(self) -> str:
        if not self.quantize_input:
            activations = "weight-only"
        else:
            scales = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
            activations = f"{scales} int8 activations"
        scales = f"groups of {self.group_size}" if self.grouped else "per-channel weight scales"
        return f"int8, symmetric, {scales}, {activations}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(torch.ops.graphkiln.int8_linear(x, self.weight, self.weight_scale, self.input_scale,
                                                              self.quantize_input))
