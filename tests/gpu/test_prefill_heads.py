"""The prefill kernel taking several query heads of a KV head's group a program (`PrefillTiles.heads`), and at a
register cap (`PrefillTiles.max_registers`), on the GPU, against the float32 reference of test_attention_backends.py
read from the same paged cache."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from graphkiln.kernels.kv_write import write_kv  # noqa: E402
from graphkiln.kernels.prefill_attention import paged_prefill  # noqa: E402
from graphkiln.runtime.attention.triton_backend import PrefillTiles, prefill_work, work_table  # noqa: E402
from test_attention_backends import CUDA, LAYER, PREFILL, TOLERANCE, _id, make_batch, reference  # noqa: E402


HEADS = [(torch.bfloat16, 32, 8, 64), (torch.bfloat16, 32, 8, 128), (torch.float16, 16, 4, 96)]
FP8 = pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])


@FP8
@pytest.mark.parametrize("per_program", [2, 4])
@pytest.mark.parametrize("heads", HEADS, ids=_id)
def test_prefill_kernel_with_several_query_heads_a_program(heads: tuple, per_program: int, fp8: bool,
                                                           record_property) -> None:  # fmt: skip
    """The prefill kernel taking `per_program` query heads of a KV head's group a program, each key and value tile
    loaded once for all of them, against float32 attention: chunks over cached prefixes beside fresh prompts."""
    check_tiles(heads, PrefillTiles(16, 64, 4, 2, per_program), fp8, record_property)


@FP8
@pytest.mark.parametrize("tiles", [PrefillTiles(128, 64, 8, 2, 1, 128), PrefillTiles(64, 64, 4, 2, 1, 128)],
                         ids=["128-rows", "64-rows"])
@pytest.mark.parametrize("heads", HEADS, ids=_id)
def test_prefill_kernel_at_a_register_cap(heads: tuple, tiles: PrefillTiles, fp8: bool, record_property) -> None:
    """The prefill kernel at prefill_tiles' tiles held to 128 registers a thread (where they spill a little)
    against float32 attention."""
    check_tiles(heads, tiles, fp8, record_property)


def check_tiles(heads: tuple, tiles: PrefillTiles, fp8: bool, record_property) -> None:
    lens, pad = PREFILL["chunked"]
    batch = make_batch(heads, lens, pad, decode=False, fp8=fp8)
    meta = batch.meta
    q, k, v = batch.split()
    k_cache, v_cache = batch.cache.layer(LAYER)
    scales = batch.cache.layer_scales(LAYER)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, scales)
    items = prefill_work(meta.query_lens, meta.seq_lens, tiles.block_m)
    work = torch.tensor(work_table(items), dtype=torch.int32, device=CUDA)
    out = torch.full_like(q, float("nan"))
    scale = q.shape[-1] ** -0.5
    paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens_t, meta.block_tables, work, out, scale,
                  len(items), scales=scales, **asdict(tiles))  # fmt: skip
    n = batch.real_tokens
    expected = reference(batch, meta, scale)
    err = ((out[:n].float() - expected).norm() / expected.norm()).item()
    record_property("rel_err", err)
    assert err <= TOLERANCE[q.dtype], f"relative error {err:.3e}"
