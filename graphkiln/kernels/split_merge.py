"""Merging a decode launch's splits: each split's partial attention (weighted sum over its positions, divided by
their weight total) and log-sum-exp, combined into one head's output by the program that finds the group complete.

merge_splits reads partials stored as float32 by splits that then counted themselves done (the last to count
merges), or, FLAGGED, partials published as 32-bit words into buffers that hold EMPTY, the bits of a NaN that no
arithmetic writes, between launches: each word is its own flag, so the merging program needs no count at the end.
It loads a chunk until no word is EMPTY, then empties them for the next launch (read_flagged).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_format import head_pad, lanes


@triton.jit
def merge_splits(part_out, part_lse, out_row, first_head, first_part, num_splits, active, stride_oh, stride_od,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                 CHUNK: tl.constexpr, FLAGGED: tl.constexpr = False):
    """Write the output of GROUP heads from `first_head` on: the `active` partials of each, weighted by
    their log-sum-exps. The GROUP heads' partials load together, CHUNK splits at a time, so the merge waits
    on one round trip a chunk rather than one a head: it is the end of the chain that every split step
    waits on. Partials are read past L1, which other programs' stores do not update. FLAGGED: they are flagged
    words (read_flagged)."""
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
        partials = part_out + part[:, :, None] * HEAD_PAD + dims[None, None, :]
        if FLAGGED:
            partial, lse = read_flagged(partials, part_lse + part, used, HEAD_PAD)
        else:
            partial = tl.load(partials, mask=used[:, :, None], other=0.0, cache_modifier=".cg")
            lse = tl.load(part_lse + part, mask=used, other=float("-inf"), cache_modifier=".cg")
        m, total, acc = fold_partials(m, total, acc, partial, lse)
    store_merged(out_row, first_head, acc, total, stride_oh, stride_od, GROUP, GROUP_PAD, HEAD_DIM, HEAD_PAD)


@triton.jit
def fold_partials(m, total, acc, partial, lse):
    """A merge's running (max, weight total, weighted sum) [G], [G], [G, D] after a chunk of partials [G, C, D]
    and their log-sum-exps [G, C] (-inf where unused)."""
    m_new = tl.maximum(m, tl.max(lse, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded heads: no split, weight 0
    alpha = tl.exp2(m - m_safe)
    weight = tl.exp2(lse - m_safe[:, None])
    return m_new, total * alpha + tl.sum(weight, 1), acc * alpha[:, None] + tl.sum(partial * weight[:, :, None], 1)


@triton.jit
def store_merged(out_row, first_head, acc, total, stride_oh, stride_od, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Write a merge's result, acc / total, for the GROUP heads from `first_head` on."""
    g = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_PAD)
    result = acc / tl.where(g < GROUP, total, 1.0)[:, None]
    mask = (g < GROUP)[:, None] & lanes(dims, HEAD_DIM, HEAD_PAD)[None, :]
    tl.store(out_row + (first_head + g)[:, None] * stride_oh + dims[None, :] * stride_od,
             result.to(out_row.dtype.element_ty), mask=mask)


EMPTY = tl.constexpr(-1)  # a flagged word not yet written: NaN bits that arithmetic never leaves (it writes 0x7fffffff)


@triton.jit
def publish(words, x, mask):
    """Write float32 x to the flagged words at `words` as relaxed exchanges, each read whole by the merging
    program; a NaN as the canonical one, so no value is EMPTY."""
    x = tl.where(x == x, x, float("nan"))
    tl.atomic_xchg(words, x.to(tl.int32, bitcast=True), mask=mask, sem="relaxed")


@triton.jit
def load_flagged(words, mask):
    """The float32 values at `words` (volatile loads: other programs write them) and how many masked ones are
    still EMPTY."""
    w = tl.load(words, mask=mask, other=0, volatile=True)
    return w.to(tl.float32, bitcast=True), tl.sum(((w == EMPTY) & mask).to(tl.int32))


@triton.jit
def read_flagged(words, lse_words, used, HEAD_PAD: tl.constexpr):
    """A chunk of flagged partials [G, C, HEAD_PAD] and log-sum-exps [G, C] (-inf where not `used`), loaded
    again until no used word is EMPTY, then emptied, as the next launch needs them."""
    used_dims = tl.broadcast_to(used[:, :, None], (used.shape[0], used.shape[1], HEAD_PAD))
    partial = tl.zeros(used_dims.shape, tl.float32)
    lse = tl.zeros(used.shape, tl.float32)
    waiting = 1
    while waiting > 0:
        partial, words_waiting = load_flagged(words, used_dims)
        lse, lse_waiting = load_flagged(lse_words, used)
        waiting = words_waiting + lse_waiting
    tl.store(words, EMPTY, mask=used_dims)
    tl.store(lse_words, EMPTY, mask=used)
    return partial, tl.where(used, lse, float("-inf"))


def merge_chunk(num_splits: int) -> int:
    """Splits a merge loads at once (merge_splits): all of a short context's, at most 16, which holds a group's
    partials in a few dozen registers a thread."""
    return min(16, triton.next_power_of_2(num_splits))


def flagged_buffers(sizes: tuple[int, int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty flagged words for a merge's partials and log-sum-exps, as many as `sizes` (flagged_sizes)."""
    return tuple(torch.full((n,), EMPTY.value, dtype=torch.int32, device=device) for n in sizes)


def flagged_sizes(num_seqs: int, num_heads: int, num_splits: int, head_dim: int) -> tuple[int, int]:
    """The flagged words (int32, EMPTY) of a merge's partials and log-sum-exps for a launch of these rows, heads and
    splits."""
    parts = num_seqs * num_heads * num_splits
    return parts * head_pad(head_dim), parts
