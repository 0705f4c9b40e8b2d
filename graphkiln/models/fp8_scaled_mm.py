"""`graphkiln::fp8_scaled_mm(xq, x_scale, weight, weight_scale, out_dtype)`: the product of activations
already quantized to fp8 per token and an fp8 weight with per-output-channel scales.

The pass `passes/fp8_activation_quant.py` writes the per-token quantization as ATen ops in
Inductor's graph (so it joins the kernel that computes x) and calls this op on the result, in
place of graphkiln::fp8_linear, which quantizes x itself. On CUDA the product is the one fp8_linear
runs on quantized rows (kernels/fp8_linear.py, `quantized_product`); elsewhere (torch._scaled_mm is CUDA-only) a float32 reference on the dequantized operands.
"""

from __future__ import annotations

import torch

from .ops import define
from .quantized_linear import FP8, FP8_MAX, MIN_SCALE, dequantize_fp8


def _fp8_scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """xq [M, K] float8_e4m3fn times x_scale [M, 1] float32, @ (weight [N, K] float8_e4m3fn times
    weight_scale [N] float32)^T -> [M, N] in out_dtype."""
    if xq.is_cuda:  # triton is optional: the kernel module is imported only where it runs
        from graphkiln.kernels.fp8_linear import quantized_product

        return quantized_product(xq.contiguous(), x_scale.contiguous(), weight, weight_scale, out_dtype)
    return torch.mm(xq.float() * x_scale, dequantize_fp8(weight, weight_scale).t()).to(out_dtype)


def _fp8_scaled_mm_shape(xq, x_scale, weight, weight_scale, out_dtype) -> torch.Tensor:
    return xq.new_empty(xq.shape[0], weight.shape[0], dtype=out_dtype)


fp8_scaled_mm = define(
    "fp8_scaled_mm(Tensor xq, Tensor x_scale, Tensor weight, Tensor weight_scale, ScalarType out_dtype) -> Tensor",
    _fp8_scaled_mm, _fp8_scaled_mm_shape,
)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]): each row's largest magnitude maps to 448,
    as fp8_linear's kernel quantizes activations. The pass writes these ops into Inductor's graph."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
