"""Paged flash-decoding in one launch: one query token per sequence, split-K over long contexts.

Grid (kv_head, split, sequence): each program loads one KV head's tiles of its split once and
attends all query heads of that head's GQA group (padded to 16 rows for tensor cores). Lengths
and block tables are read from device memory, so a launch can be captured in a CUDA graph and
replayed with new lengths. The grid has the planned splits; a sequence uses as many as it has
tiles, at most all, and the rest exit at once, except that a sequence of at most `unsplit_tiles`
tiles runs in one split: reading its few tiles one after the other costs less than the merge of
one-tile splits. A sequence that one split covers is written directly. Otherwise every split
stores its partial result and log-sum-exp, then counts itself done on a per-(sequence, KV head)
counter; the last one merges the partials, writes the output and resets the counter to zero for
the next launch.

With programmatic dependent launch (kernels/pdl.py) a program loads its first cached tile, the new row's slot and
(rotating q and k itself) its position's cos and sin, none of which a kernel of the step writes, while the kernel
before it (rope, or the qkv projection) drains, and the next kernel may launch once every program began.

The step's new key and value (the context's last position) come from the projections, not the
cache: split 0 of each (sequence, KV head) stores them into their slot, and the split that holds
the last position starts its online softmax from them (new_row_state), while every tile leaves
that position out. So the cache write needs no launch of its own, no split reads a slot while it
is written, and the tiles reach the dots as loaded: putting the new row into a tile held each tile
in registers and converted its layout, which cost more registers than the rest of the loop.

With `rope` (the table and positions of models/rope.py) q and the new key arrive as the projection wrote them and
each program rotates its own as it loads them (load_halves, rotate), as the rope kernel would have before it: that
kernel's launch, and its wait in the chain of launches, go (passes/rope_attention.py).

Any head_dim up to 256 (tiles padded to a power of two) and an fp8 cache with per-row scales
(kv_format.py): an fp8 step quantizes its new key and value in registers and attends them as
stored, so a decode step sees what a later prefill will read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .kv_format import MIN_TILE_SCALE, dot_query, fp8_scale, head_pad, lanes, to_fp8
from .launch import launch
from .pdl import pdl_on


@triton.jit
def paged_rows(table_row, pos, valid, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE: tl.constexpr):
    """The element offsets [N] of rows `pos` of one KV head in a paged cache [num_blocks, BLOCK_SIZE, Hkv, D]
    (0 where not `valid`): a tile's keys and values share them."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch


