"""fp8 weight products: y [M, N] = x [M, K] @ (weight [N, K] float8_e4m3fn, dequantized by its scales)^T.

Weight scales are per output channel ([N]) or per 128 x 128 block ([ceil(N/128), ceil(K/128)]); the
dequantized weight is the fp8 value times its scale. The GEMV and `dequantize` also take an int8 weight, and
2-D scales per SCALE_ROWS x 128 tile of it (`scale_rows`: 128 for blocks, 1 for int8's groups of 128 inputs).

Few rows (decode): the product is a pass over the weight, and the bytes read are half of bf16's.
One row: the GEMV layout of gemv.py (a slab of weight rows per program over a range of K), the
weight converted in registers and multiplied by the unquantized activation. 2 to FEW_ROWS rows:
fp8_mma.py, the fp8 weight straight into fp8 tensor cores and the activation quantized in
registers per 1 x 128 group. Both split K where their slabs alone leave multiprocessors without
loads in flight (split_k.py: partials summed in order by a tile's last split, the same result on every call).
FEW_ROWS + 1 to MMA_ROWS rows: the activation quantized first, as for torch._scaled_mm below, then
fp8_mma on it. On sm90 and later, per-channel weights of TMA_MIN_N rows or more take tma_products.py from 2 rows to
MMA_ROWS instead: x quantized per token first, then a product fed by TMA copies, which measured faster than
fp8_mma at 8 to 64 rows alone (the quantization's launch included) and in whole decode steps at 8 and 64 rows
(even at 32).
More rows (prefill): the activation is quantized to fp8 (per token for per-channel weights, per
1 x 128 group for block weights; with `input_scale`, by that static per-tensor scale) and the
product runs on fp8 tensor cores in torch._scaled_mm; block weights where that torch build has no
block-scaled _scaled_mm are dequantized to x's dtype and multiplied by torch.mm.
Every path launches kernels only (no host sync), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from graphkiln.errors import ConfigError

from .fp8_mma import fp8_mma
from .gemv import _k_mask, paired_rows, silu_mul, store_activated
from .launch import launch
from .pdl import pdl_on
from .split_k import k_steps, multiprocessors, product_buffers, split_count, store_product
from .tma_products import fp8_tma, tma_fits

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # the side of a weight-scale block
FEW_ROWS = 16  # up to this many rows x goes unquantized to kernels of ours (rounded per group in registers)
MMA_ROWS = 64  # up to this many rows fp8_mma multiplies the quantized activation; torch._scaled_mm above
GEMV_RESIDENT = 2  # programs per multiprocessor below which the one-row kernel splits K


@triton.jit
def _gemv_step(acc, w, k, ks, k_mask, cols, col_mask, x_ptr, s_ptr, K, stride_sn, BLOCK_N: tl.constexpr,
               CHUNKS: tl.constexpr, SUB: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_ROWS: tl.constexpr):
    """acc + this K step's products summed over each SUB-wide chunk (inside one scale tile), times that
    tile's scale for 2-D scales (per-channel scales multiply at the end). The accumulator is one column
    per chunk rather than one per input: fewer registers, so more loads in flight."""
    x = tl.load(x_ptr + k + ks, mask=k_mask, other=0.0).to(tl.float32)
    sums = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, CHUNKS, SUB)), axis=2)
    if BLOCK_SCALES:
        chunk_k = k + tl.arange(0, CHUNKS) * SUB
        s = tl.load(s_ptr + (cols // SCALE_ROWS)[:, None] * stride_sn + (chunk_k // 128)[None, :],
                    mask=col_mask[:, None] & (chunk_k < K)[None, :], other=0.0)
        sums = sums * s
    return acc + sums


@triton.jit(do_not_specialize=["STEPS"])  # a loop bound: one build for every split
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, partials, counters, N, K, STEPS, stride_wn, stride_sn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_SCALES: tl.constexpr, SCALE_ROWS: tl.constexpr, ACTIVATED: tl.constexpr,
                     SPLIT: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """y[0, N] for one row x[0, K]: one program per slab of BLOCK_N weight rows and split of K (STEPS steps of
    BLOCK_K, split_k.store_product); the accumulator has one column per SUB-wide chunk of a step. ACTIVATED (one
    split): y[0, N / 2] = silu(gate) * up of the product's halves (gemv.paired_rows, gemv.store_activated)."""
    pid = tl.program_id(0)
    split = tl.program_id(2)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    k_start = split * STEPS * BLOCK_K
    if ACTIVATED:
        cols, col_mask = paired_rows(pid, N, BLOCK_N)
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K // SUB), dtype=tl.float32)
    k_mask = _k_mask(ks, k_start, K, EVEN_K)
    w = tl.load(w_ptrs + k_start, mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # the weight: no wait
    if PDL:  # x is: wait for the previous kernel to finish and its writes to land
        gdc_wait()
    acc = _gemv_step(acc, w, k_start, ks, k_mask, cols, col_mask, x_ptr, s_ptr, K, stride_sn, BLOCK_N,
                     BLOCK_K // SUB, SUB, BLOCK_SCALES, SCALE_ROWS)
    for step in tl.range(1, STEPS, num_stages=STAGES):  # the loop attribute pipelines loads without a dot
        k = k_start + step * BLOCK_K
        k_mask = _k_mask(ks, k, K, EVEN_K)
        w = tl.load(w_ptrs + k, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _gemv_step(acc, w, k, ks, k_mask, cols, col_mask, x_ptr, s_ptr, K, stride_sn, BLOCK_N,
                         BLOCK_K // SUB, SUB, BLOCK_SCALES, SCALE_ROWS)
    y = tl.sum(acc, axis=1)
    if not BLOCK_SCALES:
        y = y * tl.load(s_ptr + cols, mask=col_mask, other=0.0)
    if ACTIVATED:
        store_activated(y, y_ptr, pid, N, BLOCK_N)
    else:
        store_product(y_ptr, partials, counters, y, cols, col_mask, N, SPLIT)


@triton.jit
def quantize_group(x, INT8: tl.constexpr):
    """(q, scale) of a group of float32 values x (zeros in masked lanes) by its absolute maximum: scale = amax / 448
    (amax / 127 for INT8), at least 1e-12, and q = x / scale clamped to the type's range (rounded to the nearest
    integer for INT8), still float32. The quantization kernel's, and the RMSNorm's that quantizes (rms_norm.py)."""
    q_max = 127.0 if INT8 else 448.0
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / q_max, 1e-12)
    q = x / scale
    if INT8:
        q = tl.floor(q + 0.5)
    return tl.clamp(q, -q_max, q_max), scale


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, stride_sg,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr, INT8: tl.constexpr, ACTIVATED: tl.constexpr,
                            PDL: tl.constexpr):
    """One group of one row of x to fp8 (int8) by its absolute maximum: q = x / s, s = amax / 448 (s = amax / 127,
    q rounded to the nearest integer). ACTIVATED: the row is [gate | up] of width 2K and what is quantized is
    silu(gate) * up rounded to x's dtype, the SiLU-and-mul kernel's output, never stored. With PDL the product
    after it launches as it begins, so that product's programs are resident and set up when q lands."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # x is the previous kernel's output
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ks = group * GROUP + offs
    mask = (offs < GROUP) & (ks < K)
    x = tl.load(x_ptr + row * stride_xm + ks, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATED:
        up = tl.load(x_ptr + row * stride_xm + K + ks, mask=mask, other=0.0).to(tl.float32)
        x = (x * tl.sigmoid(x) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    q, scale = quantize_group(x, INT8)
    tl.store(q_ptr + row * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group * stride_sg, scale)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_ROWS: tl.constexpr):
    """out[N, K] = weight times its SCALE_ROWS x 128 tile's scale (BLOCK_SCALES) or its row's, in out's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (cols < N)[:, None] & (ks < K)[None, :]
    w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=mask, other=0.0)
    if BLOCK_SCALES:
        s = tl.load(s_ptr + (cols // SCALE_ROWS)[:, None] * stride_sn + (ks // 128)[None, :], mask=mask, other=0.0)
    else:
        s = tl.load(s_ptr + cols, mask=cols < N, other=0.0)[:, None]
    out = (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + cols[:, None].to(tl.int64) * stride_on + ks[None, :], out, mask=mask)


def gemv_tiling(n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, warps, stages) of the one-row kernel, from the benchmark's sweep of the
    1B- and 8B-like projections: 2048-wide K steps on 8 warps for the narrow projections, 1024-wide ones for
    gate_up (pipelined 4 deep where K has more than two), and K split only where the slabs leave fewer than
    GEMV_RESIDENT programs a multiprocessor: the split's sum, a second launch when this was measured, cost more
    than the loads it added. `sms`: the device's multiprocessors."""
    if n <= 8192:
        tiles = 16 if n > 4096 else 8, 2048, 8, 2
    elif n <= 32768:
        tiles = 8, 1024, 4, 4 if k > 2048 else 1
    else:
        tiles = 16, 512, 4, 4
    block_n, block_k, warps, stages = tiles
    block_k = min(block_k, max(triton.next_power_of_2(k), 16))
    splits = split_count(triton.cdiv(n, block_n), k, block_k, 4 * n, n * k, sms, GEMV_RESIDENT)
    return block_n, block_k, splits, warps, stages


def _block_scales(weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """True for 128 x 128 block scales, False for per-output-channel ones; any other shape is refused."""
    n, k = weight.shape
    if weight_scale.dim() == 1 and weight_scale.shape[0] == n:
        return False
    if weight_scale.dim() == 2 and tuple(weight_scale.shape) == (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)):
        return True
    raise ConfigError(
        f"fp8 weight_scale has shape {tuple(weight_scale.shape)} for a weight of shape {(n, k)}: give one scale per "
        f"output channel ({n},) or one per 128 x 128 block ({triton.cdiv(n, BLOCK)}, {triton.cdiv(k, BLOCK)})"
    )


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight.dtype != FP8 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ConfigError(f"fp8 weight must be a 2-D float8_e4m3fn tensor with unit stride along K; got "
                          f"{weight.dtype} of shape {tuple(weight.shape)} and strides {weight.stride()}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"fp8_linear takes x [M, {weight.shape[1]}] in bfloat16 or float16; got {x.dtype} of "
                          f"shape {tuple(x.shape)}")
    if weight_scale.dtype != torch.float32:
        raise ConfigError(f"fp8 weight_scale must be float32; got {weight_scale.dtype}")


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             tiles: tuple[int, int, int, int, int] | None = None, activated: bool = False,
             scale_rows: int = BLOCK) -> torch.Tensor:
    """x [1, K] @ dequantized weight^T with the one-row kernel, for an fp8 or an int8 weight (each weight is
    converted to float32 in registers, whichever it is) with [N] scales or 2-D ones per `scale_rows` x 128
    tile; `tiles` defaults to `gemv_tiling`. `activated` (N even): silu(y[:, :N/2]) * y[:, N/2:] of that product
    y, [1, N/2], in the kernel's epilogue where K is not split, by the SiLU-and-mul kernel after the split's sum
    otherwise."""
    n, k = weight.shape
    block_n, block_k, splits, warps, stages = tiles or gemv_tiling(n, k, multiprocessors(x.device))
    splits, steps = k_steps(k, splits, block_k)
    block_scales = weight_scale.dim() == 2
    in_epilogue = activated and splits == 1
    grid = (triton.cdiv(n // 2, block_n // 2) if in_epilogue else triton.cdiv(n, block_n), 1, splits)
    y, partials, counters = product_buffers(1, n // 2 if in_epilogue else n, grid, x.dtype, x.device)
    launch_pdl = pdl_on(x.device)
    launch(
        _fp8_gemv_kernel, grid,
        x, weight, weight_scale, y, partials, counters, n, k, steps, weight.stride(0), weight_scale.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, SUB=min(block_k, BLOCK), EVEN_K=k % block_k == 0,
        BLOCK_SCALES=block_scales, SCALE_ROWS=scale_rows, ACTIVATED=in_epilogue, SPLIT=splits > 1, STAGES=stages,
        PDL=launch_pdl, num_warps=warps, num_stages=stages, launch_pdl=launch_pdl,
    )
    return silu_mul(y) if activated and not in_epilogue else y


def quantize_rows(x: torch.Tensor, group: int | None = None, dtype: torch.dtype = FP8,
                  activated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] to `dtype` (fp8, or int8 rounded to the nearest integer) with a float32 scale per row (`group`
    None: [M, 1]) or per `group`-wide slice of a row ([M, ceil(K/group)], column-major as torch._scaled_mm's
    block scaling wants it). `activated`: x is [M, 2K] = [gate | up], and what is quantized is silu_mul(x), equal
    bit for bit, computed as it loads."""
    m, k = x.shape[0], x.shape[1] // 2 if activated else x.shape[1]
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    if group is None:
        scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
        width, groups = k, 1
    else:
        groups = triton.cdiv(k, group)
        scales = torch.empty(groups, m, dtype=torch.float32, device=x.device).t()
        width = group
    block = triton.next_power_of_2(width)
    if m:
        launch_pdl = pdl_on(x.device)
        launch(
            _quantize_groups_kernel, (m, groups),
            x, q, scales, k, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1), GROUP=width, BLOCK=block,
            INT8=dtype == torch.int8, ACTIVATED=activated, PDL=launch_pdl, num_warps=max(1, min(16, block // 512)),
            launch_pdl=launch_pdl,
        )
    return q, scales


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x to fp8 by a static per-tensor scale (clamped to fp8's range)."""
    return (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
               scale_rows: int = BLOCK) -> torch.Tensor:
    """weight [N, K] (fp8 or int8) times its per-row scales [N] or its 2-D ones per `scale_rows` x 128 tile (128
    x 128 blocks, or int8's groups of 128 inputs), in `dtype`."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    launch(
        _dequantize_kernel, (triton.cdiv(n, 64), triton.cdiv(k, 128)),
        weight, weight_scale, out, n, k, weight.stride(0), weight_scale.stride(0), out.stride(0),
        BLOCK_N=64, BLOCK_K=128, BLOCK_SCALES=weight_scale.dim() == 2, SCALE_ROWS=scale_rows,
    )
    return out


@functools.cache
def blockwise_scaled_mm(device_index: int) -> bool:
    """Whether this torch build's _scaled_mm multiplies 1 x 128 activation groups by 128 x 128 weight
    blocks on this device (cuBLAS 12.9+ on sm90): one small product in exactly the layout fp8_linear
    passes, with the fewest and least aligned rows it passes (FEW_ROWS + 1), tells, at the first
    block-scaled product of more than FEW_ROWS rows (a warm-up call before graph capture makes it)."""
    device = torch.device("cuda", device_index)
    x = torch.ones(FEW_ROWS + 1, 2 * BLOCK, device=device, dtype=torch.bfloat16)
    weight = torch.ones(2 * BLOCK, 2 * BLOCK, device=device).to(FP8)
    weight_scale = torch.ones(2, 2, device=device)
    try:
        xq, scale_a = quantize_rows(x, BLOCK)
        scaled_mm(xq, weight.t(), scale_a, weight_scale.t(), x.dtype)
    except (RuntimeError, ValueError):
        return False
    return True


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """a @ b on fp8 tensor cores; the scaled forms want bfloat16 out, so float16 is one cast after."""
    y = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return y if dtype == torch.bfloat16 else y.to(dtype)


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, block_scales: bool) -> bool:
    """What torch._scaled_mm takes: CUDA, K and N multiples of 16 (of 128 for block scales, and a torch
    with block-scaled _scaled_mm)."""
    n, k = weight.shape
    if not x.is_cuda:
        return False
    if block_scales:
        return k % BLOCK == 0 and n % BLOCK == 0 and blockwise_scaled_mm(x.device.index or 0)
    return k % 16 == 0 and n % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, activated: bool = False,
               quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] (bfloat16/float16) @ dequantized fp8 weight [N, K]^T -> [M, N] in x's dtype; `activated` (N even):
    silu(y[:, :N/2]) * y[:, N/2:] of that product y, [M, N/2] (the MLP's gate and up projections with their
    activation), in the one-row kernel's epilogue, by the SiLU-and-mul kernel at other row counts.

    weight_scale: float32 [N] per output channel or [ceil(N/128), ceil(K/128)] per block. input_scale:
    a static per-tensor activation scale (float32, one element) used where a kernel of its own quantizes the
    activation (more than FEW_ROWS rows); without it activations are scaled per token or per 1 x 128 group.
    One row is multiplied unquantized; 2 to FEW_ROWS rows are quantized per 1 x 128 group in registers (per token
    where fp8_tma takes them); up to MMA_ROWS fp8_tma or fp8_mma multiplies the quantized rows,
    torch._scaled_mm more. `quantized`: x already quantized per token, (q, scale [M, 1]) as quantize_rows(x) makes
    them, used where the product would quantize x so (per-channel weights, no input_scale)."""
    _check(x, weight, weight_scale)
    block_scales = _block_scales(weight, weight_scale)
    x, weight_scale = x if x.stride(1) == 1 else x.contiguous(), weight_scale.contiguous()
    m, n = x.shape[0], weight.shape[0]
    if m == 0:
        return x.new_empty(0, n // 2 if activated else n)
    if m == 1:
        return fp8_gemv(x, weight, weight_scale, activated=activated)
    y = _rows_product(x, weight, weight_scale, input_scale, block_scales, quantized)
    return silu_mul(y) if activated else y


def _rows_product(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                  block_scales: bool, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fp8_linear of 2 or more rows (checked, contiguous); `quantized` as fp8_linear takes it."""
    m, k = x.shape
    if m <= FEW_ROWS and not tma_fits(x, weight, weight_scale):
        return fp8_mma(x, weight, weight_scale)
    if m > MMA_ROWS and not scaled_mm_fits(x, weight, block_scales):
        if block_scales:  # no block-scaled _scaled_mm: cuBLAS on the dequantized weight
            return torch.mm(x, dequantize(weight, weight_scale, x.dtype).t())
        return fp8_mma(x, weight, weight_scale)
    if input_scale is None and quantized is not None and not block_scales:
        xq, scale_a = quantized
    elif input_scale is None:
        xq, scale_a = quantize_rows(x, BLOCK if block_scales else None)
    else:
        xq = quantize_static(x, input_scale)
        groups = triton.cdiv(k, BLOCK) if block_scales else 1
        scale_a = input_scale.reshape(1, 1).expand(groups, m).contiguous().t()
    return quantized_product(xq, scale_a, weight, weight_scale, x.dtype)


def quantized_product(xq: torch.Tensor, scale_a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows xq [M, K] times their scales (float32 [M, 1] per row, or [M, K/128] per 1 x 128 group, column-major
    as quantize_rows makes them) @ the dequantized fp8 weight^T, in `dtype`: up to MMA_ROWS rows fp8_tma where it
    fits (per-row and per-channel scales on sm90+), else fp8_mma (a tiling of its own for every row count);
    torch._scaled_mm above."""
    if xq.shape[0] <= MMA_ROWS and scale_a.shape[1] == 1 and tma_fits(xq, weight, weight_scale):
        return fp8_tma(xq, scale_a, weight, weight_scale, dtype)
    if xq.shape[0] <= MMA_ROWS:
        return fp8_mma(xq, weight, weight_scale, x_scale=scale_a, out_dtype=dtype)
    scale_b = weight_scale.t() if weight_scale.dim() == 2 else weight_scale.view(1, -1)
    return scaled_mm(xq, weight.t(), scale_a, scale_b, dtype)


def fp8_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_scale: torch.Tensor,
            gate_up_input_scale: torch.Tensor | None, down_weight: torch.Tensor,
            down_scale: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fp8_linear(fp8_linear(x, gate_up_weight, ..., activated=True), down_weight, down_scale): the MLP's two
    products with the activation between, equal to them bit for bit. Where the down product quantizes its input
    in a kernel of its own (a dynamic scale, more than FEW_ROWS rows, or from 2 where both products take fp8_tma),
    that kernel computes the activation as it loads [gate | up], so silu(gate) * up is never written out and read
    back. `quantized`: x already quantized, for the gate/up product (fp8_linear)."""
    _check(x, gate_up_weight, gate_up_scale)
    block_scales = _block_scales(down_weight, down_scale)
    m = x.shape[0]
    # up to FEW_ROWS, one product off fp8_tma rounds its input in registers: then the two go apart, as written
    few = m <= FEW_ROWS and not (tma_fits(x, gate_up_weight, gate_up_scale) and tma_fits(x, down_weight, down_scale))
    if m == 1 or few or (m > MMA_ROWS and not scaled_mm_fits(x, down_weight, block_scales)):
        h = fp8_linear(x, gate_up_weight, gate_up_scale, gate_up_input_scale, activated=True, quantized=quantized)
        return fp8_linear(h, down_weight, down_scale)
    y = fp8_linear(x, gate_up_weight, gate_up_scale, gate_up_input_scale, quantized=quantized)
    _check(y[:, : y.shape[1] // 2], down_weight, down_scale)
    hq, scale_a = quantize_rows(y, BLOCK if block_scales else None, activated=True)
    return quantized_product(hq, scale_a, down_weight, down_scale.contiguous(), x.dtype)
