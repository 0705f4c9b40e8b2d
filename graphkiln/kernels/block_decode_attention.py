"""Paged flash-decoding by whole cache blocks: tensor-descriptor (TMA) loads, several KV heads a program.

The row kernel (decode_attention.py) gathers one head's rows of a block one by one: a block of the
cache [num_blocks, BLOCK_SIZE, Hkv, D] holds BLOCK_SIZE rows per head, strided by Hkv * D elements,
so every row costs its own address (block id, row, head) and its own short transaction, and the
rows a program waits on sit in its registers. Here a program owns HEADS KV heads of one
(sequence, split) and brings each block it attends with one bulk copy per cache: the descriptor
is the cache seen as [num_blocks * BLOCK_SIZE, Hkv, D], the box [BLOCK_SIZE, HEADS, HEAD_PAD], so
one instruction moves BLOCK_SIZE * HEADS rows (with all KV heads, the block's whole contiguous
span) and the copy engine does the address work: a program computes one block-table address a
block. The copies land in shared memory, so the bytes in flight do not cost registers: Triton's
loop pipelining keeps several blocks of keys and values in flight per program (two at 5 stages;
it spends the other stages on the block-table load each copy waits for). The attention of the
HEADS heads is one batched (3-D) dot per block: queries [HEADS, BLOCK_G, D] (a GQA group padded
to 16 rows) against the block's keys [HEADS, D, BLOCK_SIZE]. Several heads a program, not all:
the accumulators hold 16 rows a head, so registers bound HEADS (block_decode.py plans them), and
fewer heads a program leave more programs to spread over the SMs. Padded head lanes (a head_dim
that is not a power of two) lie outside the descriptor's last dimension: the copy fills them
with zeros.

The descriptors are built on the host over the static cache (it never moves), so a launch
captured in a CUDA graph keeps them (in-kernel descriptors, `tl.make_tensor_descriptor`, would be
rebuilt by every program of every launch in scratch memory from a global allocator); lengths,
block tables, queries and the step's new key and value stay pointer loads read at replay. What
the row kernel does, this one does the same way:
split-K over the planned splits with the last program of a (sequence, head tile) merging the
partials on a counter it resets, the step's new keys and values stored by split 0 and attended from
registers as the first state of the split that holds them (the blocks mask that position out),
programmatic dependent launch. Splits cover whole blocks. Every block of a split goes
through one pipelined loop, its rows masked at the sequence's end: a copy issued outside the loop
(a first block ahead of the wait for q, k and v, as the row kernel does, or a last block of its
own) is waited on at once, one round trip each, where the loop has them in flight together.

An fp8 cache (kv_format.py: a float32 scale per token and KV head) is copied the same way, one
byte an element, so a box holds twice the heads' rows of a 16-bit cache for the same bytes. Its
scales, contiguous in [num_blocks, BLOCK_SIZE, Hkv] beside the cache, are read per block as a
[HEADS, BLOCK_SIZE] tile by pointer loads (a box of them would need Hkv a multiple of 4 for its
16-byte strides); the tile is converted to float16 in registers (kv_format.py says why), and the keys'
scales multiply the logits, the values' scales the probabilities, row by row, as the row kernel does.
The step's new key and value are quantized in registers and attended as stored.

Not served here (the row kernel serves them; runtime/attention/block_decode.py says why): blocks
of fewer than 16 rows (tl.dot's smallest tile) or more than 256 (the copy engine's largest box),
rows whose head stride is not a multiple of 16 bytes (what a descriptor's strides must be; for
fp8 a head_dim that is not a multiple of 16), caches not contiguous across blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from .decode_attention import merge_chunk, merge_splits, new_row_state
from .kv_format import MIN_TILE_SCALE, dot_query, fp8_scale, head_pad, lanes, to_fp8
from .launch import launch
from .pdl import pdl_on


def cache_descriptor(cache: torch.Tensor, heads: int) -> TensorDescriptor:
    """One layer's cache as [num_blocks * block_size, Hkv, D], read in boxes of a block's rows of `heads`
    KV heads, head lanes padded to a power of two (zeros past D)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    shape = [num_blocks * block_size, num_kv_heads, head_dim]
    box = [block_size, heads, head_pad(head_dim)]
    return TensorDescriptor(cache, shape, [cache.stride(1), cache.stride(2), 1], box)


