"""Triton, FlashInfer and SDPA attention backends on the GPU against a float32 reference read from the paged cache.

Each run writes the batch's new keys and values through the backend; the reference then gathers
every sequence's context from the same cache (dequantized, for the fp8 cache) and applies a masked
softmax in float32. Outputs are poisoned with NaN first, so a row the kernels never write fails.
Relative errors are recorded as junit properties (`pytest --junitxml`). Head sizes that are not
powers of two (12 to 160) and the fp8 cache run the same decode (split and unsplit, GQA, padded
rows), prefill (varlen, on cached prefixes) and CUDA-graph replays as the others.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from graphkiln.errors import ConfigError  # noqa: E402
from graphkiln.models.config import ModelConfig  # noqa: E402
from graphkiln.runtime.attention.flashinfer_backend import FlashInferBackend, flashinfer_importable  # noqa: E402
from graphkiln.runtime.attention.metadata import BatchMetadata, SequenceSlice, build_metadata, pad_decode  # noqa: E402
from graphkiln.runtime.attention.sdpa import SdpaBackend  # noqa: E402
from graphkiln.runtime.attention.select import select_backend  # noqa: E402
from graphkiln.runtime.attention.triton_backend import TritonBackend  # noqa: E402
from graphkiln.runtime.kv_cache import KVCache  # noqa: E402
from graphkiln.runtime.kv_dtype import FP8, dequantize, quantize  # noqa: E402
from graphkiln.runtime.batch import Batch as StepBatch  # noqa: E402
from graphkiln.runtime.prefill_graphs import dummy_slices  # noqa: E402
from graphkiln.runtime.static_batch import StaticBatch  # noqa: E402

CUDA = torch.device("cuda")
BLOCK = 16
LAYER = 1
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# (dtype, q heads, kv heads, head_dim): GQA ratios 1, 4 and 8 at head_dim 64 and 128, plus the edges.
HEADS = [
    (torch.bfloat16, 8, 8, 64), (torch.bfloat16, 8, 8, 128), (torch.bfloat16, 32, 8, 64),
    (torch.bfloat16, 32, 8, 128), (torch.bfloat16, 32, 4, 64), (torch.bfloat16, 32, 4, 128),
    (torch.float16, 32, 8, 128), (torch.float16, 8, 8, 64), (torch.bfloat16, 16, 2, 256),
    (torch.bfloat16, 4, 2, 32), (torch.float32, 8, 2, 64),
]
# Head sizes that are not powers of two: the tiles are padded to the next one and the lanes masked.
ODD_HEADS = [
    (torch.bfloat16, 8, 2, 48), (torch.bfloat16, 32, 8, 80), (torch.bfloat16, 16, 4, 96), (torch.float16, 16, 2, 112),
    (torch.bfloat16, 4, 4, 12), (torch.bfloat16, 8, 1, 160), (torch.float32, 8, 2, 80),
]
# The fp8 cache (a scale per token and KV head) under queries of these dtypes and head shapes.
FP8_HEADS = [
    (torch.bfloat16, 32, 8, 128), (torch.bfloat16, 8, 2, 64), (torch.float16, 8, 8, 128), (torch.bfloat16, 16, 2, 256),
    (torch.bfloat16, 16, 4, 96), (torch.bfloat16, 8, 2, 48), (torch.float32, 8, 2, 64),
]
FP8_ROW_ERROR = 0.04  # float8_e4m3fn rounds each element to within 2^-4 of itself: about 2.5% RMS
# FlashInfer serves float16/bfloat16 at head_dim 64, 128 and 256; GQA ratios 1, 4, 7 and 8. Each
# (dtype, head_dim) is one JIT build of FlashInfer's fa2 module (decode and prefill share it).
FLASHINFER_HEADS = [
    (torch.bfloat16, 8, 8, 64), (torch.bfloat16, 32, 8, 128), (torch.bfloat16, 32, 4, 64),
    (torch.bfloat16, 28, 4, 128), (torch.float16, 32, 8, 128), (torch.bfloat16, 16, 2, 256),
]
needs_flashinfer = pytest.mark.skipif(
    not flashinfer_importable(), reason="flashinfer is not installed (pip install graphkiln[flashinfer])"
)
_rng = random.Random(0)
DECODE = {  # context lengths; batches get padded decode rows where noted
    "boundaries": ([1, 15, 16, 17, 31, 32, 33] + [_rng.randint(1, 2048) for _ in range(40)], 5),
    "long": ([16384, 9000, 1], 1),
    "single": ([4097], 0),
    "batch256": ([_rng.randint(1, 512) for _ in range(256)], 0),
}
PREFILL = {  # (query_len, seq_len) per sequence, padding rows
    "fresh": ([(n, n) for n in (1, 15, 16, 17, 100, 333)], 7),
    "chunked": ([(512, 12000), (17, 33), (1, 5000), (64, 64), (16, 32), (15, 16)], 3),
    "long": ([(4096, 4096)], 0),
}


def _config(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", family="llama", vocab_size=8, hidden_size=num_heads * head_dim,
        intermediate_size=8, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, max_context=1 << 20, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
        mlp_bias=False, qk_norm=False, rope_type="default", rope_inv_freq=(), rope_scaling=1.0, bos_token_id=None,
        eos_token_ids=(),
    )


@dataclass
class Batch:
    cache: KVCache
    meta: BatchMetadata
    qkv: torch.Tensor  # [T, Hq + 2 Hkv, D]; q, k and v are strided views of it
    num_heads: int
    real_tokens: int  # rows before padded decode rows and prefill padding

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer LAYER's keys and values as the kernels read them: float32, dequantized where fp8."""
        k_cache, v_cache = self.cache.layer(LAYER)
        scales = self.cache.layer_scales(LAYER)
        if scales is None:
            return k_cache.float(), v_cache.float()
        return dequantize(k_cache, scales[0], torch.float32), dequantize(v_cache, scales[1], torch.float32)

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv_heads = (self.qkv.shape[1] - self.num_heads) // 2
        return self.qkv.split([self.num_heads, kv_heads, kv_heads], dim=1)


