"""The residual add and RMSNorm that also quantize their output for the fp8 products after them, and those products.

`graphkiln::add_rms_norm_fp8(x, residual, weight, eps) -> (sum, out, q, scale)`: add_rms_norm's two outputs and
out quantized to float8_e4m3fn per token (q [M, H], scale float32 [M, 1]), as the fp8 products quantize their
input (kernels/fp8_linear.quantize_rows; on CUDA in the norm's own launch, from two rows: a product multiplies one
row unquantized, so at one row the kernel leaves q and scale unwritten). `fp8_linear_quantized(x, q, scale,
...)` and `fp8_mlp_quantized(x, q, scale, ...)` are fp8_linear and fp8_mlp with a dynamic activation scale, given
x and that quantization of it: where the product would quantize x per token (more than one row, per-channel
weights) it multiplies q instead, which saves that launch; elsewhere it uses x. So each computes what the op it
replaces computes, bit for bit. passes/fp8_norm_quant.py puts them in the graph, where enabled.
"""

from __future__ import annotations

import torch

from .norm import _add_rms_norm, _takes_kernel
from .ops import define
from .quantized_linear import FP8, FP8_MAX, MIN_SCALE, _fp8_linear, _fp8_mlp


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x [M, H] in float8_e4m3fn with a float32 scale a row, scale = max(amax / 448, MIN_SCALE) and
    q = x / scale clamped to fp8's range, as quantize_rows computes them."""
    x32 = x.float()
    scale = (x32.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _takes_kernel(x, residual, weight):  # triton is optional: the kernel is imported only where it runs
        from graphkiln.kernels.rms_norm import add_rms_norm

        if x.shape[0] == 1:  # every product multiplies one row unquantized: no reader for q, so it is not written
            return (*add_rms_norm(x, residual, weight, eps), *_add_rms_norm_fp8_shape(x, residual, weight, eps)[2:])
        return add_rms_norm(x, residual, weight, eps, quantize=True)
    total, out = _add_rms_norm(x, residual, weight, eps)
    if out.is_cuda:  # the kernel the products would have launched
        from graphkiln.kernels.fp8_linear import quantize_rows

        return (total, out, *quantize_rows(out))
    return (total, out, *quantize_per_token(out))


def _add_rms_norm_fp8_shape(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    return (x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape, dtype=FP8),
            x.new_empty(rows, 1, dtype=torch.float32))


add_rms_norm_fp8 = define(
    "add_rms_norm_fp8(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor, Tensor, Tensor)",
    _add_rms_norm_fp8, _add_rms_norm_fp8_shape,
)


def _fp8_linear_quantized(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                          weight_scale: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from graphkiln.kernels.fp8_linear import fp8_linear as kernel

        return kernel(x, weight, weight_scale, quantized=(q, scale))
    return _fp8_linear(x, weight, weight_scale, None)


def _fp8_linear_quantized_shape(x, q, scale, weight, weight_scale) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


fp8_linear_quantized = define(
    "fp8_linear_quantized(Tensor x, Tensor q, Tensor scale, Tensor weight, Tensor weight_scale) -> Tensor",
    _fp8_linear_quantized, _fp8_linear_quantized_shape,
)


def _fp8_mlp_quantized(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, gate_up_weight: torch.Tensor,
                       gate_up_scale: torch.Tensor, down_weight: torch.Tensor, down_scale: torch.Tensor
                       ) -> torch.Tensor:
    if x.is_cuda:
        from graphkiln.kernels.fp8_linear import fp8_mlp as kernel

        return kernel(x, gate_up_weight, gate_up_scale, None, down_weight, down_scale, quantized=(q, scale))
    return _fp8_mlp(x, gate_up_weight, gate_up_scale, None, down_weight, down_scale)


def _fp8_mlp_quantized_shape(x, q, scale, gate_up_weight, gate_up_scale, down_weight, down_scale) -> torch.Tensor:
    return x.new_empty(x.shape[0], down_weight.shape[0])


fp8_mlp_quantized = define(
    "fp8_mlp_quantized(Tensor x, Tensor q, Tensor scale, Tensor gate_up_weight, Tensor gate_up_scale, "
    "Tensor down_weight, Tensor down_scale) -> Tensor",
    _fp8_mlp_quantized, _fp8_mlp_quantized_shape,
)
