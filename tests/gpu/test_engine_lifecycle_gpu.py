"""Engines on CUDA over their life: the graphs `load` captures, the memory they hold and give back, the
eager model's graphs serving while the compiled pieces load."""

from __future__ import annotations

import threading

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, EngineConfig, LLM, SamplingParams
from graphkiln.errors import CapacityError
from graphkiln.runtime.builder import build_engine
from graphkiln.runtime.sampler import MODES
from tiny_engines import PREFILL_SIZES, assert_logprobs_agree, record, uneven_prompts


def test_load_captures_exactly_the_decode_sizes_it_is_given(tmp_path):
    out = tmp_path / "art"
    graphkiln.compile_model("tiny", out, CompileConfig(device="cuda", dtype="bfloat16"))
    llm = graphkiln.load(out, decode_batch_sizes=(1, 2, 4), prefill_token_buckets=(16,), kv_cache_tokens=4096,
                         capture="blocking")
    stats = llm.stats()
    assert stats.graphs["decode"].sizes == (1, 2, 4)
    assert stats.graphs["decode"].graphs == 3 * len(MODES)
    assert stats.graphs["prefill"].sizes == (16,)
    assert stats.kv_cache_blocks == 4096 // 16 + 1


def test_dropping_an_llm_gives_its_memory_back(tmp_path):
    """After `del llm` (no gc.collect()) a second engine loads in the memory the first one used. A 2 GiB KV cache
    (tiny: 1 KiB a token), counted in this process's allocator (KV cache, weights, graph pools) rather than as
    a share of the device's free memory, which other processes (parallel test workers) change meanwhile."""
    out = tmp_path / "art"
    graphkiln.compile_model("tiny", out, CompileConfig(device="cuda", dtype="bfloat16"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    llm = graphkiln.load(out, kv_cache_tokens=2**21)
    llm.generate(["hello"], SamplingParams(max_tokens=4))
    held = torch.cuda.memory_reserved() - before
    del llm
    after = torch.cuda.memory_reserved()
    record("memory_back_after_del", {"held_mib": held / 2**20, "missing_mib": (after - before) / 2**20})
    assert held > 2**30 and after - before < 100 * 2**20
    again = graphkiln.load(out, kv_cache_tokens=2**21)
    assert again.generate(["hello"], SamplingParams(max_tokens=4))[0].token_ids


def test_an_engine_without_room_says_who_holds_the_memory(tmp_path):
    """With another engine holding the memory, loading is a CapacityError naming free and held memory and
    what to change, never a negative cache size; once that engine closes, the load succeeds."""
    out = tmp_path / "art"
    graphkiln.compile_model("tiny", out, CompileConfig(device="cuda", dtype="bfloat16"))
    small = dict(decode_batch_sizes=(1,), prefill_token_buckets=(16,))
    first = graphkiln.load(out, **small)
    pattern = (r"no room for a KV cache on cuda.*: [\d.]+ GiB of [\d.]+ GiB free; this process holds [\d.]+ GiB, "
               r"others [\d.]+ GiB, and gpu_memory_fraction=0\.9 leaves .*raise gpu_memory_fraction, or set kv_cache_tokens")
    with pytest.raises(CapacityError, match=pattern):
        graphkiln.load(out, **small)
    first.close()
    assert graphkiln.load(out, **small).generate(["hello"], SamplingParams(max_tokens=2))[0].token_ids


def test_eager_model_graphs_serve_decode_while_the_pieces_load(tiny_fp32_parts):
    """A background load whose pieces are held back: `build_engine` returns with the eager model's decode graph
    of the largest bucket up to EAGER_GRAPH_MAX_BATCH rows captured (up to the logits, sampled after the replay)
    and its prefill graph of the largest bucket up to EAGER_GRAPH_MAX_TOKENS; decode steps of up to that many
    rows and prefills of up to that many tokens replay them, padded, in every sampling mode, with the eager
    engine's tokens and log-probabilities; larger batches run the model itself. When the pieces are in, each
    serves until the compiled model's graphs of its kind are captured, then is released."""
    net, compiled, tok = tiny_fp32_parts
    gate = threading.Event()

    def pieces():
        gate.wait(120)
        return compiled

    config = EngineConfig(decode_batch_sizes=(1, 2, 4, 8, 16), prefill_token_buckets=PREFILL_SIZES,
                          kv_cache_tokens=8192, attention_backend="triton")  # fmt: skip
    eager = LLM(build_engine(net, None, config.replace(capture="blocking")), tok)
    loading = LLM(build_engine(net, None, config, pieces=pieces), tok)
    stats = loading.stats()
    assert stats.graphs["decode"].graphs == 1 and stats.graphs["prefill"].graphs == 1 and not stats.prepared
    assert loading.engine.runner.eager_prefill_graphs.graphs.sizes == (PREFILL_SIZES[-1],)
    assert not loading.engine.wait_compiled(0)
    prompts = uneven_prompts(4096, 12)
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=1, logprobs=3),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_k=30, top_p=0.9, seed=2, logprobs=5),
    ]
    for batch in ([params[0]], [params[1]], params, params * 4):
        got = loading.generate(prompts[: len(batch)], batch)
        want = eager.generate(prompts[: len(batch)], batch)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert (g.logprobs is None) == (w.logprobs is None)
            if g.logprobs is not None:
                assert_logprobs_agree(g.logprobs, w.logprobs)
    stats = loading.stats()
    assert set(stats.graphs["decode"].replays) == {"8/logits"}
    assert stats.steps_without_graph["decode"] >= 9  # the batch of 12: its steps after the prefill
    assert stats.graphs["prefill"].replays[str(PREFILL_SIZES[-1])] >= 3  # the first three batches' prompts
    gate.set()
    assert loading.engine.wait_compiled(120) and loading.engine.wait_ready(120)
    assert loading.stats().graphs["decode"].graphs == len(config.decode_batch_sizes) * len(MODES)
    released = [(p.kind, p.error) for p in loading.stats().prepared if p.key == "eager graph released"]
    assert released == [("prefill", None), ("decode", None)]
    assert loading.engine.runner.eager_graphs is None and loading.engine.runner.eager_prefill_graphs is None
    assert [o.token_ids for o in loading.generate(prompts[:3], params)] == [
        o.token_ids for o in eager.generate(prompts[:3], params)]  # fmt: skip
    loading.close()
    eager.close()