def _slices(lens: list[tuple[int, int]], free: list[int]) -> list[SequenceSlice]:
    return [SequenceSlice(q, s, tuple(free.pop() for _ in range(-(-s // BLOCK)))) for q, s in lens]


def make_batch(
    heads: tuple, lens: list[tuple[int, int]], pad: int, decode: bool, seed: int = 0, fp8: bool = False
) -> Batch:
    dtype, num_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK) for _, s in lens) + 1
    cache = KVCache(_config(num_heads, num_kv_heads, head_dim), num_blocks, BLOCK, FP8 if fp8 else dtype, CUDA)
    if fp8:
        for rows, scales, spread in ((cache.keys, cache.key_scales, 1.0), (cache.values, cache.value_scales, 3.0)):
            quantized, row_scales = quantize(torch.randn(rows.shape, device=CUDA) * spread)
            rows.copy_(quantized)
            scales.copy_(row_scales)
    else:
        cache.keys.normal_()
        cache.values.normal_()
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    slices = _slices(lens, free)
    real = sum(q for q, _ in lens)
    slices = pad_decode(slices, len(slices) + pad) if decode else slices
    rows = real + pad
    meta = build_metadata(slices, BLOCK, rows, CUDA)
    qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=CUDA)
    return Batch(cache, meta, qkv, num_heads, real)


def reference(batch: Batch, meta: BatchMetadata, scale: float) -> torch.Tensor:
    """float32 causal attention of the real query rows over each sequence's context gathered from the cache."""
    k_cache, v_cache = batch.stored()
    q = batch.split()[0]
    group = batch.num_heads // k_cache.shape[2]
    outs, start = [], 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        if start >= batch.real_tokens:
            break
        blocks = meta.block_tables[i, : -(-seq_len // BLOCK)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, 1)
        values = v_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, 1)
        for chunk in range(0, q_len, 1024):
            query = q[start + chunk : start + min(chunk + 1024, q_len)].float()
            scores = torch.einsum("nhd,lhd->hnl", query, keys) * scale
            pos = seq_len - q_len + chunk + torch.arange(query.shape[0], device=CUDA)
            scores.masked_fill_(torch.arange(seq_len, device=CUDA)[None, None, :] > pos[None, :, None], float("-inf"))
            outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values))
        start += q_len
    return torch.cat(outs)


def assert_written(batch: Batch, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The cache holds k and v [n, Hkv, D] at `slots`: exactly, or for fp8 within its rounding and with
    each row's scale its largest magnitude / 448."""
    scales = batch.cache.layer_scales(LAYER)
    if scales is None:
        k_cache, v_cache = batch.cache.layer(LAYER)
        assert torch.equal(k_cache.flatten(0, 1)[slots], k) and torch.equal(v_cache.flatten(0, 1)[slots], v)
        return
    for stored, row_scales, want in zip(batch.stored(), scales, (k, v)):
        got = stored.flatten(0, 1)[slots]
        err = ((got - want.float()).norm() / want.float().norm()).item()
        assert err <= FP8_ROW_ERROR, f"fp8 rows off by {err:.3e}"
        amax = want.float().abs().amax(-1)
        torch.testing.assert_close(row_scales.flatten(0, 1)[slots], amax / 448, rtol=1e-5, atol=0)


def run_and_check(backend, batch: Batch, record_property) -> None:
    q, k, v = batch.split()
    out = torch.full_like(q, float("nan"))
    scale = q.shape[-1] ** -0.5
    backend.plan(batch.meta)(LAYER, q, k, v, out, scale)
    n = batch.real_tokens
    assert_written(batch, batch.meta.slot_mapping[:n], k[:n], v[:n])
    expected = reference(batch, batch.meta, scale)
    err = ((out[:n].float() - expected).norm() / expected.norm()).item()
    record_property("rel_err", err)
    assert err <= TOLERANCE[q.dtype], f"relative error {err:.3e}"


def _id(heads: tuple) -> str:
    dtype, hq, hkv, d = heads
    return f"{str(dtype).removeprefix('torch.')}-hq{hq}-hkv{hkv}-d{d}"


@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize("heads", HEADS + ODD_HEADS, ids=_id)
def test_triton_decode(heads: tuple, case: str, record_property) -> None:
    lens, pad = DECODE[case]
    batch = make_batch(heads, [(1, s) for s in lens], pad, decode=True)
    run_and_check(TritonBackend(batch.cache), batch, record_property)


@pytest.mark.parametrize("case", PREFILL)
@pytest.mark.parametrize("heads", HEADS + ODD_HEADS, ids=_id)
def test_triton_prefill(heads: tuple, case: str, record_property) -> None:
    lens, pad = PREFILL[case]
    batch = make_batch(heads, lens, pad, decode=False)
    run_and_check(TritonBackend(batch.cache), batch, record_property)


@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize("heads", FP8_HEADS, ids=_id)
def test_triton_decode_fp8_cache(heads: tuple, case: str, record_property) -> None:
    lens, pad = DECODE[case]
    batch = make_batch(heads, [(1, s) for s in lens], pad, decode=True, fp8=True)
    run_and_check(TritonBackend(batch.cache), batch, record_property)


@pytest.mark.parametrize("case", PREFILL)
@pytest.mark.parametrize("heads", FP8_HEADS, ids=_id)
def test_triton_prefill_fp8_cache(heads: tuple, case: str, record_property) -> None:
    lens, pad = PREFILL[case]
    batch = make_batch(heads, lens, pad, decode=False, fp8=True)
    run_and_check(TritonBackend(batch.cache), batch, record_property)


@pytest.mark.parametrize("case", ["decode-boundaries", "prefill-chunked"])
def test_sdpa_backend_fp8_cache(case: str, record_property) -> None:
    kind, name = case.split("-")
    lens, pad = DECODE[name] if kind == "decode" else PREFILL[name]
    lens = [(1, s) for s in lens] if kind == "decode" else lens
    batch = make_batch((torch.bfloat16, 16, 4, 96), lens, pad, decode=kind == "decode", fp8=True)
    run_and_check(SdpaBackend(batch.cache), batch, record_property)


@pytest.mark.parametrize("case", ["decode-boundaries", "prefill-chunked", "prefill-fresh"])
def test_sdpa_backend(case: str, record_property) -> None:
    kind, name = case.split("-")
    lens, pad = DECODE[name] if kind == "decode" else PREFILL[name]
    lens = [(1, s) for s in lens] if kind == "decode" else lens
    batch = make_batch((torch.bfloat16, 32, 8, 128), lens, pad, decode=kind == "decode")
    run_and_check(SdpaBackend(batch.cache), batch, record_property)


def _shuffled(batch: Batch, seed: int) -> list[int]:
    free = list(range(1, batch.cache.num_blocks))
    random.Random(seed).shuffle(free)
    return free


def check_decode_replay(backend, batch: Batch, lens_a: list[int], lens_b: list[int], record_property) -> None:
    """As DecodeGraphs does, through a StaticBatch: fill a batch, warm up (kernels compile, FlashInfer
    learns the head count and plans this size), capture with the plan made inside the capture, then
    fill new lengths, re-plan on the same buffers and replay."""
    num_seqs = len(lens_a)
    size = num_seqs + 2
    static = StaticBatch(size, size, 4096 // BLOCK, BLOCK, CUDA)
    q, k, v = (t[:size] for t in batch.split())
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5

    def fill(lens: list[int], seed: int) -> BatchMetadata:
        slices = pad_decode(_slices([(1, s) for s in lens], _shuffled(batch, seed)), size)
        with static.staging_turn():
            return static.fill("decode", StepBatch([0] * size, [0] * size, slices, decode=True), size)

    backend.plan(fill(lens_a, 3))(LAYER, q, k, v, out, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.plan(static.metadata("decode", size, size, (1,) * size, (1,) * size))(LAYER, q, k, v, out, scale)
    meta = fill(lens_b, 2)
    backend.plan(meta)
    batch.qkv[:size].normal_()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    expected = reference(Batch(batch.cache, meta, batch.qkv[:size], batch.num_heads, num_seqs), meta, scale)
    err = ((out[:num_seqs].float() - expected).norm() / expected.norm()).item()
    record_property("rel_err", err)
    assert err <= TOLERANCE[q.dtype], f"relative error {err:.3e}"
    assert_written(batch, meta.slot_mapping[:num_seqs], k[:num_seqs], v[:num_seqs])


def replay_lengths(num_seqs: int) -> tuple[list[int], list[int]]:
    """Context lengths to capture with, and others (block boundaries, up to 4096) to replay with."""
    rng = random.Random(1)
    lens_a = [rng.randint(1, 100) for _ in range(num_seqs)]
    return lens_a, [rng.choice([1, 15, 16, 17, rng.randint(1, 4096)]) for _ in range(num_seqs)]


@pytest.mark.parametrize("backend", [pytest.param(TritonBackend, id="triton"),
                                     pytest.param(FlashInferBackend, id="flashinfer", marks=needs_flashinfer)])
@pytest.mark.parametrize("heads", [(torch.bfloat16, 32, 8, 128), (torch.float16, 8, 8, 64)], ids=_id)
@pytest.mark.parametrize("num_seqs", [4, 64])
def test_decode_replays_in_a_cuda_graph(backend: type, heads: tuple, num_seqs: int, record_property) -> None:
    lens_a, lens_b = replay_lengths(num_seqs)
    batch = make_batch(heads, [(1, s) for s in lens_a + lens_b], 0, decode=True)
    check_decode_replay(backend(batch.cache), batch, lens_a, lens_b, record_property)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
@pytest.mark.parametrize("heads", [(torch.bfloat16, 8, 2, 48), (torch.bfloat16, 32, 8, 80), (torch.bfloat16, 16, 4, 96),
                                   (torch.float16, 16, 2, 112), (torch.bfloat16, 32, 8, 128)], ids=_id)
@pytest.mark.parametrize("num_seqs", [4, 64])
def test_triton_decode_replays_in_a_cuda_graph_at_any_head_size_and_fp8(
    heads: tuple, num_seqs: int, fp8: bool, record_property
) -> None:
    lens_a, lens_b = replay_lengths(num_seqs)
    batch = make_batch(heads, [(1, s) for s in lens_a + lens_b], 0, decode=True, fp8=fp8)
    check_decode_replay(TritonBackend(batch.cache), batch, lens_a, lens_b, record_property)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
@pytest.mark.parametrize("heads", [(torch.bfloat16, 32, 8, 128), (torch.float16, 8, 8, 64), (torch.bfloat16, 32, 8, 80),
                                   (torch.bfloat16, 8, 2, 48)], ids=_id)
def test_triton_prefill_replays_in_a_cuda_graph(heads: tuple, fp8: bool, record_property) -> None:
    """As PrefillGraphs does: capture a dummy batch through StaticBatch, then fill other batches (fresh
    prompts, chunks on cached prefixes mixed with decode rows, a full bucket, fewer tokens than the
    bucket), re-plan on the same buffers, replay."""
    tokens, max_seqs = 512, 64
    cases = [PREFILL["fresh"][0], PREFILL["chunked"][0][1:], [(512, 12000)], [(1, 9)] * 40]
    batch = make_batch(heads, [lens for case in cases for lens in case], 0, decode=False, fp8=fp8)
    width = -(-12000 // BLOCK)
    static = StaticBatch(tokens, max_seqs, width, BLOCK, CUDA)
    backend = TritonBackend(batch.cache)
    qkv = torch.randn(tokens, *batch.qkv.shape[1:], dtype=batch.qkv.dtype, device=CUDA)
    q, k, v = Batch(batch.cache, batch.meta, qkv, batch.num_heads, 0).split()
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    with static.staging_turn():
        dummy = StepBatch([0] * tokens, [0] * tokens, dummy_slices(tokens, BLOCK, width), decode=False)
        meta = static.fill("prefill", dummy, max_seqs)
    fn = backend.plan(meta)
    fn(LAYER, q, k, v, out, scale)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(LAYER, q, k, v, out, scale)

    for seed, lens in enumerate(cases):
        slices = _slices(lens, _shuffled(batch, seed))
        real = sum(q_len for q_len, _ in lens)
        with static.staging_turn():
            meta = static.fill("prefill", StepBatch([0] * real, [0] * real, slices, decode=False).padded(tokens), max_seqs)
        backend.plan(meta)
        qkv.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = reference(Batch(batch.cache, meta, qkv, batch.num_heads, real), meta, scale)
        err = ((out[:real].float() - expected).norm() / expected.norm()).item()
        record_property(f"rel_err_{seed}", err)
        assert err <= TOLERANCE[q.dtype], f"case {lens[:3]}...: relative error {err:.3e}"
        assert_written(batch, meta.slot_mapping[:real], k[:real], v[:real])


@needs_flashinfer
@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize("heads", FLASHINFER_HEADS, ids=_id)
def test_flashinfer_decode(heads: tuple, case: str, record_property) -> None:
    lens, pad = DECODE[case]
    batch = make_batch(heads, [(1, s) for s in lens], pad, decode=True)
    run_and_check(FlashInferBackend(batch.cache), batch, record_property)


@needs_flashinfer
@pytest.mark.parametrize("case", PREFILL)
@pytest.mark.parametrize("heads", FLASHINFER_HEADS, ids=_id)
def test_flashinfer_prefill(heads: tuple, case: str, record_property) -> None:
    lens, pad = PREFILL[case]
    batch = make_batch(heads, lens, pad, decode=False)
    run_and_check(FlashInferBackend(batch.cache), batch, record_property)


def test_auto_backend_on_cuda() -> None:
    """'auto' picks Triton on CUDA for every head size up to 256 and the fp8 cache, FlashInfer installed or not."""
    served = make_batch((torch.bfloat16, 8, 2, 128), [(1, 5)], 0, decode=True).cache
    assert select_backend("auto", served).name == "triton"
    for heads in [(torch.bfloat16, 4, 2, 32), (torch.bfloat16, 8, 2, 48), (torch.bfloat16, 32, 8, 80)]:
        assert select_backend("auto", make_batch(heads, [(1, 5)], 0, decode=True).cache).name == "triton"
    fp8 = make_batch((torch.bfloat16, 8, 2, 128), [(1, 5)], 0, decode=True, fp8=True).cache
    assert select_backend("auto", fp8).name == "triton"


@needs_flashinfer
def test_flashinfer_refuses_the_fp8_cache() -> None:
    fp8 = make_batch((torch.bfloat16, 8, 2, 128), [(1, 5)], 0, decode=True, fp8=True).cache
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8_e4m3'"):
        select_backend("flashinfer", fp8)
