"""The fp8 KV cache on the CPU (SDPA path): the option, its rows and scales, sizing, attention, and the
trained `tiny` model's logits and greedy tokens against the float32-cache engine.

What fp8 costs: float8_e4m3fn keeps 3 mantissa bits, so every cached element is rounded to within
2^-4 of its value relative to itself (a subnormal, below 2^-6 times its row's scale, to within
2^-10 times the scale), an RMS error of about 2-3% per element. Attention averages
many such rows and the layers after it do not amplify the error: on `tiny` the logits move by
about 1% of their norm (0.9-1.3% over 16 prompts of 50-55 tokens). The tolerance is 3%, about the
error of one element's rounding and more than twice what is measured; scales read from the
wrong rows move the logits by more than 15%. The greedy token is the reference's on 99% of
positions when both engines read the same tokens, and where they differ the reference's top two
logits are closer than 0.5, a gap the measured logit error (up to 0.25) can swap. Generating
freely, 10 of 16 48-token continuations are identical; after a first different token the two
continue different texts, so that count is asserted only at half.
"""

from __future__ import annotations

import json

import pytest
import torch
from attention_helpers import CPU, model_config, naive_attention

import graphkiln
from graphkiln import SamplingParams
from graphkiln.errors import ConfigError
from graphkiln.models.tiny import tiny_model_dir
from graphkiln.runtime.attention.flashinfer_backend import FlashInferBackend, unsupported as flashinfer_unsupported
from graphkiln.runtime.attention.metadata import SequenceSlice, build_metadata
from graphkiln.runtime.attention.sdpa import SdpaBackend
from graphkiln.runtime.config import EngineConfig, engine_config
from graphkiln.runtime.kv_cache import KVCache
from graphkiln.runtime.kv_dtype import FP8, cache_dtype, dequantize, quantize
from graphkiln.runtime.memory import kv_cache_blocks

LOGITS_TOLERANCE = 0.03  # relative norm, see the module docstring
POSITION_AGREEMENT = 0.97  # teacher-forced greedy agreement; measured 0.99
NEAR_TIE = 0.5  # reference top-2 logit gap within which the fp8 cache may pick the other token
PROMPTS = [
    "If the file", "This module provides", "Return the number of", "The default value is", "Raise ValueError if",
    "Create a new", "The optional argument", "Convert a string to", "Return True if the", "This function is",
    "Set the value of", "The socket is", "Read the contents of", "Open a connection to", "Parse the given",
    "Write the data to",
]


def test_kv_cache_dtype_is_checked_and_recorded() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8'.*'fp8_e4m3'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        engine_config(kv_cache_dtype=torch.float8_e4m3fn)
    config = engine_config(kv_cache_dtype="fp8_e4m3")
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert EngineConfig().kv_cache_dtype == "auto"
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16 and cache_dtype("fp8_e4m3", torch.float32) == FP8


