"""Split-K for the few-row weight kernels (fp8_linear.py, int4_linear.py).

At decode sizes a product is one pass over the weight, and a slab of output columns per program
gives too few programs to keep every multiprocessor's loads in flight (the 4096- and 6144-wide
projections have a few hundred slabs at most). So the K dimension is split too: programs over
N slabs x K splits, each split writing its float32 partial product to its own slice of a
[splits, M, N] buffer, and a second small kernel summing the slices in split order and casting
to the output dtype. That is chosen over float32 atomics into a zeroed buffer: the sum is the
same on every call (a replayed CUDA graph is bit-identical to the eager call), there is no
zeroing launch, and the cast the atomics would need afterwards is this kernel's store anyway.
With one split the product kernel stores its output directly and no second kernel runs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .launch import launch
from .pdl import pdl_on

RESIDENT = 4  # programs per multiprocessor the split count aims for
MIN_SPLIT_K = 512  # the fewest inputs a split covers, so that its loads still pipeline
PARTIAL_SHARE = 4  # the float32 partials are at most 1/PARTIAL_SHARE of the weight bytes
SUM_BLOCK = 1024


@triton.jit(do_not_specialize=["total", "splits"])
def _sum_splits_kernel(p_ptr, y_ptr, total, splits, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = sum over s of p[s, i], s in order, in y's dtype."""
    if PDL:
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    if PDL:  # the partials are the previous kernel's output
        gdc_wait()
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in range(1, splits):
        acc += tl.load(p_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


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


def output(m: int, n: int, splits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where the product kernel stores: y [M, N] itself for one split, else the [splits, M, N] float32 partials."""
    if splits == 1:
        return torch.empty(m, n, dtype=dtype, device=device)
    return torch.empty(splits, m, n, dtype=torch.float32, device=device)


def finish(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] from what `output` gave: itself, or the partials summed in split order."""
    if out.dim() == 2:
        return out
    splits, m, n = out.shape
    y = torch.empty(m, n, dtype=dtype, device=out.device)
    launch_pdl = pdl_on(out.device)
    launch(
        _sum_splits_kernel, (triton.cdiv(m * n, SUM_BLOCK),),
        out, y, m * n, splits, PDL=launch_pdl, BLOCK=SUM_BLOCK, num_warps=4, launch_pdl=launch_pdl,
    )
    return y
