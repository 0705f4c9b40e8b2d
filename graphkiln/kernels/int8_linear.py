"""int8 weight products: y [M, N] = x [M, K] @ (weight [N, K] int8 times its scales)^T.

Scales are per output channel ([N]) or, weight-only, per group of GROUP inputs ([N, ceil(K/GROUP)]:
GPTQ's and compressed-tensors' 8-bit groups). Two schemes share the weight: W8A8, whose activations
are quantized to int8 with a scale per token (or one static scale), and W8A16, whose activations
stay as they are. The bytes a decode step reads are those of fp8, so the few-row paths are fp8's
kernels, which take an int8 weight as well.
One row: the GEMV of fp8_linear.py (each weight converted to float32 in registers; x as it is, which
is finer than any quantization of it). W8A8 from 2 to FEW_ROWS rows: fp8_mma.py with x rounded to int8
per 1 x 128 group in registers into int8 tensor cores; past FEW_ROWS x is quantized first, per token
(or by its static scale) by a kernel of its own, as for fp8 (every program rounding the same rows
costs more than that launch), then fp8_mma on the int8 rows up to MMA_ROWS and torch._int_mm
(cuBLAS) above, a small kernel scaling the int32 product by both scales into x's dtype.
W8A16: fp8_mma with the weight converted to x's dtype up to MMA_ROWS, the weight dequantized to x's
dtype for torch.mm above. Kernels only, no host sync: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphkiln.errors import ConfigError

from .fp8_linear import FEW_ROWS, MMA_ROWS, dequantize, fp8_gemv, quantize_rows
from .fp8_mma import fp8_mma
from .gemv import silu_mul
from .launch import launch

INT8_MAX = 127.0
GROUP = 128  # the inputs a group scale covers: fp8's block side, which its kernels step by


@triton.jit
def _scale_product_kernel(y_ptr, xs_ptr, ws_ptr, out_ptr, M, N, stride_xs, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """out[M, N] = y (int32) * xs[m] * ws[n] in out's dtype."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    y = tl.load(y_ptr + offsets, mask=mask, other=0).to(tl.float32)
    xs = tl.load(xs_ptr + rows * stride_xs, mask=row_mask, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=col_mask, other=0.0)
    tl.store(out_ptr + offsets, (y * xs[:, None] * ws[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ConfigError(f"int8 weight must be a 2-D int8 tensor with unit stride along K; got {weight.dtype} of "
                          f"shape {tuple(weight.shape)} and strides {weight.stride()}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"int8_linear takes x [M, {weight.shape[1]}] in bfloat16 or float16; got {x.dtype} of "
                          f"shape {tuple(x.shape)}")
    n, k = weight.shape
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) not in ((n,), (n, triton.cdiv(k, GROUP))):
        raise ConfigError(f"int8 weight_scale must be float32 [{n}] (one per output channel) or [{n}, "
                          f"{triton.cdiv(k, GROUP)}] (one per group of {GROUP} inputs); got {weight_scale.dtype} "
                          f"{tuple(weight_scale.shape)}")


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x to int8 by a static per-tensor scale, rounded to the nearest integer and clamped to +-127."""
    return torch.floor(x.float() / input_scale + 0.5).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def int_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """What torch._int_mm takes: more than 16 rows, K and N multiples of 8."""
    return x.shape[0] > 16 and x.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0


def quantized_product(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """int8 rows xq [M, K] with float32 scales [M, 1] @ the int8 weight [N, K]^T with its [N] scales, in `dtype`:
    fp8_mma up to MMA_ROWS rows and where cuBLAS's int8 product does not fit (int_mm_fits), that product above."""
    if xq.shape[0] <= MMA_ROWS or not int_mm_fits(xq, weight):
        return fp8_mma(xq, weight, weight_scale, x_scale=x_scale, out_dtype=dtype)
    return scaled_int_mm(xq, x_scale, weight, weight_scale, dtype)


def scaled_int_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """quantized_product in torch._int_mm (where int_mm_fits), its int32 result scaled by both scales in a kernel."""
    m, n = xq.shape[0], weight.shape[0]
    y = torch._int_mm(xq, weight.t())
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    launch(_scale_product_kernel, (triton.cdiv(m, 32), triton.cdiv(n, 128)), y, x_scale, weight_scale, out, m, n,
           x_scale.stride(0), BLOCK_M=32, BLOCK_N=128)
    return out


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None, quantize_input: bool = True,
                activated: bool = False) -> torch.Tensor:
    """x [M, K] (bfloat16/float16) @ dequantized int8 weight [N, K]^T -> [M, N] in x's dtype; `activated` (N even):
    silu(y[:, :N/2]) * y[:, N/2:] of that product y, [M, N/2], in the one-row kernel's epilogue, by the
    SiLU-and-mul kernel at other row counts.

    weight_scale: float32 [N], or [N, ceil(K/GROUP)] without `quantize_input`. `quantize_input` (W8A8): past
    FEW_ROWS x is quantized per token, or by `input_scale` (float32, one element) where given; up to FEW_ROWS
    per 1 x 128 group in registers, and one row not at all. Without it (W8A16) x is never quantized."""
    _check(x, weight, weight_scale)
    if quantize_input and weight_scale.dim() == 2:
        raise ConfigError("int8_linear quantizes x only against per-channel weight scales, not group ones")
    x, weight_scale = x if x.stride(1) == 1 else x.contiguous(), weight_scale.contiguous()
    m, n = x.shape[0], weight.shape[0]
    if m == 0:
        return x.new_empty(0, n // 2 if activated else n)
    if m == 1:
        return fp8_gemv(x, weight, weight_scale, activated=activated, scale_rows=1)
    if m <= (FEW_ROWS if quantize_input else MMA_ROWS):
        y = fp8_mma(x, weight, weight_scale, weight_to_x=not quantize_input, scale_rows=1)
    elif not quantize_input:
        y = torch.mm(x, dequantize(weight, weight_scale, x.dtype, scale_rows=1).t())
    elif input_scale is None:
        y = quantized_product(*quantize_rows(x, dtype=torch.int8), weight, weight_scale, x.dtype)
    else:
        x_scale = input_scale.float().reshape(1, 1).expand(m, 1)
        y = quantized_product(quantize_static(x, input_scale), x_scale, weight, weight_scale, x.dtype)
    return silu_mul(y) if activated else y
