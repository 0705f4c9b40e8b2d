"""The block decode kernel (decode_kernel='blocks': whole cache blocks by tensor-descriptor copies) on the GPU.

Against the float32 reference of test_attention_backends.py, read from the same paged cache: GQA
groups 1, 4 and 8 at head_dim 64 and 128 (and 3 and 7; 5 KV heads, whose last tile of 4 reads
past the heads: zeros), head sizes that are not powers of two (their padded
lanes lie outside the descriptor and arrive as zeros), float16 and float32, ragged lengths from 1
(block boundaries, padded rows, long contexts), every split count the plan or the bench may pick
and every heads-a-program, the step's new key and value stored, the split counters back to zero,
and launches captured in a CUDA graph replayed with new lengths. The fp8 cache the same way
against float32 attention over the dequantized cache (head_dim 48 to 256, GQA 1 to 8, blocks of
16 to 256 rows, every split count, CUDA-graph replays), its new rows quantized as `quantize` does
with their scales stored. Caches the kernel cannot read (24- and 40-byte rows, blocks of 8 rows)
keep the row kernel. Last, a compiled engine decoding with it inside its CUDA graphs against the
eager engine, with the model's cache and with the fp8 cache.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from graphkiln.errors import ConfigError  # noqa: E402
from graphkiln.runtime.attention.select import select_backend  # noqa: E402
from graphkiln.runtime.attention.triton_backend import TritonBackend  # noqa: E402
from graphkiln.runtime.kv_cache import KVCache  # noqa: E402
from graphkiln.runtime.kv_dtype import quantize  # noqa: E402
from test_attention_backends import (  # noqa: E402
    CUDA, DECODE, FP8_HEADS, LAYER, TOLERANCE, _config, _id, assert_written, check_decode_replay, make_batch, reference,
    replay_lengths, run_and_check,
)

HEADS = [
    (torch.bfloat16, 8, 8, 64), (torch.bfloat16, 32, 8, 64), (torch.bfloat16, 64, 8, 64),
    (torch.bfloat16, 8, 8, 128), (torch.bfloat16, 32, 8, 128), (torch.bfloat16, 32, 4, 128),
    (torch.float16, 32, 8, 128), (torch.bfloat16, 16, 2, 256), (torch.bfloat16, 28, 4, 128),
    (torch.bfloat16, 15, 5, 64), (torch.float32, 8, 2, 64),
]
ODD_HEADS = [(torch.bfloat16, 32, 8, 80), (torch.bfloat16, 8, 2, 48), (torch.bfloat16, 16, 4, 96),
             (torch.float16, 16, 2, 112)]
# The fp8 cache: FP8_HEADS (head_dim 48 to 256, GQA 1 to 8, float16/bfloat16/float32 queries) and more
# the block kernel's tiles meet: 5 KV heads (a tile reading past the last), GQA 7, 80 and 112 lanes.
BLOCK_FP8_HEADS = FP8_HEADS + [(torch.bfloat16, 15, 5, 64), (torch.bfloat16, 28, 4, 128),
                               (torch.bfloat16, 32, 8, 80), (torch.float16, 16, 2, 112)]


def block_backend(cache: KVCache) -> TritonBackend:
    backend = TritonBackend(cache, "blocks")
    assert backend.decode_kernel == "blocks"
    return backend


@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize("heads", HEADS + ODD_HEADS, ids=_id)
def test_block_decode_against_float32(heads: tuple, case: str, record_property) -> None:
    lens, pad = DECODE[case]
    batch = make_batch(heads, [(1, s) for s in lens], pad, decode=True)
    run_and_check(block_backend(batch.cache), batch, record_property)


@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize("heads", BLOCK_FP8_HEADS, ids=_id)
def test_block_decode_fp8_cache_against_float32(heads: tuple, case: str, record_property) -> None:
    """Against float32 attention over the dequantized cache; the new rows stored within fp8's rounding, with
    their scales."""
    lens, pad = DECODE[case]
    batch = make_batch(heads, [(1, s) for s in lens], pad, decode=True, fp8=True)
    run_and_check(block_backend(batch.cache), batch, record_property)


def fp8_paged(heads: tuple, lens: list[int], block_size: int, seed: int, value_scale: float = 3.0):
    """An fp8 cache [blocks, block_size, Hkv, D] (and its row scales; values of `value_scale` times a normal
    distribution) holding sequences of `lens` tokens in shuffled blocks, their block tables and the slots of
    their last positions."""
    dtype, num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    shape = (sum(per_seq) + 1, block_size, num_kv_heads, head_dim)
    k_cache, k_scales = quantize(torch.randn(shape, generator=gen, device=CUDA))
    v_cache, v_scales = quantize(torch.randn(shape, generator=gen, device=CUDA) * value_scale)
    order = torch.randperm(sum(per_seq), generator=gen, device=CUDA) + 1
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=CUDA)
    for i, blocks in enumerate(order.split(per_seq)):
        tables[i, : len(blocks)] = blocks
    last = torch.tensor(lens, device=CUDA) - 1
    slots = tables.gather(1, (last // block_size)[:, None].long())[:, 0].long() * block_size + last % block_size
    return k_cache, v_cache, (k_scales, v_scales), tables, slots


def fp8_reference(q, k_cache, v_cache, scales, tables, lens: list[int], scale: float) -> torch.Tensor:
    """float32 attention of q [n, Hq, D] over each sequence's rows of the dequantized cache."""
    block_size, num_kv_heads = k_cache.shape[1:3]
    keys, values = (rows.float() * row_scales[..., None] for rows, row_scales in zip((k_cache, v_cache), scales))
    outs = []
    for i, n in enumerate(lens):
        blocks = tables[i, : -(-n // block_size)].long()
        k = keys[blocks].flatten(0, 1)[:n].repeat_interleave(q.shape[1] // num_kv_heads, 1)
        v = values[blocks].flatten(0, 1)[:n].repeat_interleave(q.shape[1] // num_kv_heads, 1)
        outs.append(torch.einsum("hl,lhd->hd", (torch.einsum("hd,lhd->hl", q[i].float(), k) * scale).softmax(-1), v))
    return torch.stack(outs)


# Heads a program, warps and stages at each block size: the plan's at 16 and 32 rows; fewer heads and stages
# at 64 and 256, so the blocks in flight fit in shared memory (a 256-row block of one 128-lane head is 32 KiB).
FP8_BLOCK_TILES = {16: (2, 4, 5), 32: (2, 4, 5), 64: (1, 4, 3), 256: (1, 8, 2)}


@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("block_size", FP8_BLOCK_TILES)
@pytest.mark.parametrize("heads", [(torch.bfloat16, 32, 8, 128), (torch.bfloat16, 32, 8, 64), (torch.bfloat16, 8, 1, 64),
                                   (torch.float16, 16, 4, 96)], ids=_id)
def test_fp8_cache_at_every_block_size_and_split_count(heads: tuple, block_size: int, num_splits: int,
                                                       record_property) -> None:
    """The kernel called directly on fp8 caches of 16 to 256-row blocks (boxes of 16 to 256 rows of one byte
    a lane) against float32; the new rows and their scales are what `quantize` makes of k and v (to one
    fp8 step where the kernel's division rounds otherwise), and the split counters are zeros again."""
    from graphkiln.kernels.block_decode_attention import block_paged_decode

    dtype, num_heads, num_kv_heads, head_dim = heads
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 2000, 4097, 250]
    k_cache, v_cache, scales, tables, slots = fp8_paged(heads, lens, block_size, seed=block_size + num_splits)
    gen = torch.Generator(device=CUDA).manual_seed(num_splits)
    q, k, v = (torch.randn(len(lens), n, head_dim, generator=gen, device=CUDA).to(dtype)
               for n in (num_heads, num_kv_heads, num_kv_heads))
    out = torch.full_like(q, float("nan"))
    counters = torch.zeros(len(lens) * num_kv_heads, dtype=torch.int32, device=CUDA)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    scale = head_dim**-0.5
    per_program, num_warps, num_stages = FP8_BLOCK_TILES[block_size]
    block_paged_decode(q, k, v, k_cache, v_cache, seq_lens, tables, slots, out, scale, counters, num_splits=num_splits,
                       heads=min(per_program, num_kv_heads), num_warps=num_warps, num_stages=num_stages, scales=scales)
    assert not counters.any(), "the split counters must be zeros again"
    for new, rows, row_scales in zip((k, v), (k_cache, v_cache), scales):
        want_rows, want_scales = quantize(new)
        torch.testing.assert_close(row_scales.flatten(0, 1)[slots], want_scales, rtol=1e-5, atol=0)
        # one fp8 step: 1/8 of a normal value, 2^-9 below the smallest normal
        torch.testing.assert_close(rows.flatten(0, 1)[slots].float(), want_rows.float(), rtol=0.125, atol=2**-9)
    expected = fp8_reference(q, k_cache, v_cache, scales, tables, lens, scale)
    err = ((out.float() - expected).norm() / expected.norm()).item()
    record_property("rel_err", err)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3e}"


@pytest.mark.parametrize("kernel", ["rows", "blocks"])
def test_fp8_dots_in_float16_keep_queries_past_its_range_and_values_in_its_subnormals(kernel: str,
                                                                                     record_property) -> None:
    """Both decode kernels dot an fp8 tile in float16 (kv_format.py): queries of magnitude 1e5 (past
    float16's 65504; the softmax scale brings the logits back to order one) and values of 1e-6 (their scales
    times the probabilities lie in float16's subnormals) still give float32 attention's result."""
    from graphkiln.kernels.block_decode_attention import block_paged_decode
    from graphkiln.kernels.decode_attention import paged_decode

    heads = (torch.bfloat16, 32, 8, 128)
    dtype, num_heads, num_kv_heads, head_dim = heads
    lens = [1, 17, 300, 2000]
    k_cache, v_cache, scales, tables, slots = fp8_paged(heads, lens, 16, seed=11, value_scale=1e-6)
    gen = torch.Generator(device=CUDA).manual_seed(11)
    q = (torch.randn(len(lens), num_heads, head_dim, generator=gen, device=CUDA) * 1e5).to(dtype)
    k = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen, device=CUDA).to(dtype)
    v = (torch.randn(len(lens), num_kv_heads, head_dim, generator=gen, device=CUDA) * 1e-6).to(dtype)
    assert q.abs().max() > torch.finfo(torch.float16).max
    out = torch.full_like(q, float("nan"))
    counters = torch.zeros(len(lens) * num_kv_heads, dtype=torch.int32, device=CUDA)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    scale = head_dim**-0.5 * 1e-5
    args = (q, k, v, k_cache, v_cache, seq_lens, tables, slots, out, scale, counters)
    if kernel == "rows":
        paged_decode(*args, num_splits=4, block_n=64, num_warps=4, num_stages=3, scales=scales)
    else:
        block_paged_decode(*args, num_splits=4, heads=2, num_warps=4, num_stages=5, scales=scales)
    expected = fp8_reference(q, k_cache, v_cache, scales, tables, lens, scale)
    err = ((out.float() - expected).norm() / expected.norm()).item()
    record_property("rel_err", err)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3e}"


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("tile", [(1, 4, 3), (2, 4, 5), (4, 4, 5), (8, 8, 3), (4, 4, 7)], ids=str)
@pytest.mark.parametrize("heads", [(torch.bfloat16, 32, 8, 64), (torch.bfloat16, 32, 8, 128)], ids=_id)
def test_every_split_count_and_tiling(heads: tuple, tile: tuple, num_splits: int, record_property) -> None:
    """The kernel called directly with tilings the plan does not pick (the bench sweeps them)."""
    from graphkiln.kernels.block_decode_attention import block_paged_decode

    per_program, num_warps, num_stages = tile
    lens = [1, 15, 16, 17, 33, 2000, 4097, 250]
    batch = make_batch(heads, [(1, s) for s in lens], 0, decode=True, seed=num_splits)
    q, k, v = batch.split()
    out = torch.full_like(q, float("nan"))
    counters = torch.zeros(len(lens) * 8, dtype=torch.int32, device=CUDA)
    k_cache, v_cache = batch.cache.layer(LAYER)
    meta = batch.meta
    scale = q.shape[-1] ** -0.5
    block_paged_decode(q, k, v, k_cache, v_cache, meta.seq_lens_t, meta.block_tables, meta.slot_mapping, out, scale,
                       counters, num_splits=num_splits, heads=per_program, num_warps=num_warps, num_stages=num_stages)
    assert_written(batch, meta.slot_mapping, k, v)
    assert not counters.any(), "the split counters must be zeros again"
    expected = reference(batch, meta, scale)
    err = ((out.float() - expected).norm() / expected.norm()).item()
    record_property("rel_err", err)
    assert err <= TOLERANCE[q.dtype], f"relative error {err:.3e}"


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
@pytest.mark.parametrize("heads", [(torch.bfloat16, 32, 8, 128), (torch.bfloat16, 32, 8, 64), (torch.float16, 8, 8, 64),
                                   (torch.bfloat16, 32, 8, 80), (torch.bfloat16, 8, 1, 128)], ids=_id)
