"""Triton kernel that scatters a batch's new keys and values into one layer's paged cache.

Heads of any size up to 256 are padded to a power of two in registers and masked on load and
store; an fp8 cache gets each (token, head) row quantized with its own scale (kv_format.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_format import fp8_scale, head_pad, lanes, to_fp8
from .launch import launch


@triton.jit
def _write_rows(src, dst, scales, heads, mask, NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr):
    """One token's rows [heads, lanes] of keys or values from pointers `src` to `dst` (and their scales)."""
    x = tl.load(src, mask=mask)
    if FP8:
        x = x.to(tl.float32)
        scale = fp8_scale(tl.max(tl.where(mask, tl.abs(x), 0.0), 1))
        tl.store(dst, to_fp8(x, scale[:, None]), mask=mask)
        tl.store(scales + heads, scale, mask=heads < NUM_KV_HEADS)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, k_scales, v_scales, slot_mapping,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & lanes(dims, HEAD_DIM, HEAD_PAD)[None, :]
    dst = slot * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    scale_at = slot * NUM_KV_HEADS
    _write_rows(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, k_cache + dst,
                k_scales + scale_at, heads, mask, NUM_KV_HEADS, FP8)
    _write_rows(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, v_cache + dst,
                v_scales + scale_at, heads, mask, NUM_KV_HEADS, FP8)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write rows k/v [T, Hkv, D] to slots slot_mapping[:T] of caches [num_blocks, block_size, Hkv, D]; an fp8
    cache comes with its `scales`, float32 [num_blocks, block_size, Hkv] for keys and values."""
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    slots_k = k_cache.view(-1, heads, dim)
    slots_v = v_cache.view(-1, heads, dim)
    k_scales, v_scales = scales if scales is not None else (slots_k, slots_v)
    launch(
        _write_kv_kernel, (tokens,),
        k, v, slots_k, slots_v, k_scales, v_scales, slot_mapping,
        *k.stride(), *v.stride(),
        slots_k.stride(0), slots_k.stride(1),
        NUM_KV_HEADS=heads, BLOCK_HEADS=triton.next_power_of_2(heads), HEAD_DIM=dim, HEAD_PAD=head_pad(dim),
        FP8=scales is not None,
    )
