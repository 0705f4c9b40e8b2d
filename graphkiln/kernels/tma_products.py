"""Few-row weight products fed by tensor memory accelerator (TMA) copies, on sm90 and later: fp8 with scales
(`fp8_tma`) and 16-bit without (`tma_product`).

y [M, N] = (xq [M, K] times its scale per row) @ (weight [N, K] times its scale per output channel)^T, for M up
to TMA_ROWS rows of x already quantized to float8_e4m3fn (fp8_linear.quantize_rows, per token). A program owns
BLOCK_N weight rows over all of K. Each K step the copy engine brings a BLOCK_N x BLOCK_K tile of the weight and
the BLOCK_M x BLOCK_K tile of x into shared memory, STAGES steps ahead, and the tensor cores read both from there:
no thread computes an address or holds a tile in its registers on the way, which is where the pointer-fed kernel
(fp8_mma.py) spends its issue slots and registers at these sizes. With the bytes in flight that deep, one
program a slab streams its weight fast enough that the rule splits K (split_k.py: partials and a second pass over
them) only where the slabs leave most multiprocessors idle.

`tma_product` runs the same kernel on 16-bit x and weights (no scales), steps of the same bytes: graphkiln::linear
(models/linear.py) sends it the 16-bit products that `product_fits`, where it read the bench models' projections
faster than cuBLAS. With `activated` it applies the MLP's SiLU-and-mul to the gate and up products in its epilogue
(a benchmark candidate).

The weight's descriptor spans [N, K], x's [M, K]; boxes past either edge read zeros, so N, K and M need not be
multiples of the tiles. Descriptors are built at each call on the host: inside a CUDA graph they are captured with
the launch, and x's buffer is the graph's own.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch import launch
from .pdl import pdl_on
from .split_k import k_steps, multiprocessors, product_buffers, store_product

TMA_ROWS = 64  # the most rows of x one tile takes
TMA_MIN_N = 2048  # the narrowest weight measured faster here (32 slabs); narrower ones keep fp8_mma.py
ALIGN = 16  # bytes: what a descriptor's base address and row stride must be a multiple of
HOPPER_SHARED = 227 * 1024  # shared memory a program may take on an H100 or H200
HOPPER_SMS = 132  # multiprocessors of an H100 or H200
SHARED_RESERVE = 1024  # of it, left to the kernel's own barriers and scratch
SPLIT_ROW_BYTES = 16384  # the shortest weight row whose K the rule splits where few slabs leave multiprocessors idle


@triton.jit(do_not_specialize=["M", "STEPS"])  # one build for every row count up to BLOCK_M and every split
def _tma_kernel(w_desc, x_desc, xs_ptr, s_ptr, y_ptr, partials, counters, M, N, STEPS, stride_xs,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                SPLIT: tl.constexpr, SCALED: tl.constexpr, ACTIVATED: tl.constexpr, PDL: tl.constexpr):
    """y[M, N] (split_k.store_product) for one slab of BLOCK_N weight rows over a split of K (STEPS steps of
    BLOCK_K), x's rows on the narrow side of the tensor-core tile; SCALED: times the weight's scale per row and
    x's per row. ACTIVATED (unscaled, K unsplit): the slab is BLOCK_N gate rows and the up rows N after them (the
    weight holds 2N rows), and y is silu(gate) * up of the two products rounded to y's dtype, as gemv.silu_mul
    computes it from them."""
    n0 = tl.program_id(0) * BLOCK_N
    k0 = tl.program_id(2) * STEPS * BLOCK_K
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PDL:  # x is the previous kernel's output
        gdc_wait()
    for k in tl.range(k0, k0 + STEPS * BLOCK_K, BLOCK_K, num_stages=STAGES):
        x = tl.trans(x_desc.load([0, k]))
        acc = tl.dot(w_desc.load([n0, k]), x, acc)
        if ACTIVATED:
            up = tl.dot(w_desc.load([N + n0, k]), x, up)
    cols = n0 + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_mask = cols < N
    row_mask = rows < M
    if SCALED:
        acc = acc * tl.load(s_ptr + cols, mask=col_mask, other=0.0)[:, None]
        acc = acc * tl.load(xs_ptr + rows * stride_xs, mask=row_mask, other=0.0)[None, :]
    if ACTIVATED:
        gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up.to(y_ptr.dtype.element_ty).to(tl.float32)
    store_product(y_ptr, partials, counters, acc, rows[None, :].to(tl.int64) * N + cols[:, None],
                  col_mask[:, None] & row_mask[None, :], M.to(tl.int64) * N, SPLIT)


@functools.cache
def _device(device_index: int) -> tuple[bool, int]:
    """(whether it has TMA: sm90+, the shared memory a program may take) of a CUDA device."""
    from triton.runtime import driver

    shared = driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
    return torch.cuda.get_device_capability(device_index)[0] >= 9, shared


def _properties(device: torch.device) -> tuple[bool, int]:
    """`_device` of a CUDA tensor's device."""
    return _device(device.index if device.index is not None else torch.cuda.current_device())