@triton.jit
def block_scales(scales, row0, start, last, kv_heads, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The fp8 scales [HEADS, BLOCK_SIZE] of the block of cache rows from `row0` (positions from `start`) for
    `kv_heads`, from scales [num_blocks * BLOCK_SIZE, NUM_KV_HEADS]: zeros from `last` on (the step's new row
    and past it) and for heads past the last."""
    rows = tl.arange(0, BLOCK_SIZE)
    at = (row0.to(tl.int64) + rows)[None, :] * NUM_KV_HEADS + kv_heads[:, None]
    cached = (start + rows < last)[None, :] & (kv_heads < NUM_KV_HEADS)[:, None]
    return tl.load(scales + at, mask=cached, other=0.0)


@triton.jit
def attend_block(q, k, v, k_scale, v_scale, start, last, m_i, l_i, acc, scale_log2, q_unit,
                 BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) [HEADS, BLOCK_G(, D)] with one block of keys and values
    k, v [BLOCK_SIZE, HEADS, D] at positions from `start`, the rows before `last` (the step's new row is
    new_row_state's; values from it on are zeroed: a slot never written may hold anything). With FP8 (q from
    `dot_query`, divided by q_unit [HEADS, BLOCK_G]) each row's logit and probability are scaled by its key's
    and value's scale, k_scale and v_scale [HEADS, BLOCK_SIZE] (block_scales)."""
    cached = start + tl.arange(0, BLOCK_SIZE) < last
    v = tl.where(cached[:, None, None], v, 0.0)
    qk = tl.dot(q, tl.permute(k, (1, 2, 0)).to(q.dtype), input_precision=PRECISION)
    if FP8:
        qk = qk * (scale_log2 * q_unit)[:, :, None] * k_scale[:, None, :]
    else:
        qk = qk * scale_log2
    qk = tl.where(cached[None, None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 2))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, :, None])
    if FP8:
        v_max = tl.maximum(tl.max(v_scale, 1), MIN_TILE_SCALE)
        weights = p * (v_scale / v_max[:, None])[:, None, :]
        pv = tl.dot(weights.to(q.dtype), tl.permute(v, (1, 0, 2)).to(q.dtype), input_precision=PRECISION)
        pv = pv * v_max[:, None, None]
    else:
        pv = tl.dot(p.to(q.dtype), tl.permute(v, (1, 0, 2)).to(q.dtype), input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 2), acc * alpha[:, :, None] + pv


