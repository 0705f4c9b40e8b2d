"""Varlen causal attention over packed sequences whose keys and values live in the paged cache.

Sequence i contributes query_len new tokens at the end of a context of seq_len tokens; its query
token j sits at position seq_len - query_len + j and attends keys 0..that position (the cached
prefix and the new tokens, all read from the cache after the write). A work item is a (sequence,
first query row) tile planned on the host; the work table's first row holds how many there are.
Program (p, head) takes items p, p + P, p + 2P, ... of the P programs per head, so a captured graph
launches a fixed, small grid whatever batch a replay brings: a grid of one program per item it
could ever hold would fill the SMs with idle programs.
Key tiles wholly below the tile's first position skip the causal mask. Heads of any size up to
256 and the fp8 cache read as in decode_attention.py (kv_format.py).

A program may take HEADS query heads of one KV head's group at once: its tile's rows are the BLOCK_M
tokens' heads, token by token (BLOCK_M x HEADS rows), so each key and value tile it loads serves
every one of those heads instead of being loaded again per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import load_row_scales, load_rows, paged_rows
from .kv_format import head_pad, lanes
from .launch import launch


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache, v_cache, k_scales, v_scales, table_row, tile, kv_end, q_pos, kv_head, scale_log2,
    stride_cb, stride_ct, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    pos = tile + tl.arange(0, BLOCK_N)
    valid = pos < kv_end
    rows = paged_rows(table_row, pos, valid, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
    k = load_rows(k_cache, rows, valid, HEAD_DIM, HEAD_PAD)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
    if FP8:
        qk = qk * load_row_scales(k_scales, rows, valid, HEAD_DIM)[None, :]
    if CAUSAL:
        qk = tl.where(pos[None, :] <= q_pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)  # the scale is positive: max(qk) * scale is max(qk * scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * scale_log2 - m_new[:, None])  # one fused multiply-add an element
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_rows(v_cache, rows, valid, HEAD_DIM, HEAD_PAD)
    if FP8:
        p = p * load_row_scales(v_scales, rows, valid, HEAD_DIM)[None, :]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_item(
    q_ptr, k_cache, v_cache, k_scales, v_scales, out_ptr, item_ptr, query_start, seq_lens, block_tables, scale_log2,
    first_head, kv_head, stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od, stride_cb, stride_ct,
    stride_ch, stride_bt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEADS: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """HEADS query heads from `first_head` of one work item: its rows attend their causal keys."""
    seq = tl.load(item_ptr)
    tile_start = tl.load(item_ptr + 1)
    q_begin = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_begin
    context = tl.load(seq_lens + seq) - q_len

    r = tl.arange(0, BLOCK_M * HEADS)
    rows = tile_start + r // HEADS  # each tile row: a query token's row in its sequence, and a head
    heads = first_head + r % HEADS
    tokens = (q_begin + rows).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    row_mask = (rows < q_len)[:, None] & lanes(dims, HEAD_DIM, HEAD_PAD)[None, :]
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_mask, other=0.0)
    q_pos = context + rows
    table_row = block_tables + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M * HEADS], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * HEADS], tl.float32)
    acc = tl.zeros([BLOCK_M * HEADS, HEAD_PAD], tl.float32)
    full_end = (context + tile_start + 1) // BLOCK_N * BLOCK_N
    for tile in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_cache, v_cache, k_scales, v_scales, table_row, tile,
                                     full_end, q_pos, kv_head, scale_log2, stride_cb, stride_ct, stride_ch,
                                     BLOCK_SIZE, HEAD_DIM, HEAD_PAD, BLOCK_N, False, PRECISION, FP8)
    kv_end = context + tl.minimum(tile_start + BLOCK_M, q_len)
    for tile in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_cache, v_cache, k_scales, v_scales, table_row, tile,
                                     kv_end, q_pos, kv_head, scale_log2, stride_cb, stride_ct, stride_ch,
                                     BLOCK_SIZE, HEAD_DIM, HEAD_PAD, BLOCK_N, True, PRECISION, FP8)

    acc = acc / l_i[:, None]
    dst = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["stride_bt"])  # the table width varies per eager batch: one build
def _prefill_kernel(
    q_ptr, k_cache, v_cache, k_scales, v_scales, out_ptr, work, query_start, seq_lens, block_tables, scale_log2,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_ct, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    first_head = tl.program_id(1) * HEADS
    kv_head = first_head // GROUP
    num_items = tl.load(work)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        _attend_item(q_ptr, k_cache, v_cache, k_scales, v_scales, out_ptr, work + 2 + 2 * item, query_start, seq_lens,
                     block_tables, scale_log2, first_head, kv_head, stride_qt, stride_qh, stride_qd, stride_ot,
                     stride_oh, stride_od, stride_cb, stride_ct, stride_ch, stride_bt, BLOCK_SIZE, HEAD_DIM, HEAD_PAD,
                     BLOCK_M, BLOCK_N, HEADS, PRECISION, FP8)


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, work: torch.Tensor, out: torch.Tensor, scale: float,
    programs: int, *, block_m: int, block_n: int, num_warps: int, num_stages: int, heads: int = 1,
    max_registers: int = 0, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Causal attention for every (sequence, query tile of `block_m` tokens) of the work table, all query heads,
    `heads` of a KV head's group a program (a power of two that divides the group), at most `max_registers` a
    thread where given.

    work: int32 [1 + capacity, 2], row 0 (number of items, 0), then the items; `programs` per head
    group share them. An fp8 cache (contiguous) comes with `scales` as in paged_decode.
    """
    num_heads, head_dim = q.shape[1:]
    group = num_heads // k_cache.shape[2]
    if group % heads or heads & (heads - 1):
        raise ValueError(f"heads={heads} a program: a power of two that divides the {group} query heads a KV head")
    k_scales, v_scales = scales if scales is not None else (k_cache, v_cache)
    launch(
        _prefill_kernel, (programs, num_heads // heads),
        q, k_cache, v_cache, k_scales, v_scales, out, work, query_start, seq_lens, block_tables,
        scale * 1.4426950408889634, *q.stride(), *out.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        HEAD_PAD=head_pad(head_dim), BLOCK_M=block_m, BLOCK_N=block_n, HEADS=heads,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=scales is not None,
        num_warps=num_warps, num_stages=num_stages, maxnreg=max_registers or None,
    )
