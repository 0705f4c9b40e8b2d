"""int4 weight-only products: y [M, N] = x [M, K] @ w^T with w = (q - zeros) * scales per group of G inputs.

qweight [N, K/2] uint8 packs two 4-bit values per byte, the low nibble the even k; scales and zeros
are [N, K/G] (any float dtype, or integer zeros).

One row (decode at batch 1) goes to the GEMV on integer dot products (int4_dp4a.py) where the weight has words,
groups of MIN_GROUP or more and N and K of at least DP4A_SIDE: at its tiling rule it measured faster than tinygemm
on every 8B- and 1B-like projection (`python -m bench quantized --formats int4 --rows 1 --sweep`). Otherwise, up to
TINYGEMM_ROWS rows, where the layer keeps its weight also in the layout of torch's own int4 kernel (tinygemm,
`aten._weight_int4pack_mm`; quantized_linear.tinygemm_layout), that kernel takes them: it measured faster than ours
there (`python -m bench quantized`); one row it does not take goes to a GEMV in gemv.py's layout that sums q * x and
x per group. From 2 to DOT_ROWS rows a tensor-core kernel reads the weight as 32-bit words and turns nibbles into
floats without int-to-float conversions (int4_words.py), where the groups hold a dot's 16 words. Both apply a scale
and zero point per group, not per weight, and split K so that every multiprocessor has loads in flight (split_k.py:
partials summed in order by a tile's last split, the same result on every call).

A tiled byte kernel, which dequantizes each weight tile in registers for tensor-core dots, takes
DOT_ROWS to MM_ROWS rows, where it measured faster than the word kernel over a layer's products, and
what the word kernel cannot read below: a qweight whose rows do not start on 4-byte boundaries and
groups under MIN_DOT_GROUP. Past MM_ROWS rows (prefill), the weight is dequantized once to x's dtype
and multiplied by torch.mm: there every fused kernel measured slower, since each weight tile is dequantized
again for every row tile while cuBLAS runs near the compute rate (`python -m bench quantized --sweep`
times every way). Kernels only, no host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from graphkiln.errors import ConfigError

from .gemv import _k_mask, silu_mul
from .int4_dp4a import MIN_GROUP, int4_dp4a_gemv
from .int4_words import MIN_DOT_GROUP, group_params, int4_dot
from .int4_words import words as words_of
from .launch import launch
from .pdl import pdl_on
from .split_k import k_steps, multiprocessors, product_buffers, split_count, store_product

DP4A_SIDE = 2048  # the smallest N and K the dp4a GEMV takes at one row (the smallest measured)
TINYGEMM_ROWS = 4  # up to this many rows: tinygemm, where the layer carries its layout
DOT_ROWS = 32  # up to this many rows: int4_dot, where the groups allow it
MM_ROWS = 64  # up to this many rows: int4_mm; above: dequantize the weight, then torch.mm
MIN_MM_GROUP = 32  # smaller groups mean 16-wide K tiles, whose results were wrong on the H200 at 8 rows


@triton.jit
def _int4_gemv_step(acc, b, s, z, k, ks, x_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    CHUNKS: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, CHUNKS] + this K step: each chunk of BLOCK_K / CHUNKS inputs lies inside one group. x is
    loaded whole (one contiguous load the pipeliner can take) and split into the even and odd inputs."""
    x = tl.load(x_ptr + k + ks, mask=_k_mask(ks, k, K, EVEN_K), other=0.0).to(tl.float32)
    x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
    qx = (b & 15).to(tl.float32) * x_even[None, :] + (b >> 4).to(tl.float32) * x_odd[None, :]
    qx = tl.sum(tl.reshape(qx, (BLOCK_N, CHUNKS, BLOCK_K // 2 // CHUNKS)), axis=2)
    xs = tl.sum(tl.reshape(x_even + x_odd, (CHUNKS, BLOCK_K // 2 // CHUNKS)), axis=1)
    return acc + s * (qx - z * xs[None, :])


@triton.jit(do_not_specialize=["STEPS"])  # a loop bound: one build for every split
def _int4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, partials, counters, N, K, STEPS, G, stride_qn, stride_sn,
                      stride_zn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                      EVEN_K: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """y[0, N] (split_k.store_product) for one row x[0, K]: one program per slab of BLOCK_N weight rows and split
    of K (STEPS steps of BLOCK_K inputs, BLOCK_K / 2 bytes a row), accumulated per SUB-wide chunk (SUB divides G)."""
    pid = tl.program_id(0)
    split = tl.program_id(2)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    k_start = split * STEPS * BLOCK_K
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    js = tl.arange(0, BLOCK_K // 2)
    col_mask = cols < N
    q_ptrs = q_ptr + cols[:, None].to(tl.int64) * stride_qn + js[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K // SUB), dtype=tl.float32)
    k_mask = js < BLOCK_K // 2 if EVEN_K else k_start + 2 * js < K
    b = tl.load(q_ptrs + k_start // 2, mask=col_mask[:, None] & k_mask[None, :], other=0)  # the weight: no wait
    s, z = group_params(s_ptr, z_ptr, cols, col_mask, k_start, K, G, stride_sn, stride_zn, BLOCK_K // SUB, SUB)
    if PDL:  # x is: wait for the previous kernel to finish and its writes to land
        gdc_wait()
    s_next, z_next = group_params(s_ptr, z_ptr, cols, col_mask, k_start + BLOCK_K, K, G, stride_sn, stride_zn,
                                   BLOCK_K // SUB, SUB)
    acc = _int4_gemv_step(acc, b, s, z, k_start, ks, x_ptr, K, BLOCK_N, BLOCK_K, BLOCK_K // SUB, EVEN_K)
    for step in tl.range(1, STEPS, num_stages=STAGES):  # the loop attribute pipelines loads without a dot
        k = k_start + step * BLOCK_K
        s, z = s_next, z_next
        s_next, z_next = group_params(s_ptr, z_ptr, cols, col_mask, k + BLOCK_K, K, G, stride_sn, stride_zn,
                                       BLOCK_K // SUB, SUB)
        k_mask = js < BLOCK_K // 2 if EVEN_K else k + 2 * js < K
        b = tl.load(q_ptrs + k // 2, mask=col_mask[:, None] & k_mask[None, :], other=0)
        acc = _int4_gemv_step(acc, b, s, z, k, ks, x_ptr, K, BLOCK_N, BLOCK_K, BLOCK_K // SUB, EVEN_K)
    store_product(y_ptr, partials, counters, tl.sum(acc, axis=1), cols, col_mask, N, SPLIT)


@triton.jit
def _dequantize_tile(q_ptr, s, z, cols, col_mask, k, js, K, stride_qn, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at (cols, k) in `dtype`, with its rows' scales and zero points s, z
    ([BLOCK_N, 1] float32); BLOCK_K divides G, so one group a row."""
    k_mask = k + 2 * js < K
    b = tl.load(q_ptr + cols[:, None].to(tl.int64) * stride_qn + k // 2 + js[None, :],
                mask=col_mask[:, None] & k_mask[None, :], other=0)
    low = ((b & 15).to(tl.float32) - z) * s
    high = ((b >> 4).to(tl.float32) - z) * s
    return tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K)).to(dtype)


@triton.jit
def _zero_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """The float32 accumulator of a BLOCK_M x BLOCK_N output tile, transposed with SWAP_AB."""
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _dot_tile(acc, x, w, SWAP_AB: tl.constexpr):
    """acc + x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T; with SWAP_AB the transposed product acc + w @ x^T,
    where the weight rows fill the tall side of the tensor-core tile and the few activation rows its narrow
    one (and the converted weight stays in registers as the left operand)."""
    if SWAP_AB:
        out = tl.dot(w, tl.trans(x), acc)
    else:
        out = tl.dot(x, tl.trans(w), acc)
    return out


@triton.jit
def _output_tile(acc, SWAP_AB: tl.constexpr):
    """The accumulator as [BLOCK_M, BLOCK_N]."""
    if SWAP_AB:
        out = tl.trans(acc)
    else:
        out = acc
    return out


@triton.jit(do_not_specialize=["M", "STEPS"])  # one build for every row count and split
def _int4_mm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, partials, counters, M, N, K, STEPS, G, stride_xm, stride_qn,
                    stride_sn, stride_zn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    """y[M, N] (split_k.store_product) tile by tile over a split of K (STEPS steps of BLOCK_K), each int4 weight tile
    dequantized to x's dtype in registers for a dot."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
    k_start = split * STEPS * BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    js = tl.arange(0, BLOCK_K // 2)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    acc = _zero_tile(BLOCK_M, BLOCK_N, SWAP_AB)
    s, z = group_params(s_ptr, z_ptr, cols, col_mask, k_start, K, G, stride_sn, stride_zn, 1, BLOCK_K)
    if PDL:  # x is the previous kernel's output
        gdc_wait()
    for step in range(STEPS):
        k = k_start + step * BLOCK_K
        s_next, z_next = group_params(s_ptr, z_ptr, cols, col_mask, k + BLOCK_K, K, G, stride_sn, stride_zn, 1,
                                       BLOCK_K)
        w = _dequantize_tile(q_ptr, s, z, cols, col_mask, k, js, K, stride_qn, BLOCK_N, BLOCK_K,
                             x_ptr.dtype.element_ty)
        s, z = s_next, z_next
        x = tl.load(x_ptrs + k, mask=row_mask[:, None] & ((k + ks) < K)[None, :], other=0.0)
        acc = _dot_tile(acc, x, w, SWAP_AB)
    acc = _output_tile(acc, SWAP_AB)
    store_product(y_ptr, partials, counters, acc, rows[:, None].to(tl.int64) * N + cols[None, :],
                  row_mask[:, None] & col_mask[None, :], M.to(tl.int64) * N, SPLIT)


@triton.jit
def _int4_dequantize_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, K, G, stride_qn, stride_sn, stride_zn, stride_on,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N, K] = (q - zeros) * scales, in out's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K
    col_mask = cols < N
    s, z = group_params(s_ptr, z_ptr, cols, col_mask, k, K, G, stride_sn, stride_zn, 1, BLOCK_K)
    w = _dequantize_tile(q_ptr, s, z, cols, col_mask, k, tl.arange(0, BLOCK_K // 2), K, stride_qn, BLOCK_N, BLOCK_K,
                         out_ptr.dtype.element_ty)
    ks = k + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + cols[:, None].to(tl.int64) * stride_on + ks[None, :], w,
             mask=col_mask[:, None] & (ks < K)[None, :])


def gemv_tiling(n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, warps, stages) of the one-row kernel: slabs of a few weight rows over long K
    steps (a step loads 1-4 KiB of each row's packed bytes; 2048 inputs divide the long K of Llama-shaped down
    projections, whose masked steps ran at half speed), a deep pipeline of short steps for the wide projections,
    and K split where the slabs alone leave multiprocessors idle (the benchmark's sweep checks them)."""
    if n <= 8192:
        if k <= 2048:
            tiles = 4, 8192, 4, 2
        elif k < 8192:
            tiles = (8, 1024, 4, 4) if n > 4096 else (8, 2048, 4, 3)
        else:
            tiles = 16, 2048, 8, 2
    elif n <= 32768:
        tiles = 32, 512, 4, 6
    else:
        tiles = 16, 1024, 4, 4
    block_n, block_k, warps, stages = tiles
    block_k = min(block_k, max(triton.next_power_of_2(k), 32))
    splits = split_count(triton.cdiv(n, block_n), k, block_k, 4 * n, n * k // 2, sms)
    return block_n, block_k, splits, warps, stages


def mm_tiling(m: int, n: int, k: int, group_size: int, sms: int = 132) -> tuple[int, int, int, bool, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, swap_ab, splits, warps, stages) of the tiled kernel; BLOCK_K divides the group
    size. One row tile covers the rows (MM_ROWS at most, beyond which int4_linear does not take this kernel);
    64-wide slabs, with K split so that every multiprocessor streams."""
    block_m, block_n, block_k, warps, stages = max(16, triton.next_power_of_2(m)), 64, min(group_size, 128), 4, 4
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    splits = split_count(programs, k, block_k, 4 * m * n, n * k // 2, sms)
    return block_m, block_n, block_k, False, splits, warps, stages


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    n, half_k = qweight.shape
    k = 2 * half_k
    if group_size < 16 or group_size & (group_size - 1) or k % group_size:
        raise ConfigError(f"int4 group_size {group_size} must be a power of two >= 16 dividing K = {k}")
    if qweight.dtype != torch.uint8 or qweight.stride(1) != 1:
        raise ConfigError(f"int4 qweight must be uint8 [N, K/2] with unit stride along K; got {qweight.dtype} of "
                          f"shape {tuple(qweight.shape)} and strides {qweight.stride()}")
    groups = (n, k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != groups:
            raise ConfigError(f"int4 {name} has shape {tuple(t.shape)}; a qweight of shape {(n, half_k)} with "
                              f"group_size {group_size} needs {groups}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"int4_linear takes x [M, {k}] in bfloat16 or float16; got {x.dtype} of shape "
                          f"{tuple(x.shape)}")


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ w^T with the one-row kernel; `tiles` defaults to `gemv_tiling`."""
    n, k = qweight.shape[0], x.shape[1]
    block_n, block_k, splits, warps, stages = tiles or gemv_tiling(n, k, multiprocessors(x.device))
    splits, steps = k_steps(k, splits, block_k)
    grid = (triton.cdiv(n, block_n), 1, splits)
    y, partials, counters = product_buffers(1, n, grid, x.dtype, x.device)
    launch_pdl = pdl_on(x.device)
    launch(
        _int4_gemv_kernel, grid,
        x, qweight, scales, zeros, y, partials, counters, n, k, steps, group_size, qweight.stride(0),
        scales.stride(0), zeros.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, SUB=min(block_k, group_size),
        EVEN_K=k % block_k == 0, SPLIT=splits > 1, STAGES=stages, PDL=launch_pdl, num_warps=warps,
        num_stages=stages, launch_pdl=launch_pdl,
    )
    return y


def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            tiles: tuple[int, int, int, bool, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w^T with the tiled kernel; `tiles` defaults to `mm_tiling`."""
    m, k = x.shape
    n = qweight.shape[0]
    block_m, block_n, block_k, swap_ab, splits, warps, stages = tiles or mm_tiling(m, n, k, group_size,
                                                                                   multiprocessors(x.device))
    splits, steps = k_steps(k, splits, block_k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    y, partials, counters = product_buffers(m, n, grid, x.dtype, x.device)
    launch_pdl = pdl_on(x.device)
    launch(
        _int4_mm_kernel, grid,
        x, qweight, scales, zeros, y, partials, counters, m, n, k, steps, group_size, x.stride(0),
        qweight.stride(0), scales.stride(0), zeros.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SWAP_AB=swap_ab, SPLIT=splits > 1, PDL=launch_pdl, num_warps=warps, num_stages=stages, launch_pdl=launch_pdl,
    )
    return y


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] = (q - zeros) * scales, in `dtype`."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_k = min(group_size, 128)
    launch(
        _int4_dequantize_kernel, (triton.cdiv(n, 64), triton.cdiv(k, block_k)),
        qweight, scales, zeros, out, n, k, group_size, qweight.stride(0), scales.stride(0), zeros.stride(0),
        out.stride(0), BLOCK_N=64, BLOCK_K=block_k,
    )
    return out


def one_row_words(x: torch.Tensor, group_size: int) -> bool:
    """Whether x's words (int4_dp4a.x_words) can serve a product of x at one row: the dp4a GEMV's row, groups and
    K. A kernel writing x (kernels/rms_norm.py) writes them under this rule and int4_linear takes them under it."""
    k = x.shape[1]
    return x.shape[0] == 1 and group_size >= MIN_GROUP and k >= DP4A_SIDE and k % group_size == 0


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, tinygemm_weight: torch.Tensor | None = None,
                tinygemm_params: torch.Tensor | None = None, gated: bool = False,
                words: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] (bfloat16/float16) @ w^T -> [M, N] in x's dtype, w = (q - zeros) * scales per group; the
    tinygemm tensors, where given, are the same weight in tinygemm's layout. `gated`: x is [gate | up] [M, 2K] and
    the product is of silu(gate) * up, rounded to x's dtype (at one row the dp4a GEMV's x_words applies it, else
    the SiLU-and-mul kernel); `words`: x's words, already made (one_row_words), which the dp4a GEMV then takes."""
    inputs = x[:, : x.shape[1] // 2] if gated else x  # the product's own x: gate_up's first half, gated
    _check(inputs, qweight, scales, zeros, group_size)
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, qweight.shape[0])
    x = x if x.stride(1) == 1 else x.contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    qwords = words_of(qweight)
    dp4a = qwords is not None and qwords.shape[0] >= DP4A_SIDE and one_row_words(inputs, group_size)
    if gated and not dp4a:
        x, gated = silu_mul(x), False
    if dp4a:
        return int4_dp4a_gemv(x, qwords, scales, zeros, group_size, gated=gated, words=words)
    if tinygemm_weight is not None and m <= TINYGEMM_ROWS and x.dtype == torch.bfloat16:
        return torch.ops.aten._weight_int4pack_mm(x.contiguous(), tinygemm_weight, group_size, tinygemm_params)
    if m == 1:
        return int4_gemv(x, qweight, scales, zeros, group_size)
    if qwords is not None and m <= DOT_ROWS and group_size >= MIN_DOT_GROUP:
        return int4_dot(x, qwords, scales, zeros, group_size)
    if m <= MM_ROWS and group_size >= MIN_MM_GROUP:
        return int4_mm(x, qweight, scales, zeros, group_size)
    return torch.mm(x, dequantize(qweight, scales, zeros, group_size, x.dtype).t())