@triton.jit
def load_rows(cache, rows, valid, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """The [N, HEAD_PAD] tile at row offsets `rows` (paged_rows), zeros in padded lanes and invalid rows."""
    dims = tl.arange(0, HEAD_PAD)
    mask = valid[:, None] & lanes(dims, HEAD_DIM, HEAD_PAD)[None, :]
    return tl.load(cache + rows[:, None] + dims[None, :], mask=mask, other=0.0)


@triton.jit
def load_row_scales(scales, rows, valid, HEAD_DIM: tl.constexpr):
    """The fp8 scales [N] at row offsets `rows` (paged_rows) of a contiguous cache: scales [num_blocks,
    BLOCK_SIZE, Hkv] at the row offset / HEAD_DIM; 0 where not `valid`."""
    return tl.load(scales + rows // HEAD_DIM, mask=valid, other=0.0)


@triton.jit
def load_kv_tile(k_cache, v_cache, k_scales, v_scales, table_row, tile, end, last, kv_head, stride_cb, stride_ct,
                 stride_ch, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_PAD: tl.constexpr, FP8: tl.constexpr):
    """Which rows of the tile from `tile` on are cached positions (short of `end`, not `last`, which is the
    step's new key and value: new_row_state), their keys and values (zeros elsewhere) and their fp8 scales
    (unused placeholders without FP8)."""
    pos = tile + tl.arange(0, BLOCK_N)
    cached = (pos < end) & (pos != last)
    rows = paged_rows(table_row, pos, cached, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
    k = load_rows(k_cache, rows, cached, HEAD_DIM, HEAD_PAD)
    v = load_rows(v_cache, rows, cached, HEAD_DIM, HEAD_PAD)
    k_scale = pos
    v_scale = pos
    if FP8:
        k_scale = load_row_scales(k_scales, rows, cached, HEAD_DIM)
        v_scale = load_row_scales(v_scales, rows, cached, HEAD_DIM)
    return cached, k, v, k_scale, v_scale


@triton.jit
def merge_splits(part_out, part_lse, out_row, first_head, first_part, num_splits, active, stride_oh, stride_od,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                 CHUNK: tl.constexpr):
    """Write the output of GROUP heads from `first_head` on: the `active` partials of each, weighted by
    their log-sum-exps. The GROUP heads' partials load together, CHUNK splits at a time, so the merge waits
    on one round trip a chunk rather than one a head: it is the end of the chain that every split step
    waits on. Partials are read past L1, which other programs' stores do not update."""
    g = tl.arange(0, GROUP_PAD)
    splits = tl.arange(0, CHUNK)
    dims = tl.arange(0, HEAD_PAD)
    first_of_head = (first_part + g)[:, None] * num_splits
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for chunk in range(0, active, CHUNK):
        part = first_of_head + chunk + splits[None, :]
        used = (g < GROUP)[:, None] & (chunk + splits < active)[None, :]
        partial = tl.load(part_out + part[:, :, None] * HEAD_PAD + dims[None, None, :], mask=used[:, :, None],
                          other=0.0, cache_modifier=".cg")
        lse = tl.load(part_lse + part, mask=used, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded heads: no split, weight 0
        alpha = tl.exp2(m - m_safe)
        weight = tl.exp2(lse - m_safe[:, None])
        total = total * alpha + tl.sum(weight, 1)
        acc = acc * alpha[:, None] + tl.sum(partial * weight[:, :, None], 1)
        m = m_new
    result = acc / tl.where(g < GROUP, total, 1.0)[:, None]
    mask = (g < GROUP)[:, None] & lanes(dims, HEAD_DIM, HEAD_PAD)[None, :]
    tl.store(out_row + (first_head + g)[:, None] * stride_oh + dims[None, :] * stride_od,
             result.to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def load_halves(x_base, stride, dims, mask, HALF: tl.constexpr):
    """x [..., HEAD_PAD] at x_base + dims * stride and its halves swapped (x[d + HALF] in the first half,
    x[d - HALF] in the second): what `rotate` takes. Both loads are issued together, so the rotation waits on
    one round trip, not two."""
    x = tl.load(x_base + dims * stride, mask=mask, other=0.0)
    swapped = tl.load(x_base + tl.where(dims < HALF, dims + HALF, dims - HALF) * stride, mask=mask, other=0.0)
    return x, swapped


@triton.jit
def rotate(x, swapped, dims, cos, sin, HALF: tl.constexpr):
    """x [..., HEAD_PAD] rotated by its position's cos and sin [HEAD_PAD] (`swapped` from load_halves):
    x * cos - x[d + HALF] * sin in the first half, x * cos + x[d - HALF] * sin in the second, in float32 and
    rounded once to x's dtype, as kernels/rope.py computes it."""
    x32 = x.to(tl.float32)
    swapped = swapped.to(tl.float32)
    return tl.where(dims < HALF, x32 * cos - swapped * sin, x32 * cos + swapped * sin).to(x.dtype)


@triton.jit
def new_row_state(q, k_new, v_new, k_new_scale, v_new_scale, holds_last, scale_log2, q_unit, FP8: tl.constexpr):
    """The online-softmax state (m_i, l_i, acc) of a split before its first tile: the step's new key and value
    (the last position) attended alone where the split `holds_last`, nothing otherwise. The tiles then leave
    that position out, so they reach the dots as loaded, with no row put in. q is [..., G, D] (G query rows
    a KV head); k_new, v_new broadcast against it ([..., 1, D]); q_unit, k_new_scale against its logits
    [..., G], v_new_scale against v_new."""
    logit = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), len(q.shape) - 1) * scale_log2
    value = v_new.to(tl.float32)
    if FP8:
        logit = logit * q_unit * k_new_scale
        value = value * v_new_scale
    m_i = tl.where(holds_last, logit, float("-inf"))
    l_i = tl.where(holds_last, 1.0, 0.0) + tl.zeros(logit.shape, tl.float32)
    acc = tl.where(holds_last, value, 0.0) + tl.zeros(q.shape, tl.float32)
    return m_i, l_i, acc


@triton.jit
def attend_tile(q, k, v, k_scale, v_scale, cached, m_i, l_i, acc, scale_log2, q_unit, PRECISION: tl.constexpr,
                FP8: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) with one tile of keys and values, of which the `cached` rows
    count. With FP8 (q from `dot_query`, divided by q_unit per head) each row's logit and probability are
    scaled by its key's and value's scale."""
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
    if FP8:
        qk = qk * (scale_log2 * q_unit)[:, None] * k_scale[None, :]
    else:
        qk = qk * scale_log2
    qk = tl.where(cached[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    if FP8:
        v_max = tl.maximum(tl.max(v_scale, 0), MIN_TILE_SCALE)
        weights = p * (v_scale / v_max)[None, :]
        pv = tl.dot(weights.to(q.dtype), v.to(q.dtype), input_precision=PRECISION) * v_max
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["stride_bt"])  # the table width varies per eager batch: one build
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, k_cache, v_cache, k_scales, v_scales, seq_lens, block_tables, slot_mapping, out_ptr, part_out,
    part_lse, counters, rope_table, positions, scale_log2, num_splits, unsplit_tiles,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od, stride_cb, stride_ct, stride_ch, stride_bt, stride_rope,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    seq_len = tl.load(seq_lens + seq)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.where(tiles <= unsplit_tiles, tiles, tl.cdiv(tiles, num_splits))
    active = tl.cdiv(tiles, tiles_per_split)
    if split < active:
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
        table_row = block_tables + seq.to(tl.int64) * stride_bt
        last = seq_len - 1
        # The cached positions before the last were written by earlier steps, never by the kernels
        # this one may overlap: the first tile loads before waiting for q, k and v.
        cached, k, v, k_scale, v_scale = load_kv_tile(
            k_cache, v_cache, k_scales, v_scales, table_row, start, end, last, kv_head, stride_cb, stride_ct,
            stride_ch, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_PAD, FP8)
        dims = tl.arange(0, HEAD_PAD)
        dim_mask = lanes(dims, HEAD_DIM, HEAD_PAD)
        slot = tl.load(slot_mapping + seq).to(tl.int64)  # where the new key and value go (split 0 stores them)
        cos = scale_log2  # placeholders without ROPE
        sin = scale_log2
        if ROPE:  # cos then sin of this token's position, a row of the static table; positions are a step's input
            rope_row = rope_table + tl.load(positions + seq).to(tl.int64) * stride_rope
            cos = tl.load(rope_row + dims, mask=dim_mask, other=0.0).to(tl.float32)
            sin = tl.load(rope_row + HEAD_DIM + dims, mask=dim_mask, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
        # A load issued after a layout conversion's barrier waits for the loads before it: with ROPE the rotation
        # uses q, k and their swapped halves together, so all five are issued before the first barrier.
        h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + h
        head_mask = (h < GROUP)[:, None]
        out_mask = head_mask & dim_mask[None, :]
        q_base = q_ptr + seq * stride_qt + heads[:, None] * stride_qh
        k_base = k_ptr + seq * stride_kt + kv_head * stride_kh
        q, q_swapped = load_halves(q_base, stride_qd, dims[None, :], out_mask, HEAD_DIM // 2)
        k_new, k_swapped = load_halves(k_base, stride_kd, dims, dim_mask, HEAD_DIM // 2)
        v_new = tl.load(v_ptr + seq * stride_vt + kv_head * stride_vh + dims * stride_vd, mask=dim_mask, other=0.0)
        if ROPE:
            q = rotate(q, q_swapped, dims[None, :], cos[None, :], sin[None, :], HEAD_DIM // 2)
            k_new = rotate(k_new, k_swapped, dims, cos, sin, HEAD_DIM // 2)
        k_new_scale = scale_log2  # placeholders without FP8
        v_new_scale = scale_log2
        q_unit = scale_log2
        if FP8:
            q, q_unit = dot_query(q, 1, PRECISION == "ieee")
            k_new_scale = fp8_scale(tl.max(tl.abs(k_new.to(tl.float32)), 0))
            v_new_scale = fp8_scale(tl.max(tl.abs(v_new.to(tl.float32)), 0))
            k_new = to_fp8(k_new.to(tl.float32), k_new_scale)
            v_new = to_fp8(v_new.to(tl.float32), v_new_scale)
        else:
            k_new = k_new.to(k_cache.dtype.element_ty)
            v_new = v_new.to(v_cache.dtype.element_ty)
        if split == 0:
            row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
            dst = row + dims
            tl.store(k_cache + dst, k_new, mask=dim_mask)
            tl.store(v_cache + dst, v_new, mask=dim_mask)
            if FP8:
                tl.store(k_scales + row // HEAD_DIM, k_new_scale)
                tl.store(v_scales + row // HEAD_DIM, v_new_scale)

        m_i, l_i, acc = new_row_state(q, k_new[None, :], v_new[None, :], k_new_scale, v_new_scale, split == active - 1,
                                      scale_log2, q_unit, FP8)
        m_i, l_i, acc = attend_tile(q, k, v, k_scale, v_scale, cached, m_i, l_i, acc, scale_log2, q_unit, PRECISION,
                                    FP8)
        for tile in range(start + BLOCK_N, end, BLOCK_N):
            cached, k, v, k_scale, v_scale = load_kv_tile(
                k_cache, v_cache, k_scales, v_scales, table_row, tile, end, last, kv_head, stride_cb, stride_ct,
                stride_ch, BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_PAD, FP8)
            m_i, l_i, acc = attend_tile(q, k, v, k_scale, v_scale, cached, m_i, l_i, acc, scale_log2, q_unit,
                                        PRECISION, FP8)

        acc = acc / l_i[:, None]  # every running split holds at least one position
        out_row = out_ptr + seq * stride_ot
        if active == 1:
            tl.store(out_row + heads[:, None] * stride_oh + dims[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty),
                     mask=out_mask)
        else:
            part = (seq * NUM_HEADS + heads) * num_splits + split
            tl.store(part_out + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=head_mask)
            tl.store(part_lse + part, m_i + tl.log2(l_i), mask=h < GROUP)
            tl.debug_barrier()  # every thread's partial is stored before the count (acq_rel, GPU scope) releases it
            counter = counters + seq * tl.num_programs(0) + kv_head
            if tl.atomic_add(counter, 1) == active - 1:
                tl.store(counter, 0)
                merge_splits(part_out, part_lse, out_row, kv_head * GROUP, seq * NUM_HEADS + kv_head * GROUP,
                             num_splits, active, stride_oh, stride_od, GROUP, GROUP_PAD, HEAD_DIM, HEAD_PAD,
                             MERGE_CHUNK)


def merge_chunk(num_splits: int) -> int:
    """Splits a merge loads at once (merge_splits): all of a short context's, at most 16, which holds a group's
    partials in a few dozen registers a thread."""
    return min(16, triton.next_power_of_2(num_splits))


def paged_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor, scale: float,
    counters: torch.Tensor, *, num_splits: int, block_n: int, num_warps: int, num_stages: int,
    unsplit_tiles: int = 1, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store k[i], v[i] [Hkv, D] at slot_mapping[i], the last of seq_lens[i] positions of sequence i, and
    write to out[i] the attention of q[i] [Hq, D] over those positions. `counters` (int32 zeros, one
    per KV head of every row up to the last whose sequence spans two splits) are zeros again after.
    A sequence takes at most `num_splits` splits of tiles of `block_n` rows, one if it has at most `unsplit_tiles`.
    An fp8 cache (contiguous) comes with `scales`, float32 [num_blocks, block_size, Hkv] for keys and values.
    `rope`: (table [P, 2D], cos then sin, unit stride; positions [num_seqs]): q and k not yet rotated, as
    models/rope.py's rope would rotate them."""
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    padded = head_pad(head_dim)
    k_scales, v_scales = scales if scales is not None else (k_cache, v_cache)
    rope_table, positions = rope if rope is not None else (seq_lens, seq_lens)  # placeholders without ROPE
    launch_pdl = pdl_on(q.device)
    part_out = part_lse = out
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits, padded), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    launch(
        _decode_kernel, (num_kv_heads, num_splits, num_seqs),
        q, k, v, k_cache, v_cache, k_scales, v_scales, seq_lens, block_tables, slot_mapping, out, part_out, part_lse,
        counters, rope_table, positions, scale * 1.4426950408889634, num_splits, unsplit_tiles,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), rope_table.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        HEAD_PAD=padded, BLOCK_N=block_n, MERGE_CHUNK=merge_chunk(num_splits),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=scales is not None, ROPE=rope is not None, PDL=launch_pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=launch_pdl,
    )