@pytest.mark.parametrize("num_seqs", [1, 4, 64])
def test_block_decode_replays_in_a_cuda_graph(heads: tuple, num_seqs: int, fp8: bool, record_property) -> None:
    lens_a, lens_b = replay_lengths(num_seqs)
    batch = make_batch(heads, [(1, s) for s in lens_a + lens_b], 0, decode=True, fp8=fp8)
    check_decode_replay(block_backend(batch.cache), batch, lens_a, lens_b, record_property)


@pytest.mark.parametrize("what", ["fp8-row-of-40-bytes", "row-of-24-bytes", "blocks-of-8-rows"])
def test_caches_the_block_kernel_cannot_read_keep_the_row_kernel(what: str, record_property) -> None:
    if what == "blocks-of-8-rows":
        cache = KVCache(_config(8, 2, 64), 4, 8, torch.bfloat16, CUDA)
        assert TritonBackend(cache, "blocks").decode_kernel == "rows"
        return
    fp8 = what.startswith("fp8")
    heads = (torch.bfloat16, 8, 2, 40) if fp8 else (torch.bfloat16, 4, 4, 12)
    batch = make_batch(heads, [(1, s) for s in DECODE["boundaries"][0]], 3, decode=True, fp8=fp8)
    backend = TritonBackend(batch.cache, "blocks")
    assert backend.decode_kernel == "rows"
    run_and_check(backend, batch, record_property)


