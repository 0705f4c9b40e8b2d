"""The residual add and the RMSNorm after it, one program per row holding the row in registers.

sum = x + residual (rounded to x's dtype, as the model's add is); out = weight * (sum32 * rsqrt(mean(sum32²) +
eps)) rounded to the dtype before the weight multiplies it and once after, as models/transformer.py's RMSNorm
computes it. Inductor's fused kernel for the same graph loops over a row twice above 1024 inputs (it keeps a
row in registers only up to that width), and launches without programmatic dependent launch; here a program
loads its row once, and with PDL (kernels/pdl.py) loads the norm's weight while the kernel before it drains.
With `quantize`, the program also writes its output row in float8_e4m3fn with one scale, as
fp8_linear.quantize_rows would from that output (its quantize_group, so the same bits): the fp8 product after
the norm then needs no quantization launch of its own (passes/fp8_norm_quant.py). With `words_group`, a one-row
program also writes its output as the int4 dp4a GEMV's x words (int4_dp4a.store_words, the same bits as x_words
of that output): the int4 products after the norm then launch no x_words kernel (passes/int4_norm_words.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .fp8_linear import quantize_group
from .int4_dp4a import MIN_GROUP, store_words, words_buffers
from .launch import launch
from .pdl import pdl_on

MAX_WIDTH = 16384  # widest row a program holds; wider rows go to the torch reference


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, q_ptr, qs_ptr, xw_ptr, xs_ptr, xf_ptr, H, stride_x,
                         stride_r, stride_s, stride_o, stride_q, eps, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr,
                         WORDS_GROUP: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # no earlier kernel writes it
    if PDL:  # x and the residual are: wait for the previous kernel to finish and its writes to land
        gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = sum_ptr.dtype.element_ty
    total = (x + r).to(dtype)
    tl.store(sum_ptr + row * stride_s + cols, total, mask=mask)
    s = total.to(tl.float32)
    normed = (s * tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)).to(dtype).to(tl.float32)
    out = (weight * normed).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)
    if QUANTIZE:  # quantize_rows' per-token rounding of `out` (its padded lanes are zeros)
        q, scale = quantize_group(out.to(tl.float32), False)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(qs_ptr + row, scale)
    if WORDS_GROUP:  # x_words of `out` (one row; its padded lanes are zeros, their groups not stored)
        store_words(out.to(tl.float32), xw_ptr, xs_ptr, xf_ptr, 0, H // WORDS_GROUP, H // 8, WORDS_GROUP,
                    BLOCK // WORDS_GROUP)


def warps(width: int) -> int:
    """Warps of a program for a row of `width` inputs: 16-byte loads, a few per thread."""
    return min(max(triton.next_power_of_2(width) // 512, 1), 16)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 quantize: bool = False, words_group: int = 0) -> tuple[torch.Tensor, ...]:
    """(x + residual, RMSNorm of it) for x, residual [M, H] and weight [H] of one dtype, unit stride along H,
    H at most MAX_WIDTH: one launch of M programs. `quantize`: also (q, scale), the norm's output in
    float8_e4m3fn [M, H] with a float32 scale a row [M, 1], equal to fp8_linear.quantize_rows of it.
    `words_group` (one row, a group size dividing H): also int4_dp4a.x_words of the output in groups of that size."""
    rows, width = x.shape
    if words_group and (rows != 1 or width % words_group or words_group < MIN_GROUP or words_group & (words_group - 1)):
        raise ValueError(f"x words of a norm's output take one row and groups of a power of two from {MIN_GROUP} "
                         f"dividing its width; got {rows} rows of {width} and groups of {words_group}")
    total = torch.empty_like(x)
    out = torch.empty_like(x)
    q = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=x.device) if quantize else out
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if quantize else out
    words = words_buffers(width, words_group, x.device) if words_group else (out, out, out)
    if rows:
        launch_pdl = pdl_on(x.device)
        launch(_add_rms_norm_kernel, (rows,), x, residual, weight, total, out, q, scale, *words, width, x.stride(0),
               residual.stride(0), total.stride(0), out.stride(0), q.stride(0), eps,
               BLOCK=triton.next_power_of_2(width), QUANTIZE=quantize, WORDS_GROUP=words_group, PDL=launch_pdl,
               num_warps=warps(width), launch_pdl=launch_pdl)
    return (total, out) + ((q, scale) if quantize else ()) + (words if words_group else ())
