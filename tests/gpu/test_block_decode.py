"""The block decode kernel (decode_kernel='blocks': whole cache blocks by tensor-descriptor copies) on the GPU.

Against the float32 reference of test_attention_backends.py, read from the same paged cache: GQA
groups 1, 4 and 8 at head_dim 64 and 128 (and 3 and 7; 5 KV heads, whose last tile of 4 reads
past the heads: zeros), head sizes that are not powers of two (their padded
lanes lie outside the descriptor and arrive as zeros), float16 and float32, ragged lengths from 1
(block boundaries, padded rows, long contexts), every split count the plan or the bench may pick
and every heads-a-program, the step's new key and value stored, the split counters back to zero,
and launches captured in a CUDA graph replayed with new lengths. Caches the kernel cannot read
(fp8, 24-byte rows, blocks of 8 rows) keep the row kernel. Last, a compiled engine decoding with
it inside its CUDA graphs against the eager engine.
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
from test_attention_backends import (  # noqa: E402
    BLOCK, CUDA, DECODE, LAYER, TOLERANCE, _config, _id, assert_written, check_decode_replay, make_batch, reference,
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


@pytest.mark.parametrize("heads", [(torch.bfloat16, 32, 8, 128), (torch.bfloat16, 32, 8, 64), (torch.float16, 8, 8, 64),
                                   (torch.bfloat16, 32, 8, 80), (torch.bfloat16, 8, 1, 128)], ids=_id)
@pytest.mark.parametrize("num_seqs", [1, 4, 64])
def test_block_decode_replays_in_a_cuda_graph(heads: tuple, num_seqs: int, record_property) -> None:
    lens_a, lens_b = replay_lengths(num_seqs)
    batch = make_batch(heads, [(1, s) for s in lens_a + lens_b], 0, decode=True)
    check_decode_replay(block_backend(batch.cache), batch, lens_a, lens_b, record_property)


@pytest.mark.parametrize("what", ["fp8", "row-of-24-bytes", "blocks-of-8-rows"])
def test_caches_the_block_kernel_cannot_read_keep_the_row_kernel(what: str, record_property) -> None:
    if what == "blocks-of-8-rows":
        cache = KVCache(_config(8, 2, 64), 4, 8, torch.bfloat16, CUDA)
        assert TritonBackend(cache, "blocks").decode_kernel == "rows"
        return
    heads = (torch.bfloat16, 4, 4, 12) if what == "row-of-24-bytes" else (torch.bfloat16, 8, 2, 64)
    batch = make_batch(heads, [(1, s) for s in DECODE["boundaries"][0]], 3, decode=True, fp8=what == "fp8")
    backend = TritonBackend(batch.cache, "blocks")
    assert backend.decode_kernel == "rows"
    run_and_check(backend, batch, record_property)


def test_decode_kernel_is_checked_against_the_backend() -> None:
    cache = make_batch((torch.bfloat16, 8, 2, 64), [(1, 5)], 0, decode=True).cache
    assert select_backend("auto", cache, "blocks").decode_kernel == "blocks"
    with pytest.raises(ConfigError, match="decode_kernel='blocks'.*'sdpa'"):
        select_backend("sdpa", cache, "blocks")
    with pytest.raises(ConfigError, match="decode_kernel='tma'"):
        select_backend("triton", cache, "tma")


def test_a_compiled_engine_decodes_with_it_inside_its_graphs() -> None:
    """tiny in float32 (head_dim 32, GQA 4): greedy tokens of the CUDA-graph engine on the block kernel
    equal the eager engine's on the row kernel, batch sizes 1 to 8, contexts across block bounds."""
    from graphkiln import SamplingParams
    from test_runtime_gpu import DECODE_SIZES, compile_tiny, engines

    parts = compile_tiny("float32")
    eager = engines(parts)[0]
    graphed = engines(parts, decode_kernel="blocks")[2]
    assert graphed.engine.runner.backend.decode_kernel == "blocks"
    rng = random.Random(0)
    lengths = [rng.choice([1, 15, 16, 17, 40]) for _ in range(DECODE_SIZES[-1])]
    prompts = [[rng.randrange(3, 4096) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for batch in (1, 3, 8):
        want = [o.token_ids for o in eager.generate(prompts[:batch], params)]
        assert [o.token_ids for o in graphed.generate(prompts[:batch], params)] == want
    assert graphed.stats().graphs["decode"].replays