@triton.jit(do_not_specialize=["stride_bt"])  # the table width varies per eager batch: one build
def _block_decode_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, k_cache, v_cache, k_scales, v_scales, seq_lens, block_tables, slot_mapping,
    out_ptr, part_out, part_lse, counters, scale_log2, num_splits,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od, stride_cb, stride_ct, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_G: tl.constexpr, HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr, STAGES: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
    seq_len = tl.load(seq_lens + seq)
    blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    per_split = tl.cdiv(blocks, num_splits)
    active = tl.cdiv(blocks, per_split)
    if split < active:
        first = split * per_split
        stop = tl.minimum(first + per_split, blocks)
        last = seq_len - 1
        table_row = block_tables + seq.to(tl.int64) * stride_bt
        head0 = tile * HEADS
        if PDL:
            gdc_wait()
        kv_heads = head0 + tl.arange(0, HEADS)
        g = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_PAD)
        dim_mask = lanes(dims, HEAD_DIM, HEAD_PAD)
        head_mask = (kv_heads < NUM_KV_HEADS)[:, None] & (g < GROUP)[None, :]  # [HEADS, BLOCK_G]
        heads = kv_heads[:, None] * GROUP + g[None, :]
        out_mask = head_mask[:, :, None] & dim_mask[None, None, :]
        q = tl.load(q_ptr + seq * stride_qt + heads[:, :, None] * stride_qh + dims[None, None, :] * stride_qd,
                    mask=out_mask, other=0.0)
        new_mask = (kv_heads < NUM_KV_HEADS)[:, None] & dim_mask[None, :]
        k_new = tl.load(k_ptr + seq * stride_kt + kv_heads[:, None] * stride_kh + dims[None, :] * stride_kd,
                        mask=new_mask, other=0.0)
        v_new = tl.load(v_ptr + seq * stride_vt + kv_heads[:, None] * stride_vh + dims[None, :] * stride_vd,
                        mask=new_mask, other=0.0)
        k_new_scale = tl.zeros([HEADS], tl.float32)  # placeholders without FP8, shaped as with it
        v_new_scale = k_new_scale
        q_unit = scale_log2
        if FP8:
            q, q_unit = dot_query(q, 2, PRECISION == "ieee")
            k_new_scale = fp8_scale(tl.max(tl.abs(k_new.to(tl.float32)), 1))
            v_new_scale = fp8_scale(tl.max(tl.abs(v_new.to(tl.float32)), 1))
            k_new = to_fp8(k_new.to(tl.float32), k_new_scale[:, None])
            v_new = to_fp8(v_new.to(tl.float32), v_new_scale[:, None])
        else:
            k_new = k_new.to(k_cache.dtype.element_ty)
            v_new = v_new.to(v_cache.dtype.element_ty)
        if split == 0:
            slot = tl.load(slot_mapping + seq).to(tl.int64)
            row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
            dst = row + kv_heads[:, None] * stride_ch + dims[None, :]
            tl.store(k_cache + dst, k_new, mask=new_mask)
            tl.store(v_cache + dst, v_new, mask=new_mask)
            if FP8:
                scale_dst = slot * NUM_KV_HEADS + kv_heads
                tl.store(k_scales + scale_dst, k_new_scale, mask=kv_heads < NUM_KV_HEADS)
                tl.store(v_scales + scale_dst, v_new_scale, mask=kv_heads < NUM_KV_HEADS)

        m_i, l_i, acc = new_row_state(q, k_new[:, None, :], v_new[:, None, :], k_new_scale[:, None],
                                      v_new_scale[:, None, None], split == active - 1, scale_log2, q_unit, FP8)
        for b in tl.range(first, stop, num_stages=STAGES):
            row0 = tl.load(table_row + b) * BLOCK_SIZE
            k = k_desc.load([row0, head0, 0])
            v = v_desc.load([row0, head0, 0])
            k_scale = row0  # placeholders without FP8
            v_scale = row0
            if FP8:
                k_scale = block_scales(k_scales, row0, b * BLOCK_SIZE, last, kv_heads, NUM_KV_HEADS, BLOCK_SIZE)
                v_scale = block_scales(v_scales, row0, b * BLOCK_SIZE, last, kv_heads, NUM_KV_HEADS, BLOCK_SIZE)
            m_i, l_i, acc = attend_block(q, k, v, k_scale, v_scale, b * BLOCK_SIZE, last, m_i, l_i, acc, scale_log2,
                                         q_unit, BLOCK_SIZE, PRECISION, FP8)

        acc = acc / l_i[:, :, None]  # every running split holds at least one position
        out_row = out_ptr + seq * stride_ot
        if active == 1:
            tl.store(out_row + heads[:, :, None] * stride_oh + dims[None, None, :] * stride_od,
                     acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            part = (seq * NUM_HEADS + heads) * num_splits + split
            tl.store(part_out + part[:, :, None] * HEAD_PAD + dims[None, None, :], acc,
                     mask=head_mask[:, :, None])
            tl.store(part_lse + part, m_i + tl.log2(l_i), mask=head_mask)
            tl.debug_barrier()  # every thread's partial is stored before the count (acq_rel, GPU scope) releases it
            counter = counters + seq * tl.num_programs(0) + tile
            if tl.atomic_add(counter, 1) == active - 1:
                tl.store(counter, 0)
                for h in range(HEADS):
                    if head0 + h < NUM_KV_HEADS:
                        merge_splits(part_out, part_lse, out_row, (head0 + h) * GROUP,
                                     seq * NUM_HEADS + (head0 + h) * GROUP, num_splits, active, stride_oh, stride_od,
                                     GROUP, GROUP_PAD, HEAD_DIM, HEAD_PAD, MERGE_CHUNK)


def block_paged_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor, scale: float,
    counters: torch.Tensor, *, num_splits: int, heads: int, num_warps: int, num_stages: int,
    descriptors: tuple[TensorDescriptor, TensorDescriptor] | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """What `paged_decode` does, by block copies of `heads` KV heads a program: store k[i], v[i] [Hkv, D]
    at slot_mapping[i], the last of seq_lens[i] positions of sequence i, and write to out[i] the
    attention of q[i] [Hq, D] over those positions. `counters`: int32 zeros, one per head tile of
    every row up to the last whose sequence spans two splits; zeros again after. `descriptors` (of
    k_cache and v_cache, from `cache_descriptor` with these `heads`) may be built once and reused. An fp8
    cache comes with its `scales`, float32 [num_blocks, block_size, Hkv] for keys and values, contiguous."""
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    padded = head_pad(head_dim)
    k_desc, v_desc = descriptors or (cache_descriptor(k_cache, heads), cache_descriptor(v_cache, heads))
    k_scales, v_scales = scales if scales is not None else (k_cache, v_cache)
    launch_pdl = pdl_on(q.device)
    part_out = part_lse = out
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits, padded), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    launch(
        _block_decode_kernel, (triton.cdiv(num_kv_heads, heads), num_splits, num_seqs),
        q, k, v, k_desc, v_desc, k_cache, v_cache, k_scales, v_scales, seq_lens, block_tables, slot_mapping, out,
        part_out, part_lse, counters, scale * 1.4426950408889634, num_splits,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEADS=heads, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_PAD=padded,
        GROUP_PAD=triton.next_power_of_2(group), MERGE_CHUNK=merge_chunk(num_splits),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=scales is not None, PDL=launch_pdl, STAGES=num_stages, num_warps=num_warps, num_stages=num_stages,
        launch_pdl=launch_pdl,
    )
