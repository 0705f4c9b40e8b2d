"""A product's first weight bytes asked of L2 before it waits for its input.

A product launched with programmatic dependent launch (pdl.py) may start while the kernel before it
runs: its weights do not depend on that kernel, only its input does. So each program asks L2 for the
lines its loop will read first (`prefetch.global.L2`, which no instruction waits for) and only then
waits. While the kernels between products run (norms, RoPE, attention over short contexts) the memory
system is otherwise nearly idle, and at the end of a product its last programs leave most of it idle:
the next product's first bytes are read in those gaps instead of after them.

A launch asks for at most 1 / PREFETCH_SHARE of the device's L2 (50 MB on an H100 or H200), so the lines
are still there when the loop reaches them; what a product reads past them it reads as before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

PREFETCH_SHARE = 4
LINE_BYTES = 128
THREADS_PER_WARP = 32
REGISTERS_PER_SM = 65536


@triton.jit
def prefetch_lines(ptrs):
    """Ask L2 for the line of each address in `ptrs` (every one valid); the thread goes on at once."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(w_ptr, rows, row_mask, stride_w, k_first, k_stop, LINE: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for weight rows `rows` (where `row_mask`) from input `k_first` up to `k_stop`, LINE inputs a line,
    LINES lines a row at a time."""
    offsets = tl.arange(0, LINES) * LINE
    base = w_ptr + rows[:, None].to(tl.int64) * stride_w
    for k in range(k_first, k_stop, LINES * LINE):
        ks = k + offsets
        wanted = row_mask[:, None] & (ks < k_stop)[None, :]
        prefetch_lines(tl.where(wanted, base + ks[None, :], w_ptr))


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of a CUDA device, in bytes."""
    return _l2_bytes(device.index if device.index is not None else torch.cuda.current_device())


def prefetch_inputs(device: torch.device, programs: int, block_n: int, element_bytes: float, k_span: int) -> int:
    """How many of the `k_span` inputs a row that each of `programs` programs of `block_n` weight rows loads after
    its first step it asks of L2 first: 1 / PREFETCH_SHARE of the L2 shared among them, in whole lines."""
    per_row = l2_bytes(device) // PREFETCH_SHARE // max(1, programs * block_n)
    return max(0, min(k_span, per_row // LINE_BYTES * int(LINE_BYTES / element_bytes)))


def prefetch_lines_per_row(block_n: int, warps: int) -> int:
    """Lines a row in one round of `prefetch_rows`: one address a thread where the slab is narrower than the
    program's threads."""
    return triton.next_power_of_2(max(1, warps * THREADS_PER_WARP // block_n))


def one_wave_registers(programs: int, warps: int, sms: int) -> int | None:
    """A cap on registers a thread (a multiple of 8) under which all `programs` of `warps` warps are resident at
    once on `sms` multiprocessors, where one that leaves a thread at least 64 exists; else None. The
    prefetch's addresses lead ptxas to spend registers it does not need, which can cost such a grid its one wave."""
    per_sm = -(-programs // sms)
    cap = REGISTERS_PER_SM // (per_sm * warps * THREADS_PER_WARP) // 8 * 8
    return cap if 64 <= cap < 256 else None
