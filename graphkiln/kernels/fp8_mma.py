"""Few-row 8-bit weight products on tensor cores: y [M, N] = x [M, K] @ (weight [N, K] times its scales)^T.

The weight is float8_e4m3fn (scales per output channel or per 128 x 128 block) or int8 (scales per
output channel), and goes into the tensor cores as the 8 bits it is stored in. Converting it to a
wider type in registers, as a GEMV does, costs instructions per weight element, and 8 bits pack
twice the elements of bf16 into each byte: at decode sizes such a kernel is bound by its
instruction issue before the memory system runs out of bytes. Here the activation is converted
instead, and it is M rows against N weight rows: each program scales every BLOCK_K-wide slice of
its rows of x by that slice's absolute maximum (scale = amax / 448 for fp8, amax / 127 for int8,
rounded to the nearest integer) and rounds it to the weight's type in registers. That is a
1 x BLOCK_K group per scale, finer than one scale per token, and it needs no kernel launch of its
own. A weight-only int8 layer (`weight_to_x`) keeps x as it is and converts the weight to x's dtype
instead (exactly: int8 values are bf16 and fp16 values), paying those instructions.

The product is computed transposed, weight rows on the tall side of the tensor-core tile and the
few activation rows (padded to 16) on the narrow one, so one tile streams BLOCK_N weight rows; each
K step's fp32 partial (int32 for int8, exact within a step) is scaled by its activation groups'
scales (and, for 128 x 128 block scales, by the weight block's) before it is added up. K is split
across programs as in split_k.py. BLOCK_K divides 128, so a step sits in one block. Only kernels are
launched, so the product can be captured in a CUDA graph.

Past a few rows quantizing x in every program costs more than it saves: each of the N / BLOCK_N
programs rounds the same rows again. There x comes already quantized (in the weight's type with a
float32 scale per row or per 1 x 128 group, as fp8_linear.quantize_rows makes it, one launch for
all programs) and the kernel only loads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .launch import launch
from .pdl import pdl_on
from .split_k import RESIDENT, k_steps, multiprocessors, product_buffers, split_count, store_product


@triton.jit
def _dot(w, xq, INT8: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] @ xq [BLOCK_M, BLOCK_K]^T in float32: int8 ones summed in int32 (exact) first."""
    if INT8:
        part = tl.dot(w, tl.trans(xq), out_dtype=tl.int32).to(tl.float32)
    else:
        part = tl.dot(w, tl.trans(xq))
    return part


