"""Attention planning on the CPU: Triton tile/split/work-item choices, batch metadata, SDPA vs float64.

FlashInfer's page layout, backend selection and planning are in test_flashinfer_planning.py."""

from __future__ import annotations

import random

import pytest
import torch
from attention_helpers import CPU, model_config, naive_attention
from graphkiln.runtime.attention.metadata import (
    SequenceSlice,
    build_metadata,
    pad_decode,
)
from graphkiln.runtime.attention.sdpa import SdpaBackend
from graphkiln.runtime.attention.select import auto_backend
from graphkiln.runtime.attention.triton_backend import (
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    DECODE_PROGRAMS_PER_SM,
    FEW_ROWS,
    UNSPLIT_TILES,
    DecodeTiles,
    PrefillTiles,
    decode_tiles,
    graph_prefill_work,
    graph_programs,
    graph_work_capacity,
    padded_head_dim,
    prefill_tiles,
    prefill_work,
)
from graphkiln.runtime.attention.triton_backend import unsupported as triton_unsupported
from graphkiln.runtime.kv_cache import DUMMY_BLOCK, KVCache


@pytest.mark.parametrize("num_seqs", [1, 3, 32, 128, 256])
@pytest.mark.parametrize("max_context", [16, 1024, 4096, 16384, 131072])
def test_decode_splits_fill_the_gpu_within_bounds(num_seqs: int, max_context: int) -> None:
    tiles = decode_tiles(num_seqs, 8, max_context, 128, 2, num_sms=132)
    assert 1 <= tiles.num_splits <= MAX_SPLITS
    assert tiles.num_splits <= max(1, -(-max_context // MIN_SPLIT_TOKENS))
    capped = tiles.num_splits in (MAX_SPLITS, -(-max_context // MIN_SPLIT_TOKENS))
    budget = DECODE_PROGRAMS_PER_SM * 132
    assert num_seqs * 8 * tiles.num_splits <= budget or tiles.num_splits == 1  # never over the budget
    assert capped or num_seqs * 8 * (tiles.num_splits + 1) > budget  # one split more would be


def test_decode_tiles_examples() -> None:
    assert decode_tiles(8, 8, 2048, 64, 2, num_sms=132).num_splits == 8
    assert decode_tiles(32, 8, 4096, 128, 2, num_sms=132).num_splits == 2
    assert decode_tiles(64, 8, 4096, 64, 2, num_sms=132).num_splits == 1
    assert decode_tiles(128, 8, 4096, 64, 2, num_sms=132).num_splits == 1
    assert decode_tiles(1, 8, 2048, 64, 2, num_sms=132).num_splits == 16  # 128 tokens a split at the least
    assert decode_tiles(1, 8, 16384, 128, 2, num_sms=132).num_splits == MAX_SPLITS
    assert decode_tiles(1, 8, 128, 128, 2, num_sms=132).num_splits == 1
    assert decode_tiles(4, 8, 4096, 64, 2, num_sms=132).block_n == 64  # 128-byte rows, 16 splits: 64-row tiles
    assert decode_tiles(16, 8, 4096, 64, 2, num_sms=132) == DecodeTiles(4, 64, 4, 2)
    assert decode_tiles(64, 8, 2048, 64, 2, num_sms=132) == DecodeTiles(1, 128, 4, 2)  # one split: long tiles
    assert decode_tiles(32, 8, 2048, 64, 2, num_sms=132) == DecodeTiles(2, 128, 4, 2)
    assert decode_tiles(FEW_ROWS, 8, 8192, 128, 2, num_sms=132).unsplit_tiles == 1  # few rows: two tiles split
    assert decode_tiles(FEW_ROWS + 1, 8, 8192, 128, 2, num_sms=132).unsplit_tiles == UNSPLIT_TILES
    assert decode_tiles(1, 8, 4096, 64, 2, num_sms=132) == DecodeTiles(32, 128, 4, 2, 1)  # batch 1
    assert decode_tiles(1, 8, 4096, 128, 1, num_sms=132).block_n == 64  # an fp8 cache's 128-byte rows keep 64
    assert decode_tiles(4, 8, 4096, 128, 2, num_sms=132).block_n == 32  # 16 splits of a batch: short tiles
    assert decode_tiles(32, 8, 4096, 128, 2, num_sms=132).block_n == 128  # 2 splits: long ones
    assert decode_tiles(4, 8, 4096, 256, 2, num_sms=132).block_n == 32  # 512-byte rows: shorter tiles
    assert decode_tiles(8, 8, 8192, 128, 2, num_sms=132) == DecodeTiles(8, 32, 2, 4, 1)  # short splits of 256 bytes
    assert decode_tiles(1, 8, 8192, 128, 2, num_sms=132) == DecodeTiles(64, 64, 4, 2, 1)  # batch 1: 64 rows
    assert decode_tiles(8, 8, 8192, 128, 1, num_sms=132).block_n == 64  # an fp8 cache's 128-byte rows
    assert decode_tiles(8, 8, 8192, 64, 4, num_sms=132).block_n == 128  # float32's 256-byte rows keep theirs


def test_prefill_tiles_follow_the_longest_query() -> None:
    assert prefill_tiles(1, 128, 2).block_m == 16
    assert prefill_tiles(20, 128, 2).block_m == 32
    assert prefill_tiles(40, 128, 2).block_m == 64
    assert prefill_tiles(127, 128, 2) == PrefillTiles(64, 64, 4, 2)
    assert prefill_tiles(128, 128, 2) == PrefillTiles(128, 64, 8, 2, max_registers=128)  # two programs an SM
    assert prefill_tiles(32, 64, 2) == PrefillTiles(32, 64, 4, 2)
    assert prefill_tiles(33, 64, 2) == PrefillTiles(64, 64, 4, 2, max_registers=128)  # four programs an SM
    assert prefill_tiles(4096, 128, 1).block_m == 64  # an fp8 cache keeps the tiles it was measured with
    assert prefill_tiles(4096, 256, 2).block_n == 32  # 512-byte rows: shorter key tiles
    assert prefill_tiles(4096, 256, 4).num_stages == 1


def test_prefill_work_covers_every_row_once_longest_first() -> None:
    query_lens, seq_lens, block_m = (1, 100, 16, 17, 300), (1, 5000, 16, 40, 300), 64
    items = prefill_work(query_lens, seq_lens, block_m)
    rows = sorted((i, r) for i, start in items for r in range(start, min(start + block_m, query_lens[i])))
    assert rows == [(i, r) for i, q in enumerate(query_lens) for r in range(q)]
    keys = [seq_lens[i] - query_lens[i] + min(start + block_m, query_lens[i]) for i, start in items]
    assert keys == sorted(keys, reverse=True)
    assert items[0] == (1, 64)


@pytest.mark.parametrize("seed", range(20))
def test_graph_work_capacity_holds_any_batch_that_fits(seed: int) -> None:
    """A captured prefill grid is sized once per token bucket: no batch of at most that many tokens
    and sequences may need more query tiles, whatever its split."""
    rng = random.Random(seed)
    tokens = rng.choice([16, 64, 128, 512, 4096])
    max_seqs = rng.choice([1, 4, 256])
    block_m = prefill_tiles(tokens, 128, 2).block_m
    capacity = graph_work_capacity(tokens, max_seqs, block_m)
    for _ in range(50):
        count = rng.randint(1, min(max_seqs, tokens))
        cuts = sorted(rng.sample(range(1, tokens), count - 1)) if count > 1 else []
        query_lens = tuple(b - a for a, b in zip([0, *cuts], [*cuts, rng.randint(cuts[-1] + 1 if cuts else 1, tokens)]))
        table = graph_prefill_work(query_lens, query_lens, block_m, capacity)
        assert table[1:] == prefill_work(query_lens, query_lens, block_m)
        assert table[0] == (len(table) - 1, 0) and len(table) <= 1 + capacity


def test_graph_work_capacity_examples() -> None:
    assert graph_work_capacity(4096, 256, 64) == 64 + 256
    assert graph_work_capacity(16, 256, 16) == 1 + 16
    assert len(prefill_work((1,) * 16, (5,) * 16, 16)) == graph_work_capacity(16, 256, 16) - 1
    with pytest.raises(ValueError, match="do not fit"):
        graph_prefill_work((1,) * 16, (5,) * 16, 16, 15)


def test_graph_programs_fill_the_gpu_without_an_idle_program_per_item() -> None:
    assert graph_programs(4096, 64 + 256, 64, 32, num_sms=132) == 64  # one per tile of a single prompt
    assert graph_programs(128, 2 + 128, 64, 32, num_sms=132) == 9  # 2 x 132 programs over 32 heads
    assert graph_programs(16, 1 + 16, 16, 1, num_sms=132) == 17  # never more than the table can hold


def test_slot_mapping_at_block_boundaries() -> None:
    blocks = {15: (7,), 16: (3,), 17: (9, 4)}
    decode = build_metadata([SequenceSlice(1, n, blocks[n]) for n in (15, 16, 17)], 16, 3, CPU)
    assert decode.slot_mapping.tolist() == [7 * 16 + 14, 3 * 16 + 15, 4 * 16 + 0]
    assert decode.block_tables.tolist() == [[7, DUMMY_BLOCK], [3, DUMMY_BLOCK], [9, 4]]
    prefill = build_metadata([SequenceSlice(n, n, blocks[n]) for n in (15, 17)], 16, 40, CPU)
    expected = [7 * 16 + p for p in range(15)] + [9 * 16 + p for p in range(16)] + [4 * 16]
    assert prefill.slot_mapping.tolist() == expected + [DUMMY_BLOCK * 16] * 8
    assert prefill.query_start_loc.tolist() == [0, 15, 32]
    assert prefill.seq_lens_t.tolist() == [15, 17] and prefill.num_tokens == 32


def test_padded_decode_rows_live_in_the_dummy_block() -> None:
    slices = pad_decode([SequenceSlice(1, 17, (5, 6))], 4)
    meta = build_metadata(slices, 16, 4, CPU)
    assert meta.decode and meta.num_seqs == 4
    assert meta.seq_lens_t.tolist() == [17, 1, 1, 1]
    assert meta.slot_mapping.tolist() == [6 * 16, 0, 0, 0]
    assert meta.block_tables[1:].eq(DUMMY_BLOCK).all()


@pytest.mark.parametrize(
    "lens,decode",
    [
        ([(1, 15), (1, 16), (1, 17), (1, 1), (1, 40)], True),
        ([(15, 15), (16, 16), (17, 17), (1, 1)], False),
        ([(5, 21), (1, 17), (16, 48), (3, 3)], False),  # chunked prefill on a cached prefix, mixed with a decode
    ],
)
def test_sdpa_backend_matches_naive_float64(lens: list[tuple[int, int]], decode: bool) -> None:
    """Cached prefixes are written slot by slot, new tokens through the backend; outputs match unpaged math."""
    num_heads, num_kv_heads, head_dim, block_size, pad = 4, 2, 16, 16, 3
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(model_config(num_heads, num_kv_heads, head_dim), 32, block_size, torch.float32, CPU)
    free = list(range(1, 32))
    random.Random(0).shuffle(free)
    slices, full_k, full_v = [], [], []
    for q_len, seq_len in lens:
        blocks = tuple(free.pop() for _ in range(-(-seq_len // block_size)))
        slices.append(SequenceSlice(q_len, seq_len, blocks))
        full_k.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen))
        full_v.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen))
        for pos in range(seq_len - q_len):
            slot = blocks[pos // block_size] * block_size + pos % block_size
            cache.keys[1].view(-1, num_kv_heads, head_dim)[slot] = full_k[-1][pos]
            cache.values[1].view(-1, num_kv_heads, head_dim)[slot] = full_v[-1][pos]
    slices = pad_decode(slices, len(slices) + pad) if decode else slices
    rows = sum(s.query_len for s in slices) + (0 if decode else pad)
    meta = build_metadata(slices, block_size, rows, CPU)
    new_k = torch.cat([k[seq_len - q_len :] for k, (q_len, seq_len) in zip(full_k, lens)])
    new_v = torch.cat([v[seq_len - q_len :] for v, (q_len, seq_len) in zip(full_v, lens)])
    k = torch.cat([new_k, torch.randn(rows - new_k.shape[0], num_kv_heads, head_dim, generator=gen)])
    v = torch.cat([new_v, torch.randn(rows - new_v.shape[0], num_kv_heads, head_dim, generator=gen)])
    q = torch.randn(rows, num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    SdpaBackend(cache).plan(meta)(1, q, k, v, out, head_dim**-0.5)
    start = 0
    for (q_len, _), keys, values in zip(lens, full_k, full_v):
        expected = naive_attention(q[start : start + q_len], keys, values, head_dim**-0.5)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, rtol=1e-5, atol=1e-5)
        start += q_len
    assert not out.isnan().any()


@pytest.mark.parametrize("head_dim, padded", [(1, 16), (12, 16), (16, 16), (24, 32), (48, 64), (64, 64), (80, 128),
                                              (96, 128), (112, 128), (160, 256), (256, 256)])
def test_head_dims_pad_to_a_power_of_two_of_at_least_16(head_dim: int, padded: int) -> None:
    assert padded_head_dim(head_dim) == padded
    assert triton_unsupported(torch.bfloat16, head_dim) is None


def test_triton_serves_half_float32_and_fp8_caches_up_to_head_dim_256() -> None:
    assert triton_unsupported(torch.float8_e4m3fn, 128) is None and triton_unsupported(torch.float32, 96) is None
    assert "head_dim 512" in triton_unsupported(torch.bfloat16, 512)
    assert "float64" in triton_unsupported(torch.float64, 128)


@pytest.mark.parametrize(
    "device, dtype, head_dim, flashinfer, triton, want",
    [
        ("cuda", torch.bfloat16, 128, True, True, "triton"),  # faster where most decode steps fall
        ("cuda", torch.bfloat16, 96, True, True, "triton"),
        ("cuda", torch.bfloat16, 48, True, True, "triton"),
        ("cuda", torch.float8_e4m3fn, 128, True, True, "triton"),
        ("cuda", torch.float32, 128, True, True, "triton"),
        ("cuda", torch.bfloat16, 128, False, True, "triton"),
        ("cuda", torch.bfloat16, 128, True, False, "flashinfer"),  # Triton not installed
        ("cuda", torch.bfloat16, 96, True, False, "sdpa"),  # FlashInfer: 64, 128, 256 only
        ("cuda", torch.float8_e4m3fn, 128, True, False, "sdpa"),  # FlashInfer takes no per-row scales
        ("cuda", torch.bfloat16, 512, True, True, "sdpa"),
        ("cpu", torch.bfloat16, 128, True, True, "sdpa"),
    ],
)
def test_auto_falls_back_by_what_each_backend_serves(device, dtype, head_dim, flashinfer, triton, want) -> None:
    assert auto_backend(device, dtype, head_dim, flashinfer, triton) == want
