"""How a head's row lives in the paged KV cache, for the kernels that read and write it.

Head padding: a tile's head lanes are a power of two (at least 16, what `tl.dot` and `tl.arange`
take); a head_dim that is not one is padded to the next and its extra lanes masked on every load
and store. `lanes` is all true for a power of two, so those heads compile to the unmasked code.

fp8 cache (float8_e4m3fn): every (token, KV head) row of keys and of values has its own float32
scale, stored beside the cache: row = fp8(x / scale), scale = max|x| / 448. A scale per row needs
no calibration and follows each token's range (an outlier token or head costs only its own row's
precision); the kernels dequantize in registers by scaling a tile's logits (keys) or
probabilities (values) per row, which costs one multiply per tile element.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn
MIN_AMAX = tl.constexpr(1e-12)  # a row of zeros gets a tiny scale, not a division by zero


def head_pad(head_dim: int) -> int:
    """The power-of-two lane count of a head's tile: at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def lanes(dims, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Which of the tile's head lanes `dims` [HEAD_PAD] hold data; all, as a constant, when unpadded."""
    if HEAD_DIM == HEAD_PAD:
        return tl.full([HEAD_PAD], True, tl.int1)
    else:
        return dims < HEAD_DIM


@triton.jit
def fp8_scale(amax):
    """The scale that maps a row's largest magnitude `amax` onto FP8_MAX."""
    return tl.maximum(amax, MIN_AMAX) / FP8_MAX


@triton.jit
def to_fp8(x, scale):
    """x / scale as float8_e4m3fn, clamped to its finite range (rounding may overshoot by an ulp)."""
    return tl.clamp(x / scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv, fp_downcast_rounding="rtne")
