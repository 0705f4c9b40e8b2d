"""Engines on CUDA with the fp8 KV cache and with a head size that is not a power of two.

The fp8 cache's tolerance against the bfloat16 cache: the compiled bfloat16 engine is within 2% of
eager (test_runtime_gpu.py), and the cache's fp8 rounding moves logits by about 1% more
(tests/test_kv_cache_dtype.py), so 4%. Against the SDPA reference over the same fp8 cache only
bfloat16 rounding differs: 2%.
"""

from __future__ import annotations

import pytest
import torch

from graphkiln import CompileConfig, EngineConfig, LLM, SamplingParams
from graphkiln.compiler.compile import compile_module
from graphkiln.errors import ConfigError
from graphkiln.models import load_model
from graphkiln.runtime.builder import build_engine
from tiny_engines import (
    DECODE_SIZES, PREFILL_SIZES, compile_tiny, engines, record, save_random_llama, uneven_prompts,
)  # fmt: skip

FP8 = dict(kv_cache_dtype="fp8_e4m3")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def teacher_forced_agreement(llm: LLM, reference: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Share of positions where `llm` picks the reference's greedy token, both reading the reference's tokens."""
    agree = total = 0
    for prompt, out in zip(prompts, reference.generate(prompts, params)):
        ids = prompt + out.token_ids
        same = llm.score(ids).argmax(-1) == reference.score(ids).argmax(-1)
        agree += int(same.sum())
        total += same.numel()
    return agree / total


@pytest.fixture(scope="module")
def tiny_bf16_parts():
    return compile_tiny("bfloat16")


def test_tiny_fp8_cache_with_triton_graphs(tiny_bf16_parts):
    eager, plain, _ = engines(tiny_bf16_parts)
    _, plain8, graphed8 = engines(tiny_bf16_parts, **FP8)
    net, _, tok = tiny_bf16_parts
    sdpa8 = LLM(build_engine(net, None, EngineConfig(kv_cache_tokens=8192, attention_backend="sdpa", **FP8)), tok)
    assert graphed8.stats().attention_backend == "triton"
    assert graphed8.stats().kv_cache_bytes < 0.6 * plain.stats().kv_cache_bytes  # same tokens, 1 byte + scales

    prompts = uneven_prompts(4096, 8)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in graphed8.generate(prompts, params)] == [
        o.token_ids for o in plain8.generate(prompts, params)
    ]
    ids = uneven_prompts(4096, 3)[2]
    want = eager.score(ids)
    err_bf16, err_sdpa = rel_err(plain8.score(ids), want), rel_err(plain8.score(ids), sdpa8.score(ids))
    agreement = teacher_forced_agreement(plain8, eager, prompts, params)
    record("tiny_fp8_cache", {"logits_rel_err_vs_bf16_cache": err_bf16, "vs_sdpa_fp8": err_sdpa,
                              "greedy_agreement": agreement})  # fmt: skip
    assert err_bf16 <= 4e-2 and err_sdpa <= 2e-2
    assert agreement >= 0.95


def test_fp8_cache_backends_on_cuda(tiny_bf16_parts):
    """FlashInfer refuses the fp8 cache naming the option (whether or not it is installed); 'auto' takes Triton."""
    net, compiled, tok = tiny_bf16_parts
    config = EngineConfig(kv_cache_tokens=4096, cuda_graphs=False, **FP8)
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8_e4m3'.*attention_backend='triton'"):
        build_engine(net, compiled, config.replace(attention_backend="flashinfer"))
    llm = LLM(build_engine(net, compiled, config), tok)
    assert llm.stats().attention_backend == "triton"
    assert llm.generate(["If the file"], SamplingParams(max_tokens=4))[0].token_ids


def test_fp8_cache_fits_about_twice_the_tokens(tiny_bf16_parts):
    """Sized from free memory, the fp8 cache holds bytes-per-token times more tokens: 1.78x for tiny's
    32-wide heads (a 4-byte scale per 32 one-byte elements; 1.94x at 128)."""
    net, _, tok = tiny_bf16_parts
    blocks = {}
    for dtype in ("auto", "fp8_e4m3"):
        llm = LLM(build_engine(net, None, EngineConfig(gpu_memory_fraction=0.3, kv_cache_dtype=dtype)), tok)
        blocks[dtype] = llm.stats().kv_cache_blocks
        llm.close()
    ratio = blocks["fp8_e4m3"] / blocks["auto"]
    record("tiny_fp8_cache_blocks", {**blocks, "ratio": ratio})
    assert 1.7 <= ratio <= 1.85


@pytest.mark.parametrize("head_dim", [48, 80])
def test_a_checkpoint_of_any_head_size_serves_with_auto(head_dim, tmp_path):
    """head_dim 48 and 80: 'auto' serves the checkpoint with Triton (FlashInfer takes 64, 128, 256), its
    graphs replay what the plain compiled engine computes, and the logits match the SDPA reference engine
    and transformers."""
    model = save_random_llama(tmp_path, std=0.05, seed=head_dim, device="cpu", dtype=torch.float32, hidden_size=512,
                              intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                              head_dim=head_dim, vocab_size=1024, max_position_embeddings=1024, bos_token_id=None,
                              eos_token_id=None, pad_token_id=None)  # fmt: skip
    net = load_model(tmp_path, "cuda", "bfloat16")
    compiled, _ = compile_module(net, CompileConfig(device="cuda", dtype="bfloat16"))
    serving = EngineConfig(decode_batch_sizes=DECODE_SIZES, prefill_token_buckets=PREFILL_SIZES, kv_cache_tokens=8192)
    graphed = LLM(build_engine(net, compiled, serving.replace(capture="blocking")), None)  # its graphs from the first
    plain = LLM(build_engine(net, compiled, serving.replace(cuda_graphs=False)), None)
    assert graphed.stats().attention_backend == "triton"
    prompts = uneven_prompts(1024, 6)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]
    assert sum(graphed.stats().graphs["decode"].replays.values()) > 0
    ids = list(range(10, 70))
    sdpa = LLM(build_engine(net, None, EngineConfig(kv_cache_tokens=8192, attention_backend="sdpa")), None)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float().cuda()
    got = plain.score(ids)
    errors = {"vs_sdpa_bf16": rel_err(got, sdpa.score(ids)), "vs_transformers_fp32": rel_err(got, want)}
    record(f"head_dim_{head_dim}_logits", errors)
    assert errors["vs_sdpa_bf16"] <= 2e-2  # the same bfloat16 model with the reference attention
    assert errors["vs_transformers_fp32"] <= 3e-2  # bfloat16 against float32: a few roundings of 2^-9
