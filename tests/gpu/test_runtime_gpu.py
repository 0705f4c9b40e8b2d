"""Runtime on CUDA: compiled pieces with Triton attention, decode CUDA graphs, artifacts loaded fresh."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, EngineConfig, LLM, SamplingParams
from graphkiln.compiler.counters import torch_compile_events
from graphkiln.runtime.sampler import MODES
from greedy_helpers import assert_greedy_agrees
from tiny_engines import (
    DECODE_SIZES, LLAMA_1B_2LAYER, PREFILL_SIZES, assert_logprobs_agree, compile_tiny, engines, record,
    save_random_llama, uneven_prompts,
)  # fmt: skip


def test_tiny_float32_greedy_identical_in_all_three_modes(tiny_fp32):
    eager, plain, graphed = tiny_fp32
    prompts = uneven_prompts(4096, 4)  # 46 tokens: the prefill fits the largest bucket (64)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in plain.generate(prompts, params)] == want
    before = torch_compile_events()
    captured = graphed.stats().graphs_captured
    assert set(graphed.stats().graphs) == {"decode", "prefill"}  # Triton captures its prefill whole
    assert captured == len(DECODE_SIZES) * len(MODES) + len(PREFILL_SIZES)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert torch_compile_events() == before
    stats = graphed.stats()
    assert stats.graphs_captured == captured
    assert stats.graphs["prefill"].replays and stats.graphs["decode"].replays


def test_every_decode_bucket_replays_correctly(tiny_fp32):
    _, plain, graphed = tiny_fp32
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for batch in range(1, DECODE_SIZES[-1] + 1):
        prompts = uneven_prompts(4096, batch)
        assert [o.token_ids for o in graphed.generate(prompts, params)] == [
            o.token_ids for o in plain.generate(prompts, params)
        ]
    stats = graphed.stats()
    assert stats.graphs["decode"].replayed_sizes == set(DECODE_SIZES)
    for kind, graphs in stats.graphs.items():
        record(f"tiny_capture_{kind}", {"graphs": graphs.graphs, "seconds": graphs.capture_s, "pool_bytes": graphs.pool_bytes})


def test_every_prefill_bucket_replays_correctly(tiny_fp32):
    _, plain, graphed = tiny_fp32
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for length in (1, 15, 16, 17, 33, 64, 65):
        prompt = uneven_prompts(4096, 1)[0] * length
        assert graphed.generate([prompt[:length]], params)[0].token_ids == plain.generate([prompt[:length]], params)[0].token_ids
    assert graphed.stats().graphs["prefill"].replayed_sizes == set(PREFILL_SIZES)


def test_chunked_prefill_mixed_with_decode_rows_replays_whole_prefill_graphs(tiny_fp32_parts):
    """A step budget of 32 tokens: long prompts are prefilled in chunks, in the same steps as other
    sequences' decode rows, every such step one whole prefill graph."""
    _, plain, graphed = engines(tiny_fp32_parts, max_num_batched_tokens=32)
    prompts = [p * 9 for p in uneven_prompts(4096, 5)]  # 9 to 261 tokens
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]
    prefill = graphed.stats().graphs["prefill"]
    assert prefill.sizes == (16, 32)  # buckets past the step budget are not captured
    assert prefill.replays["32"] >= 15  # 675 prompt tokens, at most 32 a step


def test_piecewise_prefill_graphs_replay_correctly(tiny_fp32_parts):
    """A backend that cannot capture its prefill (the SDPA reference here, FlashInfer in practice) gets one
    graph per (bucket, piece) with attention run eagerly between them, mixed steps included."""
    eager, plain, graphed = engines(tiny_fp32_parts, attention_backend="sdpa", max_num_batched_tokens=32)
    prompts = [p * 5 for p in uneven_prompts(4096, 4)]  # 5 to 110 tokens: chunked beside decode rows
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    stats = graphed.stats()
    pieces = stats.graphs["prefill-piecewise"]
    assert "decode" not in stats.graphs and pieces.sizes == (16, 32)
    assert pieces.graphs == 2 * len(tiny_fp32_parts[1].pieces)
    assert pieces.replayed_sizes == {32}  # every prefill chunk shares its step with other rows
    assert [o.token_ids for o in eager.generate(prompts, params)] == want
    alone = [prompts[0]]  # 5 tokens: the 16-token bucket
    assert graphed.generate(alone, params)[0].token_ids == plain.generate(alone, params)[0].token_ids
    assert graphed.stats().graphs["prefill-piecewise"].replayed_sizes == {16, 32}


