"""Tensor parallel on one GPU: one rank pays nothing for being rank-aware (its graphs are prepared as before,
with no lockstep, no reports, no messages); more ranks than GPUs is refused. What needs 2 GPUs (NCCL
collectives captured inside the decode graphs, every rank capturing in rank 0's order) is the last test."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, EngineConfig, SamplingParams
from graphkiln.compat import inductor_output_code
from graphkiln.errors import ConfigError
from graphkiln.runtime.sampler import MODES

DECODE_SIZES = (1, 2, 4)
PREFILL_SIZES = (16, 32)
ENGINE = EngineConfig(decode_batch_sizes=DECODE_SIZES, prefill_token_buckets=PREFILL_SIZES, kv_cache_tokens=8192)
REPORT = os.environ.get("GRAPHKILN_GPU_REPORT")


def record(name: str, value) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({name: value}) + "\n")


def test_one_rank_is_unchanged(tmp_path: Path) -> None:
    """At tensor_parallel_size=1: no collective in any piece, no peers; every prefill and decode bucket captured
    in the background, smallest first, without lockstep or rank reports; decode graphs replayed for every
    decode step, greedy tokens as the eager engine's. Records a steady decode step's milliseconds."""
    with inductor_output_code() as codes:  # a loaded artifact keeps the compiled pieces, not their FX graphs
        graphkiln.compile_model("tiny", tmp_path / "art", CompileConfig(device="cuda", dtype="bfloat16"), engine=ENGINE)
    prompts = [[1, 5, 9, 200], [1, 7]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with graphkiln.load(tmp_path / "art") as llm:
        assert llm.wait_ready(300)  # every graph captured before the first step
        assert llm.engine.runner.peers is None and llm.engine.runner.model.shard.size == 1
        assert llm.engine.preparation.lockstep is None
        assert codes and not any("_c10d_functional.all_reduce" in code for code in codes)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
        assert sum(stats.graphs["decode"].replays.values()) > 0 and stats.steps_without_graph.get("decode", 0) == 0
        prefill_kind = "prefill" if llm.engine.runner.backend.capturable_prefill else "prefill-piecewise"
        decode_jobs = [("decode", f"{size}/{mode}") for size in DECODE_SIZES for mode in MODES]
        prefill_jobs = [(prefill_kind, str(size)) for size in PREFILL_SIZES]
        builds = [("kernels", "built")] if llm.engine.runner.backend.concurrent_plans else []
        # the pieces loaded beside the eager model's graphs, which serve the first steps until the compiled model's
        # of their kind are in: the prefill buckets before the decode buckets
        eager_prefill = [("prefill", "eager graph released")] if prefill_kind == "prefill" else []
        assert [(p.kind, p.key) for p in stats.prepared] == [
            ("pieces", "compiled"), *builds, *prefill_jobs, *eager_prefill, *decode_jobs,
            ("decode", "eager graph released")]  # fmt: skip
        assert all(p.error is None and p.ranks == () for p in stats.prepared)
        assert stats.graphs["decode"].graphs == len(DECODE_SIZES) * len(MODES)
        record("tp1_decode_step_ms_b1", decode_step_ms(llm))
    with graphkiln.LLM.eager("tiny", "cuda", "bfloat16", ENGINE) as eager:
        assert got == [o.token_ids for o in eager.generate(prompts, params)]


def decode_step_ms(llm: graphkiln.LLM, steps: int = 200) -> float:
    """Milliseconds per engine step of one greedy request decoding (graph replays, pipelined one deep)."""
    engine = llm.engine
    engine.add_request([1, 5, 9, 200], SamplingParams(max_tokens=steps + 20, ignore_eos=True))
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    return elapsed / steps * 1e3


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_more_ranks_than_gpus_is_a_config_error(tmp_path: Path) -> None:
    """Compiled for 2 ranks (the graph traced under torch's fake process group on this GPU), loaded on one GPU."""
    config = CompileConfig(device="cuda", dtype="bfloat16", tensor_parallel_size=2)
    graphkiln.compile_model("tiny", tmp_path / "art", config, engine=ENGINE)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 but this machine shows 1 CUDA device"):
        graphkiln.load(tmp_path / "art")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_match_one(tmp_path: Path) -> None:
    """float32 on 2 GPUs (NCCL, one spawned rank): logits and greedy tokens of the single-GPU engine, with every
    decode and prefill graph captured on both ranks (the all-reduces inside) and replayed."""
    prompts = [[1, 5, 9, 200, 17, 3], [1, 7]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with graphkiln.LLM.eager("tiny", "cuda", "float32", ENGINE) as one:
        logits = one.score(prompts[0])
        tokens = [o.token_ids for o in one.generate(prompts, params)]
    config = CompileConfig(device="cuda", dtype="float32", tensor_parallel_size=2)
    with inductor_output_code() as codes:
        graphkiln.compile_model("tiny", tmp_path / "art", config, engine=ENGINE)
    assert any("_c10d_functional.all_reduce" in code for code in codes)
    with graphkiln.load(tmp_path / "art") as two:
        assert two.wait_ready(300)
        torch.testing.assert_close(two.score(prompts[0]), logits, atol=1e-3, rtol=0)
        assert [o.token_ids for o in two.generate(prompts, params)] == tokens
        stats = two.stats()
        assert stats.prepared and all(p.error is None and [r.rank for r in p.ranks] == [0, 1] for p in stats.prepared)
        assert sum(stats.graphs["decode"].replays.values()) > 0 and stats.steps_without_graph.get("decode", 0) == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gptq_checkpoint_on_two_gpus_matches_one(tmp_path: Path) -> None:
    """A GPTQ int4 checkpoint in bfloat16, each GPU reading its slice of the packed words (models/quantized_shards.py):
    the 2-GPU engine's logits against the 1-GPU engine's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from int4_checkpoint_helpers import write_int4_checkpoint

    shape = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128, vocab_size=1024, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    model.save_pretrained(tmp_path / "source")
    write_int4_checkpoint(tmp_path / "source", model, tmp_path / "gptq", "gptq", 128, symmetric=True)
    prompt = [1, 5, 9, 200, 17, 3]
    with graphkiln.LLM.eager(tmp_path / "gptq", "cuda", "bfloat16", ENGINE) as one:
        logits = one.score(prompt).float()
    config = CompileConfig(device="cuda", dtype="bfloat16", tensor_parallel_size=2)
    graphkiln.compile_model(tmp_path / "gptq", tmp_path / "art", config, engine=ENGINE)
    with graphkiln.load(tmp_path / "art") as two:
        assert two.wait_ready(300)
        error = ((two.score(prompt).float() - logits).abs().max() / logits.abs().max()).item()
    record("tp2_gptq_vs_one_gpu_relative_error", error)
    assert error < 0.02  # bfloat16 products summed in another order; a wrong slice is of the order of 1