def test_auto_decodes_the_fp8_cache_by_rows_and_blocks_on_request() -> None:
    cache = make_batch((torch.bfloat16, 8, 2, 64), [(1, 5)], 0, decode=True, fp8=True).cache
    assert TritonBackend(cache).decode_kernel == "rows"
    assert TritonBackend(cache, "blocks").decode_kernel == "blocks"


def test_decode_kernel_is_checked_against_the_backend() -> None:
    cache = make_batch((torch.bfloat16, 8, 2, 64), [(1, 5)], 0, decode=True).cache
    assert select_backend("auto", cache, "blocks").decode_kernel == "blocks"
    with pytest.raises(ConfigError, match="decode_kernel='blocks'.*'sdpa'"):
        select_backend("sdpa", cache, "blocks")
    with pytest.raises(ConfigError, match="decode_kernel='tma'"):
        select_backend("triton", cache, "tma")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_a_compiled_engine_decodes_with_it_inside_its_graphs(kv_cache_dtype: str) -> None:
    """tiny in float32 (head_dim 32, GQA 4): greedy tokens of the CUDA-graph engine on the block kernel
    equal the eager engine's on the row kernel, batch sizes 1 to 8, contexts across block bounds; with
    the model's cache and with the fp8 cache (both kernels quantize a new row alike)."""
    from graphkiln import SamplingParams
    from tiny_engines import DECODE_SIZES, compile_tiny, engines

    parts = compile_tiny("float32")
    eager = engines(parts, kv_cache_dtype=kv_cache_dtype)[0]
    graphed = engines(parts, decode_kernel="blocks", kv_cache_dtype=kv_cache_dtype)[2]
    assert graphed.engine.runner.backend.decode_kernel == "blocks"
    rng = random.Random(0)
    lengths = [rng.choice([1, 15, 16, 17, 40]) for _ in range(DECODE_SIZES[-1])]
    prompts = [[rng.randrange(3, 4096) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for batch in (1, 3, 8):
        want = [o.token_ids for o in eager.generate(prompts[:batch], params)]
        assert [o.token_ids for o in graphed.generate(prompts[:batch], params)] == want
    assert graphed.stats().graphs["decode"].replays
