"""The choice of decode kernel (EngineConfig.decode_kernel) and the block kernel's plan, on the CPU.

The kernel itself runs in tests/gpu/test_block_decode.py."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import CPU, model_config
from graphkiln import EngineConfig
from graphkiln.errors import ConfigError
from graphkiln.runtime.attention.block_decode import (
    BOX_BYTES,
    BLOCK_PROGRAMS_PER_SM,
    MAX_SPLITS,
    MIN_SPLIT_BLOCKS,
    NUM_STAGES,
    BlockDecodeTiles,
    block_decode_tiles,
    block_decode_unsupported,
    check_decode_kernel,
    effective_decode_kernel,
    lane_bytes,
)
from graphkiln.runtime.attention.select import select_backend
from graphkiln.runtime.config import engine_config
from graphkiln.runtime.kv_cache import KVCache


@pytest.mark.parametrize("num_kv_heads,padded,itemsize,heads", [
    (8, 64, 2, 4), (8, 128, 2, 2), (8, 256, 2, 1), (2, 64, 2, 2), (1, 64, 2, 1), (8, 64, 4, 2), (8, 16, 2, 8),
    (5, 32, 2, 4),
])
def test_heads_a_program_fill_one_box_row_of_at_most_box_bytes(num_kv_heads, padded, itemsize, heads) -> None:
    tiles = block_decode_tiles(4, num_kv_heads, 4096, 16, padded, itemsize, num_sms=132)
    assert tiles.heads == heads
    assert tiles.heads * padded * itemsize <= max(BOX_BYTES, padded * itemsize)
    assert tiles.num_warps == (8 if padded * itemsize > 256 else 4)


@pytest.mark.parametrize("num_seqs", [1, 3, 16, 64, 128, 256])
@pytest.mark.parametrize("max_context", [16, 100, 2048, 4096, 131072])
@pytest.mark.parametrize("block_size", [16, 64])
def test_splits_fill_the_gpu_within_bounds(num_seqs: int, max_context: int, block_size: int) -> None:
    tiles = block_decode_tiles(num_seqs, 8, max_context, block_size, 64, 2, num_sms=132)
    programs = num_seqs * (8 // tiles.heads)
    assert 1 <= tiles.num_splits <= MAX_SPLITS
    assert tiles.num_splits <= max(1, -(-max_context // (MIN_SPLIT_BLOCKS * block_size)))
    if tiles.num_splits > 1:  # split only while the grid has fewer programs than it wants
        assert programs * (tiles.num_splits - 1) < BLOCK_PROGRAMS_PER_SM * 132


def test_the_serving_shapes_plan_as_documented() -> None:
    """1B-like heads (8 KV, 64 lanes, bf16) at 1 x 2000 split over 16 programs per head tile, 64 x 2000 in two,
    128 x 1000 unsplit; 8B-like heads (128 lanes) two a program, 32 x 4000 in two splits."""
    assert block_decode_tiles(1, 8, 2048, 16, 64, 2, 132).num_splits == 16
    assert block_decode_tiles(64, 8, 2048, 16, 64, 2, 132).num_splits == 2
    assert block_decode_tiles(128, 8, 1024, 16, 64, 2, 132).num_splits == 1
    assert block_decode_tiles(32, 8, 4096, 16, 128, 2, 132) == BlockDecodeTiles(2, 2, 4, NUM_STAGES)


def _cache(dtype: torch.dtype = torch.bfloat16, head_dim: int = 64, block_size: int = 16) -> KVCache:
    return KVCache(model_config(num_heads=8, num_kv_heads=2, head_dim=head_dim), 4, block_size, dtype, CPU)


@pytest.mark.parametrize("dtype,head_dim,block_size,reason", [
    (torch.float8_e4m3fn, 40, 16, "head_dim 40: a head's row of 40 bytes is not a multiple of 16"),
    (torch.float8_e4m3fn, 24, 16, "head_dim 24: a head's row of 24 bytes"),
    (torch.float8_e4m3fn, 64, 8, "block_size 8"),
    (torch.float8_e4m3fn, 64, 16, None), (torch.float8_e4m3fn, 48, 16, None), (torch.float8_e4m3fn, 16, 256, None),
    (torch.bfloat16, 12, 16, "head_dim 12: a head's row of 24 bytes is not a multiple of 16"),
    (torch.bfloat16, 64, 8, "block_size 8: block copies need 16 to 256 rows"),
    (torch.bfloat16, 64, 512, "block_size 512"),
    (torch.bfloat16, 80, 16, None), (torch.float32, 12, 16, None), (torch.float16, 256, 256, None),
])
def test_caches_the_block_kernel_reads(dtype, head_dim, block_size, reason) -> None:
    keys = _cache(dtype, head_dim, block_size).keys
    got = block_decode_unsupported(keys[0])
    assert got == reason if reason is None else reason in got
    assert effective_decode_kernel("blocks", keys) == ("blocks" if reason is None else "rows")
    assert effective_decode_kernel("rows", keys) == "rows"
    assert effective_decode_kernel("auto", keys) == "rows"


def test_the_fp8_cache_is_planned_at_the_lanes_of_a_16_bit_cache() -> None:
    """Its tiles are converted to the query's dtype in registers: the heads a program (the accumulators) and
    warps of a bf16 cache of the same heads, not the twice as many heads a plan by its 1-byte elements would give
    from 64 lanes on."""
    assert lane_bytes(torch.float8_e4m3fn) == 2
    assert [lane_bytes(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == [2, 2, 4]
    for padded, heads in ((64, 4), (128, 2), (256, 1)):
        by_lanes = block_decode_tiles(64, 8, 2048, 16, padded, lane_bytes(torch.float8_e4m3fn), 132)
        by_elements = block_decode_tiles(64, 8, 2048, 16, padded, torch.float8_e4m3fn.itemsize, 132)
        assert (by_lanes.heads, by_elements.heads) == (heads, 2 * heads), padded


def test_a_cache_not_contiguous_across_blocks_is_not_read_by_blocks() -> None:
    head_major = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16).transpose(1, 2)  # [blocks, block, heads, dim] view
    assert block_decode_unsupported(head_major) == "a cache that is not contiguous"


def test_decode_kernel_is_an_engine_option_checked_on_construction() -> None:
    assert EngineConfig().decode_kernel == "auto"
    config = engine_config(decode_kernel="blocks")
    assert EngineConfig.from_dict(config.to_dict()).decode_kernel == "blocks"
    with pytest.raises(ConfigError, match=r"EngineConfig.decode_kernel='tma'.*'auto', 'rows', 'blocks'"):
        EngineConfig(decode_kernel="tma")


def test_blocks_needs_the_triton_backend() -> None:
    check_decode_kernel("blocks", "triton")
    check_decode_kernel("rows", "sdpa")
    check_decode_kernel("auto", "flashinfer")
    with pytest.raises(ConfigError, match=r"decode_kernel='blocks'.*'flashinfer'.*attention_backend='triton'"):
        check_decode_kernel("blocks", "flashinfer")
    cache = _cache()
    with pytest.raises(ConfigError, match=r"decode_kernel='blocks'.*'sdpa'"):
        select_backend("auto", cache, "blocks")  # auto means SDPA on the CPU
    assert select_backend("auto", cache).name == "sdpa"
