"""int4 one-row product on integer dot products (dp4a), four inputs an instruction.

A one-row int4 product is bound by the instructions per weight, not by its bytes (README: the byte GEMV and
torch's tinygemm issue about six a weight). Here x [1, K] is first written, by a small kernel, as 16-bit fixed
point per group of G inputs (x ~ xs_g * f, |f| <= 32767: finer than bfloat16 for every input above 1/128 of its
group's largest), each f split into a signed high and an unsigned low byte (f = 256 h + l), the bytes packed into
int32 words that line up with the weight's (`x_words`). Word i of the weight holds the nibbles of inputs 8i to
8i + 7, byte j the even input 8i + 2j in its low nibble and the odd one in its high; so x's words are four
arrays [4, K/8]: the even inputs' high bytes, the odd inputs' high bytes, then the low bytes alike. Per weight
word, lo = w & 0x0F0F0F0F and hi = (w >> 4) & 0x0F0F0F0F hold its eight nibbles as bytes, and four dp4a
give sum(q * f) over its inputs exactly, in int32: about two instructions a weight, conversions included. A
group's sum S and the sum F of its f give y_n += s_ng * xs_g * (S - z_ng * F).

Both kernels launch with programmatic dependent launch (pdl.py): x_words waits for x's producer, the product
starts loading its weight while x_words runs. x's producer may write the words itself instead (store_words: the
RMSNorm, kernels/rms_norm.py), and x_words may apply the SiLU-and-mul to the row [gate | up] it loads
(models/int4_fused.py): either way the step loses a launch. K splits as split_k.py says. On the CPU (Triton's
interpreter, which runs no PTX) dp4a is computed with shifts and products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from graphkiln.errors import ConfigError

from .int4_words import group_params
from .launch import launch
from .pdl import pdl_on
from .split_k import k_steps, multiprocessors, product_buffers, split_count, store_product

FIXED = tl.constexpr(32767.0)  # the largest |f| of a group
LOW_NIBBLES = tl.constexpr(0x0F0F0F0F)
MIN_GROUP = 16  # the smallest group int4_linear takes: two words


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _pack(bytes4):
    """[W, 4] int32 bytes (either sign) -> [W] int32 words, byte j in bits 8j to 8j + 7."""
    shifts = 8 * tl.arange(0, 4)
    return tl.reduce((bytes4 & 255) << shifts[None, :], 1, _or)


@triton.jit
def store_words(x, words_ptr, scales_ptr, sums_ptr, first_group, groups, KW, G: tl.constexpr, GROUPS: tl.constexpr):
    """Groups first_group to first_group + GROUPS of x (x [GROUPS * G] float32; those from `groups` on are not
    stored): each group's scale xs, the sum F of its fixed-point values, and its part of the four words arrays."""
    x = tl.reshape(x, (GROUPS, G))
    largest = tl.max(tl.abs(x), 1)
    scale = tl.where(largest > 0, largest / FIXED, 1.0)
    f = tl.floor(x / scale[:, None] + 0.5).to(tl.int32)
    high_even, high_odd = tl.split(tl.reshape(f >> 8, (GROUPS * G // 8, 4, 2)))
    low_even, low_odd = tl.split(tl.reshape(f & 255, (GROUPS * G // 8, 4, 2)))
    g = first_group + tl.arange(0, GROUPS)
    w = first_group * (G // 8) + tl.arange(0, GROUPS * G // 8)
    stored = w < groups * (G // 8)
    tl.store(words_ptr + w, _pack(high_even), mask=stored)
    tl.store(words_ptr + KW + w, _pack(high_odd), mask=stored)
    tl.store(words_ptr + 2 * KW + w, _pack(low_even), mask=stored)
    tl.store(words_ptr + 3 * KW + w, _pack(low_odd), mask=stored)
    tl.store(scales_ptr + g, scale, mask=g < groups)
    tl.store(sums_ptr + g, tl.sum(f, 1).to(tl.float32), mask=g < groups)


@triton.jit
def _x_words_kernel(x_ptr, words_ptr, scales_ptr, sums_ptr, KW, G: tl.constexpr, GATED: tl.constexpr,
                    PDL: tl.constexpr):
    """Group g of x (store_words); with GATED, x is silu(gate) * up of the row [gate | up] (2K wide), rounded to
    its dtype as the SiLU-and-mul kernel rounds it (kernels/gemv.py), which then needs no launch of its own."""
    if PDL:
        gdc_launch_dependents()
    g = tl.program_id(0)
    if PDL:  # x is the previous kernel's output
        gdc_wait()
    cols = g * G + tl.arange(0, G)
    x = tl.load(x_ptr + cols).to(tl.float32)
    if GATED:
        up = tl.load(x_ptr + KW * 8 + cols).to(tl.float32)
        x = (x * tl.sigmoid(x) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    store_words(x, words_ptr, scales_ptr, sums_ptr, g, g + 1, KW, G, 1)


@triton.jit
def _dp4a(a, b, c, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """c + the sum over the four bytes of a (unsigned) times those of b (signed with SIGNED), in int32."""
    if ASM:
        if SIGNED:
            out = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                            is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                            is_pure=True, pack=1)
    else:
        out = c
        for j in tl.static_range(4):
            if SIGNED:
                b_j = (b << (24 - 8 * j)) >> 24
            else:
                b_j = (b >> (8 * j)) & 255
            out += ((a >> (8 * j)) & 255) * b_j
    return out


@triton.jit
def _group_sums(w, xw_ptr, kw, KW, WORDS: tl.constexpr, CHUNKS: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N, CHUNKS] int32: sum(q * f) over each group of the step's weight words w [BLOCK_N, WORDS]."""
    ws = kw + tl.arange(0, WORDS)
    high_even = tl.load(xw_ptr + ws)[None, :]
    high_odd = tl.load(xw_ptr + KW + ws)[None, :]
    low_even = tl.load(xw_ptr + 2 * KW + ws)[None, :]
    low_odd = tl.load(xw_ptr + 3 * KW + ws)[None, :]
    lo = w & LOW_NIBBLES
    hi = (w >> 4) & LOW_NIBBLES
    high = _dp4a(hi, high_odd, _dp4a(lo, high_even, tl.zeros_like(w), True, ASM), True, ASM)
    word = _dp4a(hi, low_odd, _dp4a(lo, low_even, high << 8, False, ASM), False, ASM)
    return tl.sum(tl.reshape(word, (w.shape[0], CHUNKS, WORDS // CHUNKS)), axis=2)


@triton.jit
def _x_params(xs_ptr, xf_ptr, groups, NG):
    """x's scales and fixed-point sums [1, CHUNKS] of `groups` (zeros past the last group). The kernel loads
    them, and the weight's (int4_words.group_params), a step ahead: too narrow for the pipeliner's copies, they
    would stall every step."""
    mask = groups < NG
    xs = tl.load(xs_ptr + groups, mask=mask, other=0.0)[None, :]
    xf = tl.load(xf_ptr + groups, mask=mask, other=0.0)[None, :]
    return xs, xf


@triton.jit(do_not_specialize=["STEPS"])  # a loop bound: one build for every split
def _int4_dp4a_gemv_kernel(q_ptr, xw_ptr, xs_ptr, xf_ptr, s_ptr, z_ptr, y_ptr, partials, counters, N, KW, STEPS,
                           stride_qn, stride_sn, stride_zn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           G: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr,
                           PDL: tl.constexpr):
    """y[0, N] (split_k.store_product): BLOCK_N weight rows (int32 words [N, K/8]) over STEPS steps of BLOCK_K
    inputs, whole groups, from the split's start: y += s * xs * (S - z * F) per group."""
    pid = tl.program_id(0)
    split = tl.program_id(2)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    WORDS: tl.constexpr = BLOCK_K // 8
    CHUNKS: tl.constexpr = BLOCK_K // G
    K = KW * 8
    NG = K // G
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    k_start = split * STEPS * BLOCK_K
    q_ptrs = q_ptr + cols[:, None].to(tl.int64) * stride_qn + tl.arange(0, WORDS)[None, :]
    groups = k_start // G + tl.arange(0, CHUNKS)
    s, z = group_params(s_ptr, z_ptr, cols, col_mask, k_start, K, G, stride_sn, stride_zn, CHUNKS, G)
    w = tl.load(q_ptrs + k_start // 8, mask=col_mask[:, None], other=0)  # the weight and its scales: no wait
    if PDL:  # x's words are the previous kernel's output
        gdc_wait()
    xs, xf = _x_params(xs_ptr, xf_ptr, groups, NG)
    s_next, z_next = group_params(s_ptr, z_ptr, cols, col_mask, k_start + BLOCK_K, K, G, stride_sn, stride_zn,
                                  CHUNKS, G)
    xs_next, xf_next = _x_params(xs_ptr, xf_ptr, groups + CHUNKS, NG)
    sums = _group_sums(w, xw_ptr, k_start // 8, KW, WORDS, CHUNKS, ASM).to(tl.float32)
    acc = s * xs * (sums - z * xf)
    for step in tl.range(1, STEPS, num_stages=STAGES):  # the loop attribute pipelines loads without a dot
        k = k_start + step * BLOCK_K
        groups = k // G + tl.arange(0, CHUNKS)
        s, z, xs, xf = s_next, z_next, xs_next, xf_next
        s_next, z_next = group_params(s_ptr, z_ptr, cols, col_mask, k + BLOCK_K, K, G, stride_sn, stride_zn,
                                      CHUNKS, G)
        xs_next, xf_next = _x_params(xs_ptr, xf_ptr, groups + CHUNKS, NG)
        w = tl.load(q_ptrs + k // 8, mask=col_mask[:, None], other=0)
        sums = _group_sums(w, xw_ptr, k // 8, KW, WORDS, CHUNKS, ASM).to(tl.float32)
        acc += s * xs * (sums - z * xf)
    store_product(y_ptr, partials, counters, tl.sum(acc, axis=1), cols, col_mask, N, SPLIT)


def words_buffers(k: int, group_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty words [4, K/8] int32, scales and sums [K/G] float32, each a tensor of its own: the ops returning them
    (models/int4_fused.py) may not return outputs that alias one another."""
    return (torch.empty(4, k // 8, dtype=torch.int32, device=device),
            torch.empty(k // group_size, dtype=torch.float32, device=device),
            torch.empty(k // group_size, dtype=torch.float32, device=device))


def x_words(x: torch.Tensor, group_size: int, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(words [4, K/8] int32, scales [K/G] float32, sums [K/G] float32) of one row x [1, K], as the module
    docstring says; `gated`: of silu(gate) * up for x = [gate | up] [1, 2K]."""
    k = x.shape[1] // 2 if gated else x.shape[1]
    words, scales, sums = words_buffers(k, group_size, x.device)
    launch_pdl = pdl_on(x.device)
    launch(_x_words_kernel, (k // group_size,), x, words, scales, sums, k // 8, G=group_size, GATED=gated,
           PDL=launch_pdl, num_warps=1, launch_pdl=launch_pdl)
    return words, scales, sums


def dp4a_tiling(n: int, k: int, group_size: int, sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, warps, stages), the fastest of `bench quantized --sweep` on the 8B- and 1B-like
    projections: where K reaches 4096, slabs of 8 weight rows up to N = 4096, 16 above, over 2048-wide steps
    (512-wide past N = 8192) on 4 warps; where K is 2048 or less, a slab makes one or two steps, so it takes more
    rows: 16 on 8 warps up to N = 8192, 32 over 1024-wide steps above. Steps are halved until they divide K (a
    whole number of groups); K splits until two programs a multiprocessor, where the K steps allow."""
    if k > 2048:
        block_n, block_k, warps, stages = (8 if n <= 4096 else 16), (512 if n > 8192 else 2048), 4, 3
    elif n <= 8192:
        block_n, block_k, warps, stages = 16, 2048, 8, 2
    else:
        block_n, block_k, warps, stages = 32, 1024, 4, 3
    block_k = max(block_k, group_size)
    while block_k > group_size and k % block_k:
        block_k //= 2
    splits = split_count(triton.cdiv(n, block_n), k, block_k, 4 * n, n * k // 2, sms, resident=2)
    return block_n, block_k, splits, warps, stages


def int4_dp4a_gemv(x: torch.Tensor, qwords: torch.Tensor | None, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, tiles: tuple[int, int, int, int, int] | None = None, gated: bool = False,
                   words: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [1, K] (bfloat16/float16) @ w^T -> [1, N] in x's dtype, the weight as the int32 words of
    int4_words.words, groups of MIN_GROUP or more; `tiles` defaults to `dp4a_tiling` (BLOCK_K a multiple of the
    group size dividing K). `gated`: x is [gate | up] [1, 2K] and the product is of silu(gate) * up (x_words);
    `words`: x_words of x, made by x's producer (kernels/rms_norm.py), which then needs no launch here."""
    x = x if x.stride(1) == 1 else x.contiguous()
    if gated:
        gate_up, x = x, x[:, : x.shape[1] // 2]
    if qwords is None or qwords.dtype != torch.int32 or qwords.shape[1] * 8 != x.shape[1]:
        raise ConfigError("int4_dp4a_gemv takes the weight as int4_words.words gives it (int32 [N, K/8]); a qweight "
                          "whose rows do not start on 4-byte boundaries has no words")
    n, k = qwords.shape[0], x.shape[1]
    block_n, block_k, splits, warps, stages = tiles or dp4a_tiling(n, k, group_size, multiprocessors(x.device))
    if x.shape[0] != 1 or group_size < MIN_GROUP or k % block_k or block_k % group_size:
        raise ConfigError(f"int4_dp4a_gemv takes one row and K steps of whole groups of at least {MIN_GROUP}; got x "
                          f"of shape {tuple(x.shape)}, group_size {group_size}, BLOCK_K {block_k}")
    xw, xs, xf = words or (x_words(gate_up, group_size, gated=True) if gated else x_words(x, group_size))
    splits, steps = k_steps(k, splits, block_k)
    grid = (triton.cdiv(n, block_n), 1, splits)
    y, partials, counters = product_buffers(1, n, grid, x.dtype, x.device)
    launch_pdl = pdl_on(x.device)
    runs_ptx = not isinstance(_int4_dp4a_gemv_kernel, InterpretedFunction)  # the interpreter runs no inline PTX
    launch(
        _int4_dp4a_gemv_kernel, grid,
        qwords, xw, xs, xf, scales, zeros, y, partials, counters, n, k // 8, steps, qwords.stride(0),
        scales.stride(0), zeros.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, G=group_size, SPLIT=splits > 1,
        STAGES=stages, ASM=runs_ptx, PDL=launch_pdl, num_warps=warps, num_stages=stages, launch_pdl=launch_pdl,
    )
    return y
