"""Few-row half-precision weight products: y [M, N] = x [M, K] @ weight [N, K]^T for a decode batch's rows.

At a few to a few dozen rows a product is still about one pass over the weight. cuBLAS covers the narrow
projections of a decoder (q/k/v, o, down) with few output tiles, leaving multiprocessors idle, and adds a
split-K reduction launch where it splits. Here, as in fp8_mma.py, the product is computed transposed: BLOCK_N
weight rows on the tall side of the tensor-core tile, the rows of x (padded to 16) on the narrow one, K split
across programs (split_k.py) until every multiprocessor streams. Each program loads its first weight tile before
it waits for the kernel ahead (programmatic dependent launch, as the GEMV does), since only x is that kernel's
output. Only kernels are launched, so the product can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .launch import launch
from .pdl import pdl_on
from .split_k import finish, k_steps, multiprocessors, output, split_count


@triton.jit(do_not_specialize=["M", "STEPS", "stride_os"])  # one build for every row count and split
def _rows_mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, STEPS, stride_xm, stride_wn, stride_os, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[split, M, N] for one BLOCK_N slab of weight rows and one BLOCK_M tile of x rows over a split of K
    (STEPS steps of BLOCK_K)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    k = split * STEPS * BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    k_mask = (k + ks) < K
    w = tl.load(w_ptrs + k, mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # no earlier kernel's output
    if PDL:  # x is: wait for the previous kernel to finish and its writes to land
        gdc_wait()
    x = tl.load(x_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    acc = tl.dot(w, tl.trans(x), out_dtype=tl.float32)
    for step in range(1, STEPS):
        k += BLOCK_K
        k_mask = (k + ks) < K
        w = tl.load(w_ptrs + k, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs + k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    out_ptrs = out_ptr + split * stride_os + rows[None, :].to(tl.int64) * stride_om + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_mask[:, None] & row_mask[None, :])


def rows_tiling(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages): all rows in one tile (16 at least, the narrow side
    of a tensor-core tile), 64-row weight slabs in 128-wide K steps pipelined 4 deep, K split until every
    multiprocessor streams (split_k.split_count)."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k, warps, stages = 64, 128, 4, 4
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    splits = split_count(programs, k, block_k, 4 * m * n, 2 * n * k, sms)
    return block_m, block_n, block_k, splits, warps, stages


def rows_mm(x: torch.Tensor, weight: torch.Tensor,
            tiles: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype (bfloat16 or float16, unit stride along K); `tiles` defaults to
    `rows_tiling`, a benchmark may pass others."""
    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, block_k, splits, warps, stages = tiles or rows_tiling(m, n, k, multiprocessors(x.device))
    splits, steps = k_steps(k, splits, block_k)
    out = output(m, n, splits, x.dtype, x.device)
    launch_pdl = pdl_on(x.device)
    launch(
        _rows_mm_kernel, (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits),
        x, weight, out, m, n, k, steps, x.stride(0), weight.stride(0), m * n, n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=launch_pdl,
        num_warps=warps, num_stages=stages, launch_pdl=launch_pdl,
    )
    return finish(out, x.dtype)