def test_sampling_inside_decode_graphs_matches_the_plain_compiled_engine(tiny_fp32):
    """Seeded temperature, top-k/top-p and logprob requests: the graphs run the same sampler."""
    _, plain, graphed = tiny_fp32
    prompts = uneven_prompts(4096, 6)
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=1),
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=20, top_p=0.9, seed=2, logprobs=5),
        SamplingParams(max_tokens=12, ignore_eos=True),
    ]
    for batch in (params[:1], params[1:2], params[2:] * 2, params * 2):
        got = graphed.generate(prompts[: len(batch)], batch)
        want = plain.generate(prompts[: len(batch)], batch)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            assert (g.logprobs is None) == (w.logprobs is None)
            if g.logprobs is not None:
                assert_logprobs_agree(g.logprobs, w.logprobs)
    modes = {key.split("/")[1] for key in graphed.stats().graphs["decode"].replays}
    assert modes == set(MODES)


def test_logprobs_n_inside_decode_graphs_match_the_plain_compiled_engine_and_the_reference(tiny_fp32):
    """Top-N logprobs come out of the decode graphs at a fixed width (sample and filter modes), each
    request's N sliced on the host: the same as the plain compiled engine, and as log_softmax of score()."""
    _, plain, graphed = tiny_fp32
    prompts = uneven_prompts(4096, 4)
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, logprobs=20),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=1, logprobs=3),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_k=30, top_p=0.9, seed=2, logprobs=0),
        SamplingParams(max_tokens=10, ignore_eos=True),
    ]
    before = graphed.stats().graphs["decode"].replays
    for batch in ([params[0]], [params[1]], [params[2]], params):
        got = graphed.generate(prompts[: len(batch)], batch)
        want = plain.generate(prompts[: len(batch)], batch)
        for g, w, p in zip(got, want, batch):
            assert g.token_ids == w.token_ids
            if p.logprobs is None:
                assert g.logprobs is None and w.logprobs is None
                continue
            assert_logprobs_agree(g.logprobs, w.logprobs)
            assert all(len(lp.top) == p.logprobs for lp in g.logprobs)
            reference = plain.score(g.prompt_token_ids + g.token_ids[:-1])[len(g.prompt_token_ids) - 1 :]
            reference = reference.log_softmax(-1).cpu()
            for lp, ref in zip(g.logprobs, reference):
                assert abs(lp.logprob - ref[lp.token_id].item()) <= 1e-4
                assert torch.allclose(torch.tensor([v for _, v in lp.top]), ref.topk(p.logprobs).values, atol=1e-4)
    replays = graphed.stats().graphs["decode"].replays
    modes = {key.split("/")[1] for key in replays if replays[key] > before.get(key, 0)}
    assert modes == {"sample", "filter"}  # greedy rows asking for logprobs run the sample mode


def test_batch_beyond_largest_bucket_runs_without_graph(tiny_fp32):
    eager, _, graphed = tiny_fp32
    prompts = uneven_prompts(4096, DECODE_SIZES[-1] + 3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    before = graphed.stats().steps_without_graph.get("decode", 0)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]
    assert graphed.stats().steps_without_graph.get("decode", 0) > before


