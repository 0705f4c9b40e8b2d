"""How a head's row lives in the paged KV cache, for the kernels that read and write it.

Head padding: a tile's head lanes are a power of two (at least 16, what `tl.dot` and `tl.arange`
take); a head_dim that is not one is padded to the next and its extra lanes masked on every load
and store. `lanes` is all true for a power of two, so those heads compile to the unmasked code.

fp8 cache (float8_e4m3fn): every (token, KV head) row of keys and of values has its own float32
scale, stored beside the cache: row = fp8(x / scale), scale = max|x| / 448. A scale per row needs
no calibration and follows each token's range (an outlier token or head costs only its own row's
precision); the kernels dequantize in registers by scaling a tile's logits (keys) or
probabilities (values) per row, which costs one multiply per tile element.

The decode kernels dot an fp8 tile in float16, not in the query's bfloat16: e4m3 widens to float16
exactly and in fewer instructions. The query goes to float16 divided by a power of two per head
(`dot_query`), so any bfloat16 magnitude fits, and the probabilities times the values' scales are
taken over the tile's largest scale, so they lie in [0, 1] and small scales do not fall into
float16's subnormals.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn
MIN_AMAX = tl.constexpr(1e-12)  # a row of zeros gets a tiny scale, not a division by zero
MIN_TILE_SCALE = tl.constexpr(1e-30)  # a tile's largest value scale where it has no rows (a padded head)


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
def dot_query(q, AXIS: tl.constexpr, F32: tl.constexpr):
    """(q_dot, unit): q in the dtype of the dots with fp8 rows (float32 for a float32 query, else float16) and
    the power of two per head (along AXIS, the head lanes) that it was divided by, so that its largest
    magnitude is at most 2^14; q = q_dot * unit exactly, down to float16's subnormals."""
    amax = tl.max(tl.abs(q.to(tl.float32)), AXIS)
    unit = tl.exp2(tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0))) - 14.0, 0.0))
    dtype: tl.constexpr = tl.float32 if F32 else tl.float16
    return (q.to(tl.float32) / tl.expand_dims(unit, AXIS)).to(dtype), unit


@triton.jit
def to_fp8(x, scale):
    """x / scale as float8_e4m3fn, clamped to its finite range (rounding may overshoot by an ulp)."""
    return tl.clamp(x / scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv, fp_downcast_rounding="rtne")
