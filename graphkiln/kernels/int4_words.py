"""int4 products that read the packed weight as 32-bit words: the tensor-core kernel behind int4_linear.py at 2
to 32 rows.

At decode sizes an int4 product is bound by the instructions per weight, not by its bytes: the bytes are
a quarter of bf16's while the work per weight is not. So the kernel keeps that work to three
instructions. qweight [N, K/2] uint8 is read as int32 words (K/8 a row; little-endian, so nibble j of word
i is input k = 8i + j), and each nibble position j is its own tile W_j [BLOCK_N, words], multiplied by
x at k = 8i + j (a strided load of the few activation rows, which the caches hold): no interleaving of
nibbles and no register shuffles. A nibble becomes a float without an int-to-float conversion (a slow
instruction on these GPUs): OR-ed into the mantissa of 2^23 it reads as 2^23 + q * 16^p, and one
multiply-add by 16^-p takes 2^23 * 16^-p away, exactly (nibbles 5 to 7 are shifted down by 20 bits
first, as 2^23's mantissa holds five). A scale and zero point apply per group, not per weight:
sum(w * x) = s * (sum(q * x) - z * sum(x)) over each group.

`int4_dot`: tensor cores, per nibble position a dot of W_j [BLOCK_N, words] (in x's dtype: q is exact in
it) and x_j^T [words, BLOCK_M], the weight on the tall side; groups of at least 128 (a dot needs 16 words).
It splits K as split_k.py does and launches with programmatic dependent launch as pdl.py says. At one row
the byte GEMV of int4_linear.py is the faster (bench/results/HISTORY.md), and a CUDA-core word kernel
was slower than both at every row count: one row is left to the GEMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from graphkiln.errors import ConfigError

from .launch import launch
from .pdl import pdl_on
from .split_k import k_steps, multiprocessors, product_buffers, split_count, store_product

MIN_DOT_GROUP = 128  # a group holds at least 16 words: the shortest K of a dot
MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23: a nibble OR-ed into its mantissa adds q * 16^p
MANTISSA_NIBBLES = tl.constexpr(5)  # nibbles 0..4 lie in the 23-bit mantissa; 5..7 are shifted 20 bits down


def words(qweight: torch.Tensor) -> torch.Tensor | None:
    """qweight [N, K/2] uint8 as int32 words [N, K/8], or None where its rows do not start on 4-byte
    boundaries (then int4_linear.py uses its byte kernels)."""
    if qweight.stride(1) != 1 or qweight.shape[1] % 4 or qweight.stride(0) % 4 or qweight.data_ptr() % 4:
        return None
    return qweight.view(torch.int32)


@triton.jit
def group_params(s_ptr, z_ptr, cols, col_mask, k, K, G, stride_sn, stride_zn, CHUNKS: tl.constexpr,
                 SUB: tl.constexpr):
    """The scales and zero points (float32, [BLOCK_N, CHUNKS]) of the K step at k, one per SUB-wide chunk. The
    kernels load them a step ahead: too narrow for the pipeliner's copies, they would stall every step."""
    chunk_k = k + tl.arange(0, CHUNKS) * SUB
    mask = col_mask[:, None] & (chunk_k < K)[None, :]
    s = tl.load(s_ptr + cols[:, None] * stride_sn + (chunk_k // G)[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + cols[:, None] * stride_zn + (chunk_k // G)[None, :], mask=mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def nibble(w, J: tl.constexpr):
    """q, the J-th nibble (bits 4J..4J+3) of the int32 words w, as exact float32: one AND-OR and one
    multiply-add (plus a shift shared by nibbles 5..7), no int-to-float conversion."""
    P: tl.constexpr = tl.constexpr(J) % MANTISSA_NIBBLES
    if J >= MANTISSA_NIBBLES:
        w = w >> 20  # arithmetic: the sign bits land above the mask
    f = ((w & (15 * 16**P)) | MAGIC).to(tl.float32, bitcast=True)  # 2^23 + q * 16^P
    scale: tl.constexpr = 1.0 / 16**P
    return f * scale - 8388608.0 * scale


@triton.jit(do_not_specialize=["M", "STEPS"])  # one build for every row count and split
def _int4_dot_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, partials, counters, M, N, K, STEPS, G, stride_xm, stride_qn,
                     stride_sn, stride_zn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT: tl.constexpr, PDL: tl.constexpr):
    """y[M, N] (split_k.store_product) tile by tile (BLOCK_N weight rows x BLOCK_M activation rows) over a split of
    K: STEPS steps of BLOCK_K inputs, one group's part each (BLOCK_K divides G), eight tensor-core dots a step."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
    WORDS: tl.constexpr = BLOCK_K // 8
    k_start = split * STEPS * BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    xw = tl.arange(0, WORDS)
    row_mask = rows < M
    col_mask = cols < N
    w_ptrs = q_ptr + cols[:, None].to(tl.int64) * stride_qn + xw[None, :]
    x_ptrs = x_ptr + rows[None, :].to(tl.int64) * stride_xm + 8 * xw[:, None]  # x_j^T: [WORDS, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    s, z = group_params(s_ptr, z_ptr, cols, col_mask, k_start, K, G, stride_sn, stride_zn, 1, BLOCK_K)
    if PDL:  # x is the previous kernel's output
        gdc_wait()
    for step in range(STEPS):
        k = k_start + step * BLOCK_K
        s_next, z_next = group_params(s_ptr, z_ptr, cols, col_mask, k + BLOCK_K, K, G, stride_sn, stride_zn, 1,
                                      BLOCK_K)
        in_k = k < K  # K is a multiple of the group, so a step is all inside K or all outside
        w = tl.load(w_ptrs + k // 8, mask=col_mask[:, None] & in_k, other=0)
        qx = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        xs = tl.zeros((WORDS, BLOCK_M), dtype=tl.float32)
        for j in tl.static_range(8):
            x_j = tl.load(x_ptrs + k + j, mask=row_mask[None, :] & in_k, other=0.0)
            qx = tl.dot(nibble(w, j).to(x_ptr.dtype.element_ty), x_j, qx)
            xs += x_j.to(tl.float32)
        acc += s * (qx - z * tl.sum(xs, axis=0)[None, :])
        s, z = s_next, z_next
    store_product(y_ptr, partials, counters, acc, rows[None, :].to(tl.int64) * N + cols[:, None],
                  col_mask[:, None] & row_mask[None, :], M.to(tl.int64) * N, SPLIT)


def dot_tiling(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages) of `int4_dot`: the rows padded to a power of two (16
    at least, 64 at most a tile), 64 weight rows a tile, one 128-input part of a group a step, K split so
    that every multiprocessor streams."""
    block_m, block_n, block_k = min(64, max(16, triton.next_power_of_2(m))), 64, MIN_DOT_GROUP
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    splits = split_count(programs, k, block_k, 4 * m * n, n * k // 2, sms)
    return block_m, block_n, block_k, splits, 4, 4


def int4_dot(x: torch.Tensor, qwords: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             tiles: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w^T on tensor cores, qwords the int32 words of `words`, groups of at least MIN_DOT_GROUP;
    `tiles` defaults to `dot_tiling` (BLOCK_K must divide the group)."""
    m, k = x.shape
    n = qwords.shape[0]
    block_m, block_n, block_k, splits, warps, stages = tiles or dot_tiling(m, n, k, multiprocessors(x.device))
    if block_k < MIN_DOT_GROUP or group_size % block_k:
        raise ConfigError(f"int4_dot takes K steps of at least {MIN_DOT_GROUP} inputs that divide the group size; "
                          f"got BLOCK_K {block_k} for group_size {group_size}: int4_linear takes smaller groups")
    splits, steps = k_steps(k, splits, block_k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    y, partials, counters = product_buffers(m, n, grid, x.dtype, x.device)
    launch_pdl = pdl_on(x.device)
    launch(
        _int4_dot_kernel, grid,
        x, qwords, scales, zeros, y, partials, counters, m, n, k, steps, group_size, x.stride(0), qwords.stride(0),
        scales.stride(0), zeros.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=splits > 1,
        PDL=launch_pdl, num_warps=warps, num_stages=stages, launch_pdl=launch_pdl,
    )
    return y