def test_launching_a_step_never_waits_for_the_device(tiny_fp32, monkeypatch):
    """Every launch queues its work and returns: whole prefill graphs with the LM head and sampler
    after them, decode graphs, steps past the largest buckets, sampled rows with logprobs. torch
    raises on a blocking copy or a synchronize while its sync debug mode is "error"."""
    _, plain, graphed = tiny_fp32
    engine = graphed.engine
    launch = engine._launch

    def strict_launch(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(engine, "_launch", strict_launch)
    sampled = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.7, top_k=5, seed=3, logprobs=5)
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    for prompts in (uneven_prompts(4096, 3), [uneven_prompts(4096, 1)[0] * 80], uneven_prompts(4096, DECODE_SIZES[-1] + 3)):
        params = [sampled] + [greedy] * (len(prompts) - 1)
        got = graphed.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    stats = graphed.stats()
    assert stats.graphs["prefill"].replays and stats.graphs["decode"].replays


def test_tiny_bfloat16_logits_close_and_graph_modes_identical():
    eager, plain, graphed = engines(compile_tiny("bfloat16"))
    ids = uneven_prompts(4096, 3)[2]
    want = eager.score(ids)
    got = plain.score(ids)
    assert (got - want).norm() / want.norm() <= 2e-2
    prompts = uneven_prompts(4096, 8)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == got
    want = [o.token_ids for o in eager.generate(prompts, params)]
    exact = assert_greedy_agrees(eager, prompts, want, got)
    record("tiny_bf16_greedy_exact_sequences", {"exact": exact, "of": len(prompts)})


@pytest.fixture(scope="module")
def llama_2layer(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama2layer")
    save_random_llama(path, **LLAMA_1B_2LAYER)
    return path


def test_llama_shaped_bf16_artifact_in_fresh_process(llama_2layer, tmp_path):
    out = tmp_path / "art"
    config = CompileConfig(device="cuda", dtype="bfloat16")
    engine = EngineConfig(decode_batch_sizes=DECODE_SIZES, prefill_token_buckets=PREFILL_SIZES)
    manifest, report = graphkiln.compile_model(llama_2layer, out, config, engine=engine)
    record("llama2layer_compile_timings", report.timings)
    script = f"""
import json, time, torch, graphkiln
from graphkiln.compiler.counters import torch_compile_events
t = time.perf_counter()
llm = graphkiln.load({str(out)!r}, kv_cache_tokens=8192, capture="blocking")
load_s = time.perf_counter() - t
prompts = [[5 + i] * (1 + 3 * i) for i in range(6)]
outs = llm.generate(prompts, graphkiln.SamplingParams(max_tokens=16, ignore_eos=True))
stats = llm.stats()
g = stats.graphs["decode"]
p = [v for k, v in stats.graphs.items() if k.startswith("prefill")][0]
print(json.dumps({{"tokens": [o.token_ids for o in outs], "events": torch_compile_events(), "load_s": load_s,
    "capture_s": g.capture_s, "pool_bytes": g.pool_bytes, "replayed": sorted(g.replayed_sizes),
    "prefill": p.kind, "prefill_replayed": sorted(p.replayed_sizes), "backend": stats.attention_backend}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    record("llama2layer_fresh_load", {k: result[k] for k in ("load_s", "capture_s", "pool_bytes", "events", "backend")})
    assert result["events"]["dynamo_graphs"] == 0 and result["events"]["inductor_compiles"] == 0
    assert result["replayed"]
    assert result["backend"] == "triton"  # 'auto'
    assert result["prefill"] == "prefill" and result["prefill_replayed"] == [PREFILL_SIZES[-1]]
    plain = graphkiln.load(out, kv_cache_tokens=8192, cuda_graphs=False, capture="blocking")  # compiled throughout
    prompts = [[5 + i] * (1 + 3 * i) for i in range(6)]
    want = plain.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert result["tokens"] == [o.token_ids for o in want]
    eager = LLM.eager(llama_2layer, device="cuda", dtype="bfloat16", kv_cache_tokens=8192, attention_backend="triton")
    ids = list(range(100, 160))
    ref = eager.score(ids)
    assert (plain.score(ids) - ref).norm() / ref.norm() <= 2e-2
