"""Runtime on CUDA: compiled pieces with Triton attention, decode CUDA graphs, artifacts loaded fresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, EngineConfig, LLM, SamplingParams
from graphkiln.compiler.compile import compile_module
from graphkiln.compiler.counters import torch_compile_events
from graphkiln.errors import CapacityError
from graphkiln.llm import resolve_model_dir
from graphkiln.models import load_model
from graphkiln.models.tokenizer import Tokenizer
from graphkiln.runtime.builder import build_engine
from graphkiln.runtime.sampler import MODES
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


@pytest.fixture(scope="module")
def tiny_fp32_parts():
    return compile_tiny("float32")


@pytest.fixture(scope="module")
def tiny_fp32(tiny_fp32_parts):
    return engines(tiny_fp32_parts)


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
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]


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
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    path = tmp_path_factory.mktemp("llama2layer")
    model.save_pretrained(path)
    del model
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