@triton.jit(do_not_specialize=["M", "STEPS"])  # one build for every row count and split
def _mma_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, partials, counters, M, N, K, STEPS, stride_xm, stride_xsm,
                stride_xsg, stride_wn, stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_ROWS: tl.constexpr, INT8: tl.constexpr,
                X_QUANTIZED: tl.constexpr, X_GROUPS: tl.constexpr, WEIGHT_TO_X: tl.constexpr, SPLIT: tl.constexpr,
                PDL: tl.constexpr):
    """y[M, N] (split_k.store_product) for one BLOCK_N slab of weight rows and one BLOCK_M tile of x rows over a
    split of K (STEPS steps of BLOCK_K). BLOCK_SCALES: 2-D weight scales, one per SCALE_ROWS x 128 tile (128 x 128
    blocks, or int8's groups of 128 inputs with SCALE_ROWS 1). INT8: the weight is int8, else fp8. X_QUANTIZED: x is in
    the weight's type already, scaled by xs per row or (X_GROUPS) per 128-wide group. WEIGHT_TO_X: x is
    multiplied as it is, by the weight converted to x's dtype."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    k_start = split * STEPS * BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PDL:  # x is the previous kernel's output
        gdc_wait()
    for step in range(STEPS):
        k = k_start + step * BLOCK_K
        k_mask = (k + ks) < K
        w = tl.load(w_ptrs + k, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if X_QUANTIZED:
            xq = tl.load(x_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            part = _dot(w, xq, INT8)
            if X_GROUPS:
                part = part * tl.load(xs_ptr + rows * stride_xsm + (k // 128) * stride_xsg, mask=row_mask,
                                      other=0.0)[None, :]
        elif WEIGHT_TO_X:
            x = tl.load(x_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            part = tl.dot(w.to(x.dtype), tl.trans(x))
        else:
            x = tl.load(x_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
            if INT8:
                x_scale = amax / 127.0
                xq = tl.floor(x / x_scale[:, None] + 0.5).to(tl.int8)
            else:
                x_scale = amax / 448.0
                xq = (x / x_scale[:, None]).to(tl.float8e4nv)
            part = _dot(w, xq, INT8) * x_scale[None, :]
        if BLOCK_SCALES:
            part = part * tl.load(s_ptr + (cols // SCALE_ROWS) * stride_sn + k // 128, mask=col_mask,
                                  other=0.0)[:, None]
        acc += part
    if not BLOCK_SCALES:
        acc = acc * tl.load(s_ptr + cols, mask=col_mask, other=0.0)[:, None]
    if X_QUANTIZED and not X_GROUPS:
        acc = acc * tl.load(xs_ptr + rows * stride_xsm, mask=row_mask, other=0.0)[None, :]
    store_product(y_ptr, partials, counters, acc, rows[None, :].to(tl.int64) * N + cols[:, None],
                  col_mask[:, None] & row_mask[None, :], M.to(tl.int64) * N, SPLIT)


def mma_tiling(m: int, n: int, k: int, sms: int = 132, x_quantized: bool = False,
               block_scales: bool = False) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages): the rows in one tile up to 64 (16 at least, the
    narrow side of a tensor-core tile), 64-row weight slabs in 128-wide K steps (one fp8 tensor-core tile of
    one warp group), K split until every multiprocessor streams (split_k.split_count).

    On x already quantized (`x_quantized`, more than FEW_ROWS rows) a program does less per byte and holds more in
    flight: K is split only until there is a program per multiprocessor, per-channel weights take 5 stages
    when K is split, and 64-row x tiles take 128-row weight slabs where those alone fill the multiprocessors
    (the fastest of `python -m bench quantized --sweep` at 32 and 64 rows on the 8B-like projections)."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k, warps, stages = 64, 128, 4, 4
    if x_quantized and block_m == 64 and triton.cdiv(n, 128) >= sms:
        block_n = 128
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    splits = split_count(programs, k, block_k, 4 * m * n, n * k, sms, resident=1 if x_quantized else RESIDENT)
    if x_quantized:
        stages = 5 if splits > 1 and not block_scales else 3
    return block_m, block_n, block_k, splits, warps, stages


def fp8_mma(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            tiles: tuple[int, int, int, int, int, int] | None = None, x_scale: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, weight_to_x: bool = False, scale_rows: int = 128) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ dequantized 8-bit weight [N, K]^T in `out_dtype` (default x's dtype).
    weight: float8_e4m3fn with weight_scale float32 [N] or [ceil(N/128), ceil(K/128)], or int8 with [N] or, per
    group of 128 inputs (`scale_rows` 1), [N, ceil(K/128)] (contiguous); `tiles` defaults to `mma_tiling`. x is
    bfloat16/float16 (quantized per 1 x BLOCK_K group in registers, or with `weight_to_x` multiplied as it is by
    the int8 weight converted to its dtype), or in the weight's type with `x_scale` float32 [M, 1] (per row) or
    [M, ceil(K/128)] (per group)."""
    m, k = x.shape
    n = weight.shape[0]
    block_scales = weight_scale.dim() == 2
    block_m, block_n, block_k, splits, warps, stages = tiles or mma_tiling(
        m, n, k, multiprocessors(x.device), x_quantized=x_scale is not None, block_scales=block_scales)
    splits, steps = k_steps(k, splits, block_k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    y, partials, counters = product_buffers(m, n, grid, out_dtype or x.dtype, x.device)
    x_groups = x_scale is not None and x_scale.shape[1] > 1
    xs = x_scale if x_scale is not None else weight_scale  # not read unless x is quantized
    launch_pdl = pdl_on(x.device)
    launch(
        _mma_kernel, grid,
        x, xs, weight, weight_scale, y, partials, counters, m, n, k, steps, x.stride(0), xs.stride(0), xs.stride(-1),
        weight.stride(0), weight_scale.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_SCALES=block_scales, SCALE_ROWS=scale_rows, INT8=weight.dtype == torch.int8,
        X_QUANTIZED=x_scale is not None, X_GROUPS=x_groups, WEIGHT_TO_X=weight_to_x, SPLIT=splits > 1, PDL=launch_pdl,
        num_warps=warps, num_stages=stages, launch_pdl=launch_pdl,
    )
    return y