def test_rows_round_to_fp8_within_its_precision_each_with_its_own_scale() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4, 96) * torch.logspace(-3, 3, 64)[:, None, None]
    x[5, 2] = 0
    x[7, 1, 3] = 1e4  # an outlier costs only its own row
    rows, scales = quantize(x)
    assert rows.dtype == FP8 and scales.shape == (64, 4) and scales.dtype == torch.float32
    back = dequantize(rows, scales, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all((back - x).abs() <= torch.maximum(x.abs() * 2**-4, amax / 448 * 2**-10) * 1.0001)
    assert torch.equal(back[5, 2], torch.zeros(96))
    assert scales[7, 1] == pytest.approx(1e4 / 448) and scales[7, 0] < 1
    assert ((back - x).norm() / x.norm()).item() < 0.04


def test_fp8_cache_counts_one_byte_an_element_and_its_scales() -> None:
    cfg = model_config(32, 8, 128)
    bf16, fp8 = KVCache.bytes_per_token(cfg, torch.bfloat16), KVCache.bytes_per_token(cfg, FP8)
    assert bf16 == 2 * 2 * 8 * 128 * 2
    assert fp8 == 2 * 2 * 8 * (128 + 4)
    assert bf16 / fp8 > 1.9  # about twice the tokens in the same memory
    cache = KVCache(cfg, 5, 16, FP8, CPU)
    assert cache.nbytes == 5 * 16 * fp8
    assert cache.layer_scales(1)[0].shape == (5, 16, 8)
    assert KVCache(cfg, 5, 16, torch.bfloat16, CPU).layer_scales(0) is None
    config = EngineConfig(kv_cache_tokens=1000, kv_cache_dtype="fp8_e4m3")
    assert kv_cache_blocks(cfg, FP8, CPU, config) == 1000 // 16 + 1


def test_sdpa_on_an_fp8_cache_matches_float64_attention_over_the_dequantized_cache() -> None:
    """The backend quantizes the new rows into their slots and attends over the dequantized context."""
    torch.manual_seed(1)
    cache = KVCache(model_config(8, 2, 48), 12, 16, FP8, CPU)
    rows, scales = quantize(torch.randn(cache.keys.shape))
    cache.keys.copy_(rows)
    cache.key_scales.copy_(scales)
    rows, scales = quantize(torch.randn(cache.values.shape) * 3)
    cache.values.copy_(rows)
    cache.value_scales.copy_(scales)
    slices = [SequenceSlice(5, 40, (3, 7, 9)), SequenceSlice(1, 17, (2, 11))]
    meta = build_metadata(slices, 16, 8, CPU)
    q, k, v = torch.randn(8, 8, 48), torch.randn(8, 2, 48), torch.randn(8, 2, 48)
    out = torch.full_like(q, float("nan"))
    SdpaBackend(cache).plan(meta)(1, q, k, v, out, 48**-0.5)

    keys = dequantize(cache.keys[1], cache.key_scales[1], torch.float64).flatten(0, 1)
    values = dequantize(cache.values[1], cache.value_scales[1], torch.float64).flatten(0, 1)
    slots = meta.slot_mapping[:6]
    assert ((keys[slots] - k[:6]).norm() / k[:6].norm()).item() < 0.04
    assert ((values[slots] - v[:6]).norm() / v[:6].norm()).item() < 0.04
    start = 0
    for s, (q_len, seq_len) in zip(slices, [(5, 40), (1, 17)]):
        context = torch.tensor([b * 16 + i for b in s.blocks for i in range(16)])[:seq_len]
        want = naive_attention(q[start : start + q_len], keys[context], values[context], 48**-0.5)
        torch.testing.assert_close(out[start : start + q_len].double(), want, atol=1e-5, rtol=1e-5)
        start += q_len
    assert torch.equal(out[6:], torch.zeros(2, 8, 48))


def test_flashinfer_refuses_the_fp8_cache_naming_the_option() -> None:
    cache = KVCache(model_config(4, 2, 128), 4, 16, FP8, CPU)
    assert "kv_cache_dtype='fp8_e4m3'" in flashinfer_unsupported(FP8, 128)
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8_e4m3'.*attention_backend='triton'"):
        FlashInferBackend(cache)


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[graphkiln.LLM, graphkiln.LLM]:
    """The trained tiny model in float32 with a float32 cache, and with the fp8 cache."""
    model = str(tiny_model_dir())
    with graphkiln.LLM.eager(model, kv_cache_tokens=4096) as ref, graphkiln.LLM.eager(
        model, kv_cache_tokens=4096, kv_cache_dtype="fp8_e4m3"
    ) as fp8:
        yield ref, fp8


def test_tiny_logits_and_greedy_tokens_with_the_fp8_cache(tiny_pair) -> None:
    ref, fp8 = tiny_pair
    assert fp8.stats().kv_cache_bytes < ref.stats().kv_cache_bytes / 3  # float32 elements against 1 byte + scales
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = ref.generate(PROMPTS, params)
    got = fp8.generate(PROMPTS, params)
    agree = total = 0
    for prompt, w in zip(PROMPTS, want):
        ids = list(ref.tokenizer.encode(prompt)) + list(w.token_ids)
        a, b = ref.score(ids), fp8.score(ids)
        err = ((a - b).norm() / a.norm()).item()
        assert err <= LOGITS_TOLERANCE, f"{prompt!r}: logits differ by {err:.3%} of their norm"
        differ = a.argmax(-1) != b.argmax(-1)
        top2 = a.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1])[differ]
        assert torch.all(gaps < NEAR_TIE), f"{prompt!r}: the fp8 cache changed a clear choice (gaps {gaps.tolist()})"
        agree += int((~differ).sum())
        total += differ.numel()
    assert agree / total >= POSITION_AGREEMENT, f"greedy agreement {agree / total:.3f}"
    identical = sum(w.token_ids == g.token_ids for w, g in zip(want, got))
    assert identical >= len(PROMPTS) // 2, f"{identical} of {len(PROMPTS)} continuations identical"