def has_tma(device: torch.device) -> bool:
    """Whether `device` is a CUDA device with TMA copies (sm90+)."""
    return device.type == "cuda" and _properties(device)[0]


def shared_bytes(device: torch.device) -> int:
    """The shared memory a program may take on `device`; an H100's off CUDA (the interpreter)."""
    return _properties(device)[1] if device.type == "cuda" else HOPPER_SHARED


def tma_takes(m: int, n: int, k: int, shared: int = HOPPER_SHARED, sms: int = HOPPER_SMS, itemsize: int = 1) -> bool:
    """Whether an sm90+ GPU with `shared` bytes of shared memory a program and `sms` multiprocessors sends m rows
    of x times a weight [n, k] of `itemsize`-byte elements (a per-channel fp8 weight to `fp8_tma`, a 16-bit one to
    `tma_product`) to the kernel: 2 to TMA_ROWS rows, at least TMA_MIN_N weight rows (where it was measured
    faster), rows of a multiple of 16 bytes, and room for two steps of its tiles."""
    return (2 <= m <= TMA_ROWS and n >= TMA_MIN_N and k * itemsize % ALIGN == 0
            and tma_tiling(m, n, k, shared, sms, itemsize)[5] >= 2)


def _aligned(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor's rows are contiguous and start on ALIGN bytes, as a descriptor reads them."""
    return t.stride(1) == 1 and t.stride(0) * t.element_size() % ALIGN == 0 and t.data_ptr() % ALIGN == 0


def tma_fits(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether `fp8_tma` takes x's rows times this weight (`tma_takes`; x [M, K] as the weight's K): CUDA with TMA
    (sm90+), an fp8 weight with one scale per output channel whose rows start 16-byte aligned."""
    if not has_tma(x.device) or weight.dtype != torch.float8_e4m3fn or weight_scale.dim() != 1:
        return False
    return _aligned(weight) and _takes_here(x, weight)


def product_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `tma_product` takes x [M, K] times this weight [N, K]: CUDA with TMA (sm90+), both bfloat16 or both
    float16, rows that start 16-byte aligned, and `tma_takes` of the shapes."""
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or not has_tma(x.device):
        return False
    return x.dim() == 2 and _aligned(x) and _aligned(weight) and _takes_here(x, weight)


def _takes_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`tma_takes` of x's rows times this weight, with its element size, on x's device."""
    return tma_takes(x.shape[0], weight.shape[0], weight.shape[1], shared_bytes(x.device), multiprocessors(x.device),
                     weight.element_size())


def tma_tiling(m: int, n: int, k: int, shared: int = HOPPER_SHARED, sms: int = HOPPER_SMS,
               itemsize: int = 1, activated: bool = False) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages) for m rows of x times n weight rows of k `itemsize`-byte
    elements: 64-row slabs on 4 warps. The stages follow the waves: where the slabs outnumber the `sms`
    multiprocessors, 256-byte steps and as few stages (up to 4) as let two programs share one, so the last wave is
    half as long; where they fit in one wave, up to 6 steps of 256 bytes as deep as `shared` bytes hold, or at up
    to 32 rows up to 4 of 512 bytes. Where so few slabs leave three quarters of the multiprocessors idle and a row
    of the weight is 16 KiB or more, K is split in two (split_k.py). Each choice was the fastest of the sweeps on
    the 1B- and 8B-like projections and measured faster in the whole models (README, "Quantized weights").
    `activated`: a slab's 64 gate rows bring their 64 up rows (n / 2 outputs), K never split."""
    block_m, block_n = max(16, triton.next_power_of_2(m)), 64
    slab_rows, slabs = (2 * block_n, triton.cdiv(n // 2, block_n)) if activated else (block_n, triton.cdiv(n, block_n))
    room = (shared - SHARED_RESERVE) // ((block_m + slab_rows) * 256)  # 256-byte steps one program's memory holds
    if slabs > sms:
        return block_m, block_n, 256 // itemsize, 1, 4, min(4, room // 2) if room // 2 >= 3 else min(6, room)
    splits = 2 if slabs * 4 <= sms and k * itemsize >= SPLIT_ROW_BYTES and not activated else 1
    if m <= 32 and splits == 1:  # steps twice as wide: half as many fit
        return block_m, block_n, 512 // itemsize, 1, 4, min(4, room // 2)
    return block_m, block_n, 256 // itemsize, splits, 4, min(6, room)


def fp8_tma(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            out_dtype: torch.dtype, tiles: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """xq [M, K] float8_e4m3fn (contiguous) times x_scale (float32 [M, 1], one a row) @ the weight [N, K]
    float8_e4m3fn times weight_scale (float32 [N], contiguous)^T, in `out_dtype`; where `tma_fits`. `tiles`
    defaults to `tma_tiling`."""
    return _launch(xq, weight, (x_scale, weight_scale), out_dtype, tiles)


def tma_product(x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int, int, int, int] | None = None,
                activated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype, both bfloat16 or float16 (contiguous rows, 16-byte aligned), up to
    TMA_ROWS rows on sm90+ (`product_fits`): the TMA-fed kernel without scales. `tiles` defaults to `tma_tiling`
    for 2-byte elements. `activated` (N even, K unsplit): silu(y[:, :N/2]) * y[:, N/2:] in the product's
    epilogue, equal to gemv.silu_mul of the product (a benchmark candidate beside the two launches)."""
    return _launch(x, weight, None, x.dtype, tiles, activated)


def _launch(x: torch.Tensor, weight: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
            out_dtype: torch.dtype, tiles: tuple[int, int, int, int, int, int] | None,
            activated: bool = False) -> torch.Tensor:
    """The kernel on x [M, K] and weight [N, K] of one element type; `scales` (x's [M, 1], the weight's [N]) or
    none; `activated` as `tma_product`'s."""
    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, block_k, splits, warps, stages = tiles or tma_tiling(
        m, n, k, shared_bytes(x.device), multiprocessors(x.device), x.element_size(), activated)
    splits, steps = k_steps(k, splits, block_k)
    if activated and (scales is not None or splits > 1 or n % 2):
        raise ValueError("the activated product takes an unscaled weight of an even row count, K unsplit")
    width = n // 2 if activated else n
    grid = (triton.cdiv(width, block_n), 1, splits)
    y, partials, counters = product_buffers(m, width, grid, out_dtype, x.device)
    w_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [block_n, block_k])
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, block_k])
    x_scale, weight_scale = scales if scales is not None else (y, y)  # placeholders without SCALED
    launch_pdl = pdl_on(x.device)
    launch(
        _tma_kernel, grid,
        w_desc, x_desc, x_scale, weight_scale, y, partials, counters, m, width, steps, x_scale.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT=splits > 1,
        SCALED=scales is not None, ACTIVATED=activated, PDL=launch_pdl, num_warps=warps, num_stages=stages,
        launch_pdl=launch_pdl,
    )
    return y
