"""Triton kernels behind models/linear.py.

GEMV: y[1, N] = x[1, K] @ w[N, K]^T, one program per slab of BLOCK_N weight rows over all of K;
gated, x is silu(g) * u of the row [g | u] (2K wide), computed as the weight streams by; normed,
x is rmsnorm(h) * g of the residual sum h = x + r, which program 0 also stores (every program
walks all of K, so each sums h^2 as it goes and scales its dot products by rsqrt at the end).
SiLU-and-mul: y[M, I] = silu(x[:, :I]) * x[:, I:], for the gated product's other row counts.
Add-and-RMSNorm: h = x + r and rmsnorm(h) * g per row, for the normed product's other row counts.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _gemv_step(acc, squares, w, k, ks, x_ptr, r_ptr, g_ptr, h_ptr, K, pid, EVEN_K: tl.constexpr,
               GATED: tl.constexpr, NORMED: tl.constexpr):
    """acc += w * x over the K step at k (x gated or normed as the kernel's mode says)."""
    k_mask = ks < ks.shape[0] if EVEN_K else (k + ks) < K  # a constant mask keeps the loads vectorized
    x = tl.load(x_ptr + k + ks, mask=k_mask, other=0.0)
    if GATED:  # rounded to x's dtype, as the product feeding cuBLAS at more rows is
        up = tl.load(x_ptr + K + k + ks, mask=k_mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * tl.sigmoid(x.to(tl.float32)) * up).to(x_ptr.dtype.element_ty)
    if NORMED:  # the residual sum rounds to x's dtype, as the unfused add does
        h = (x.to(tl.float32) + tl.load(r_ptr + k + ks, mask=k_mask, other=0.0).to(tl.float32))
        h = h.to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + k + ks, h, mask=k_mask & (pid == 0))
        squares += h.to(tl.float32) * h.to(tl.float32)
        x = h.to(tl.float32) * tl.load(g_ptr + k + ks, mask=k_mask, other=0.0).to(tl.float32)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :], squares


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, r_ptr, g_ptr, h_ptr, eps, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, NORMED: tl.constexpr,
                 PDL: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_mask = cols < N
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    w_mask = col_mask[:, None] & (ks < BLOCK_K if EVEN_K else ks < K)[None, :]
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)  # the weights are no earlier kernel's output
    if PDL:  # x is: wait for the previous kernel to finish and its writes to land
        gdc_wait()
    acc, squares = _gemv_step(acc, squares, w, 0, ks, x_ptr, r_ptr, g_ptr, h_ptr, K, pid, EVEN_K, GATED, NORMED)
    for k in range(BLOCK_K, K, BLOCK_K):
        w_mask = col_mask[:, None] & (ks < BLOCK_K if EVEN_K else (k + ks) < K)[None, :]
        w = tl.load(w_ptrs + k, mask=w_mask, other=0.0)
        acc, squares = _gemv_step(acc, squares, w, k, ks, x_ptr, r_ptr, g_ptr, h_ptr, K, pid, EVEN_K, GATED,
                                  NORMED)
    y = tl.sum(acc, axis=1)
    if NORMED:
        y = y * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_mask)


@functools.cache
def pdl(device_index: int) -> bool:
    """Programmatic dependent launch for the GEMV: on sm90 and later unless GRAPHKILN_PDL=0. A GEMV then
    starts while the kernel before it drains (its first weight step loads before it waits for x), and
    lets the kernel after it do the same, including inside CUDA graphs."""
    return os.environ.get("GRAPHKILN_PDL", "1") != "0" and torch.cuda.get_device_capability(device_index)[0] >= 9


def tiling(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for N outputs and K inputs: the fastest that
    `bench/skinny_gemm.py --sweep` measured on an H200 for the bench models' projections."""
    if n <= 8192:  # q/k/v, o, down: thin slabs, long K steps; 8 warps for the long K of down
        return 8, 512, 8 if k >= 8192 else 4, 3
    if n <= 16384:  # 1B-like gate_up
        return 32, 256, 4, 5
    return 16, 256, 4, 5  # 8B-like gate_up, LM heads


def gemv(
    x: torch.Tensor, weight: torch.Tensor, gated: bool = False, tiles: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T, or with `gated` silu(x[:, :K]) * x[:, K:] @ weight^T for x [1, 2K];
    unit stride along K. `tiles` defaults to `tiling(N, K)` (bench/skinny_gemm.py --sweep tries others)."""
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch_gemv(x, weight, y, tiles, gated=gated)
    return y


def add_rmsnorm_gemv(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual and rmsnorm(h) * norm_weight @ weight^T for one row [1, K]: (y [1, N], h [1, K])."""
    y = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    h = torch.empty_like(x)
    _launch_gemv(x, weight, y, None, residual=residual, norm_weight=norm_weight, h=h, eps=eps)
    return y, h


def _launch_gemv(x, weight, y, tiles, gated=False, residual=None, norm_weight=None, h=None, eps=0.0) -> None:
    n, k = weight.shape
    block_n, block_k, warps, stages = tiles or tiling(n, k)
    normed = residual is not None
    if not normed:  # the norm's pointers are never read: any tensor will do
        residual = norm_weight = h = x
    launch_pdl = x.is_cuda and pdl(x.device.index if x.device.index is not None else torch.cuda.current_device())
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, k, weight.stride(0), residual, norm_weight, h, eps, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, GATED=gated, NORMED=normed, PDL=launch_pdl, num_warps=warps, num_stages=stages,
        launch_pdl=launch_pdl,
    )


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, I, stride_x, stride_y, BLOCK: tl.constexpr):
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
        _silu_mul_kernel[(rows, triton.cdiv(half, block))](x, y, half, x.stride(0), y.stride(0), BLOCK=block)
    return y


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, g_ptr, h_ptr, out_ptr, K, stride_x, stride_r, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(h_ptr + row * K + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    normed = (h32 * tl.rsqrt(tl.sum(h32 * h32, axis=0) / K + eps)).to(x.dtype)
    g = tl.load(g_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * K + cols, (g.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual and norm_weight * rmsnorm(h) for x, residual [M, K] (unit stride along K), rounded as
    models/transformer.py's RMSNorm rounds: (normed [M, K], h [M, K]), one launch."""
    rows, k = x.shape
    h = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(h)
    block = triton.next_power_of_2(k)
    if rows:
        _add_rmsnorm_kernel[(rows,)](x, residual, norm_weight, h, normed, k, x.stride(0), residual.stride(0), eps,
                                     BLOCK=block, num_warps=min(16, max(4, block // 1024)))
    return normed, h
