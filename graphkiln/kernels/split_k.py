"""Split-K for the few-row weight kernels (fp8_linear.py, fp8_mma.py, int4_linear.py, int4_words.py, int4_dp4a.py).

At decode sizes a product is one pass over the weight, and a slab of output columns per program
gives too few programs to keep every multiprocessor's loads in flight (the 4096- and 6144-wide
projections have a few hundred slabs at most). So the K dimension is split too: programs over
N slabs x K splits, each split storing its float32 partial product in its own slice of a
[splits, M, N] buffer and counting itself done on its output tile's counter (`store_product`);
the last of a tile's splits to count sums the slices in split order, casts to the output dtype
and sets the counter back to zero. That is chosen over float32 atomics into a zeroed buffer: the
sum is the same on every call (a replayed CUDA graph is bit-identical to the eager call), and
there is no zeroing launch. It is chosen over a second kernel summing the slices, as before: that
launch waited for the whole product and made the next kernel wait for it.

The counters are one zeroed int32 buffer a device (`split_counters`), shared by every product:
each launch leaves it at zero, and the products on a device run one after another (kernels that
launch early, kernels/pdl.py, count only after waiting for the kernel before them to finish).
With one split the product kernel stores its output directly and counts nothing.
"""

from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl

RESIDENT = 4  # programs per multiprocessor the split count aims for
MIN_SPLIT_K = 512  # the fewest inputs a split covers, so that its loads still pipeline
PARTIAL_SHARE = 4  # the float32 partials are at most 1/PARTIAL_SHARE of the weight bytes
COUNTERS = 1 << 16  # counters a device's buffer holds at least

_counters: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # buffers outgrown: captured graphs may still count on them
_counters_lock = threading.Lock()


@triton.jit
def store_product(y_ptr, partials, counters, value, offsets, mask, total, SPLIT: tl.constexpr):
    """Store a program's float32 `value` of y at `offsets` (of y [M, N], contiguous; `total` = M * N) under
    `mask`: cast to y's dtype where K is not split (SPLIT false); else in its split's slice of the partials
    [splits, M, N], and the last of its output tile's splits to count on `counters` sums the slices in split
    order into y and sets the tile's counter back to zero. Every program of a launch calls it once, on a grid of
    (slabs, row tiles, splits), as `product_buffers` counts the tiles."""
    if SPLIT:
        split, splits = tl.program_id(2), tl.num_programs(2)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.store(partials + split.to(tl.int64) * total + offsets, value, mask=mask)
        tl.debug_barrier()  # every thread's slice is stored before the count (acq_rel, GPU scope) releases it
        if tl.atomic_add(counters + tile, 1) == splits - 1:
            tl.store(counters + tile, 0)
            acc = tl.load(partials + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):  # past L1, which other programs' stores do not update
                acc += tl.load(partials + s * total + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + offsets, value.to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 132 (an H100/H200) elsewhere, so that the interpreter
    on the CPU picks the tiles the GPU would."""
    if device.type != "cuda":
        return 132
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def split_count(programs: int, k: int, block_k: int, partial_bytes: int, weight_bytes: int, sms: int,
                resident: int = RESIDENT) -> int:
    """The fewest K splits (a power of two) that bring `programs` (slabs x row tiles) to `resident` per
    multiprocessor, with each split at least MIN_SPLIT_K inputs (and one K step) and all the partials
    (`partial_bytes` a split) within 1/PARTIAL_SHARE of the weight bytes; fewer where the K steps do not
    share evenly among them (`k_steps`)."""
    most = max(1, min(k // max(MIN_SPLIT_K, block_k), weight_bytes // (PARTIAL_SHARE * partial_bytes)))
    splits = 1
    while programs * splits < resident * sms and 2 * splits <= most:
        splits *= 2
    return k_steps(k, splits, block_k)[0]


def k_steps(k: int, splits: int, block_k: int) -> tuple[int, int]:
    """(splits, K steps a split): the most splits up to `splits` that share the K steps evenly, so that every
    split runs the same loop and every step lies inside one scale block or group."""
    steps = triton.cdiv(k, block_k)
    splits = max(d for d in range(1, min(splits, steps) + 1) if steps % d == 0)
    return splits, steps // splits


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's zeroed int32 counters, at least `tiles` of them (module docstring). A buffer is kept for the
    process's life: a graph captured with it keeps its address."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _counters_lock:
        buffer = _counters.get(device)
        if buffer is None or buffer.numel() < tiles:
            if buffer is not None:
                _retired.append(buffer)
            buffer = _counters[device] = torch.zeros(max(tiles, COUNTERS), dtype=torch.int32, device=device)
        return buffer


def product_buffers(m: int, n: int, grid: tuple[int, int, int], dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [M, N], the [splits, M, N] float32 partials, the counters) for a product kernel's `store_product` on
    `grid` = (slabs, row tiles, splits); with one split y stands in for the other two, which are not read."""
    y = torch.empty(m, n, dtype=dtype, device=device)
    slabs, row_tiles, splits = grid
    if splits == 1:
        return y, y, y
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=device)
    return y, partials, split_counters(device, slabs * row_tiles)
