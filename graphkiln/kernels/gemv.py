"""Triton kernels behind models/linear.py.

GEMV: y[1, N] = x[1, K] @ w[N, K]^T, one program per slab of BLOCK_N weight rows over all of K;
gated, x is silu(g) * u of the row [g | u] (2K wide), computed as the weight streams by;
activated, the product's own halves go through the activation: a program takes gate rows j and up
rows I + j (I = N / 2) and stores silu(y[j]) * y[I + j], each sigmoid computed once.
SiLU-and-mul: y[M, I] = silu(x[:, :I]) * x[:, I:], for the gated product's other row counts. All launch with
programmatic dependent launch (kernels/pdl.py), so the product after the activation may start as it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .launch import launch
from .pdl import pdl_on


@triton.jit
def _k_mask(ks, k, K, EVEN_K: tl.constexpr):
    """Which of the K step at k's offsets `ks` are inside K; a constant mask keeps the loads vectorized."""
    return ks < ks.shape[0] if EVEN_K else (k + ks) < K


@triton.jit
def paired_rows(pid, N, BLOCK_N: tl.constexpr):
    """The weight rows of program `pid`'s slab when it applies the activation: BLOCK_N / 2 pairs of a gate row j
    and its up row N / 2 + j, each pair adjacent; and which of them exist."""
    r = tl.arange(0, BLOCK_N)
    j = pid * (BLOCK_N // 2) + r // 2
    return j + (r % 2) * (N // 2), j < N // 2


@triton.jit
def store_activated(y, y_ptr, pid, N, BLOCK_N: tl.constexpr):
    """Store silu(gate) * up of each pair of the slab's products y [BLOCK_N] (float32, rows as paired_rows gives
    them): both rounded to y_ptr's dtype first, as the product's output is, and the activation computed as the
    SiLU-and-mul kernel computes it."""
    dtype = y_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), (BLOCK_N // 2, 2)))
    j = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + j, (gate * tl.sigmoid(gate) * up).to(dtype), mask=j < N // 2)


@triton.jit
def _gemv_step(acc, w, k, ks, k_mask, x_ptr, K, GATED: tl.constexpr):
    """acc + w * x over the K step at k (x gated if the kernel's mode says so)."""
    x = tl.load(x_ptr + k + ks, mask=k_mask, other=0.0)
    if GATED:  # rounded to x's dtype, as the product feeding cuBLAS at more rows is
        up = tl.load(x_ptr + K + k + ks, mask=k_mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * tl.sigmoid(x.to(tl.float32)) * up).to(x_ptr.dtype.element_ty)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, GATED: tl.constexpr, ACTIVATED: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    if ACTIVATED:
        cols, col_mask = paired_rows(pid, N, BLOCK_N)
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_mask = _k_mask(ks, 0, K, EVEN_K)
    w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # no earlier kernel's output
    if PDL:  # x is: wait for the previous kernel to finish and its writes to land
        gdc_wait()
    acc = _gemv_step(acc, w, 0, ks, k_mask, x_ptr, K, GATED)
    for k in range(BLOCK_K, K, BLOCK_K):
        k_mask = _k_mask(ks, k, K, EVEN_K)
        w = tl.load(w_ptrs + k, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _gemv_step(acc, w, k, ks, k_mask, x_ptr, K, GATED)
    if ACTIVATED:
        store_activated(tl.sum(acc, axis=1), y_ptr, pid, N, BLOCK_N)
    else:
        tl.store(y_ptr + cols, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=col_mask)


def tiling(n: int, k: int, activated: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for N outputs and K inputs: the fastest of those tried inside
    the decode graphs of the benchmark models, where each GEMV starts cold after a small kernel (so
    long K steps win over the tilings that win back to back). `activated`: an 8B-like gate_up takes 16-row
    slabs of 256-wide steps, where its gate/up row pairs stream as fast as plain rows (README, Passes)."""
    if activated and 16384 < n <= 32768:
        tiles = 16, 256, 4, 4
    elif n <= 8192:  # q/k/v, o, down: a few rows a program
        if k <= 2048:  # 1B-like q/k/v and o: all of K in one step
            tiles = 2, 2048, 4, 2
        elif k < 8192:  # 8B-like q/k/v and o
            tiles = 8, 512, 4, 3
        else:  # down
            tiles = 8, 2048, 8, 2
    elif n <= 32768:  # gate_up: short K steps, deep pipeline
        tiles = 32, 128, 4, 8
    else:  # LM heads
        tiles = 16, 256, 4, 5
    block_n, block_k, warps, stages = tiles
    return block_n, min(block_k, triton.next_power_of_2(k)), warps, stages


def gemv(
    x: torch.Tensor, weight: torch.Tensor, gated: bool = False, tiles: tuple[int, int, int, int] | None = None,
    activated: bool = False,
) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T, or with `gated` silu(x[:, :K]) * x[:, K:] @ weight^T for x [1, 2K];
    `activated` (N even): silu(y[:, :N/2]) * y[:, N/2:] of that product y, [1, N/2]. Unit stride along K.
    `tiles` defaults to `tiling(N, K, activated)`; a benchmark may pass others."""
    n, k = weight.shape
    block_n, block_k, warps, stages = tiles or tiling(n, k, activated)
    width = n // 2 if activated else n
    y = torch.empty(1, width, dtype=x.dtype, device=x.device)
    launch_pdl = pdl_on(x.device)
    launch(
        _gemv_kernel, (triton.cdiv(width, block_n // 2 if activated else block_n),),
        x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        GATED=gated, ACTIVATED=activated, PDL=launch_pdl, num_warps=warps, num_stages=stages, launch_pdl=launch_pdl,
    )
    return y


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, I, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the next kernel (the down projection) may start once every program has begun
        gdc_launch_dependents()
        gdc_wait()  # x is the product before
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [M, 2I] with unit stride along its last dim: one launch."""
    rows, width = x.shape
    half = width // 2
    y = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    block = 1024
    if rows:
        launch_pdl = pdl_on(x.device)
        launch(_silu_mul_kernel, (rows, triton.cdiv(half, block)), x, y, half, x.stride(0), y.stride(0), BLOCK=block,
               PDL=launch_pdl, launch_pdl=launch_pdl)
    return y
