"""The GPU tests' tiny engines: the tiny model compiled on CUDA, engines of it in each mode, random Llama
checkpoints, prompts, and the report file the tests' measurements go to."""

from __future__ import annotations

import json
import os

import torch

from graphkiln import CompileConfig, EngineConfig, LLM, SamplingParams
from graphkiln.compiler.compile import compile_module
from graphkiln.llm import resolve_model_dir
from graphkiln.models import load_model
from graphkiln.models.tokenizer import Tokenizer
from graphkiln.runtime.builder import build_engine
from greedy_helpers import assert_greedy_agrees

DECODE_SIZES = (1, 2, 4, 8)
PREFILL_SIZES = (16, 32, 64)
REPORT = os.environ.get("GRAPHKILN_GPU_REPORT")


def record(name: str, value) -> None:
    """Append a measurement to the GPU report file."""
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({name: value}) + "\n")


def compile_tiny(dtype: str):
    """(model, compiled model, tokenizer) of the tiny model on CUDA."""
    model_dir = resolve_model_dir("tiny")
    net = load_model(model_dir, "cuda", dtype)
    compiled, report = compile_module(net, CompileConfig(device="cuda", dtype=dtype))
    record(f"compile_timings_{model_dir.name}_{dtype}", report.timings)
    return net, compiled, Tokenizer.from_dir(model_dir)


def save_random_llama(path, *, std: float = 0.02, seed: int = 0, device: str = "cuda", dtype=torch.bfloat16,
                      **config):
    """A LlamaForCausalLM of `config` (LlamaConfig's fields) with every parameter drawn from N(0, std) after
    `seed`, built on `device` in `dtype` and saved to `path`; returned for the tests that compare with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.save_pretrained(path)
    return model


# Llama-3.2-1B's widths and vocabulary in two layers.
LLAMA_1B_2LAYER = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                       tie_word_embeddings=True)  # fmt: skip


def engines(parts, **options):
    """(eager, compiled without graphs, compiled with CUDA graphs) sharing one compile."""
    net, compiled, tok = parts
    config = EngineConfig(decode_batch_sizes=DECODE_SIZES, prefill_token_buckets=PREFILL_SIZES, kv_cache_tokens=8192,
                          attention_backend="triton", capture="blocking").replace(**options)  # fmt: skip
    eager = LLM(build_engine(net, None, config), tok)
    plain = LLM(build_engine(net, compiled, config.replace(cuda_graphs=False)), tok)
    graphed = LLM(build_engine(net, compiled, config), tok)
    return eager, plain, graphed


def assert_logprobs_agree(got, want, atol: float = 1e-4) -> None:
    """Per token: the same token and logprob, and the same most likely tokens (two may swap at a near-tie)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_id == w.token_id and abs(g.logprob - w.logprob) <= atol
        assert len(g.top) == len(w.top)
        values = [v for _, v in w.top]
        for rank, ((gi, gv), (wi, wv)) in enumerate(zip(g.top, w.top)):
            assert abs(gv - wv) <= atol
            others = values[:rank] + values[rank + 1 :]
            near_tie = rank == len(values) - 1 or any(abs(wv - v) <= 2 * atol for v in others)
            assert gi == wi or near_tie


def uneven_prompts(vocab: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(count)
    return [torch.randint(3, vocab, (1 + 7 * i,), generator=g).tolist() for i in range(count)]


def assert_compiled_agrees(reference: LLM, plain: LLM, graphed: LLM, max_error: float, max_tokens: int) -> None:
    """A compiled engine without CUDA graphs (`plain`) scores a prompt within `max_error` (relative L2) of
    `reference`; with and without graphs it decodes 8 uneven prompts to the same greedy tokens, which agree with
    the reference's up to near-ties."""
    ids = uneven_prompts(4096, 3)[2]
    want = reference.score(ids)
    assert (plain.score(ids) - want).norm() / want.norm() <= max_error
    prompts = uneven_prompts(4096, 8)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    got = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == got
    assert_greedy_agrees(reference, prompts, [o.token_ids for o in reference.generate(prompts, params)], got)
