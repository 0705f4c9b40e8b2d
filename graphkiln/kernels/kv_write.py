"""Triton kernel that scatters a batch's new keys and values into one layer's paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < NUM_KV_HEADS)[:, None]
    dst = slot * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write rows k/v [T, Hkv, D] to slots slot_mapping[:T] of caches [num_blocks, block_size, Hkv, D]."""
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    slots_k = k_cache.view(-1, heads, dim)
    slots_v = v_cache.view(-1, heads, dim)
    _write_kv_kernel[(tokens,)](
        k, v, slots_k, slots_v, slot_mapping,
        *k.stride(), *v.stride(),
        slots_k.stride(0), slots_k.stride(1),
        NUM_KV_HEADS=heads, BLOCK_HEADS=triton.next_power_of_2(heads), HEAD_DIM=dim,
    )
