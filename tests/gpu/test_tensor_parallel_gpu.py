"""Tensor parallel on one GPU: one rank pays nothing for being rank-aware; more ranks than GPUs is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, EngineConfig, SamplingParams
from graphkiln.errors import ConfigError

DECODE_SIZES = (1, 2, 4)
ENGINE = EngineConfig(decode_batch_sizes=DECODE_SIZES, prefill_token_buckets=(16, 32), kv_cache_tokens=8192)


def graph_ops(llm: graphkiln.LLM) -> list[str]:
    split = llm.engine.runner.forward.split
    return [str(n.target) for name, _ in split.submodules for n in split.gm.get_submodule(name).graph.nodes
            if n.op == "call_function"]  # fmt: skip


def test_one_rank_is_unchanged(tmp_path: Path) -> None:
    """At tensor_parallel_size=1: no collective in any piece, no peers, decode graphs captured and replayed
    for every decode step, greedy tokens as the eager engine's."""
    graphkiln.compile_model("tiny", tmp_path / "art", CompileConfig(device="cuda", dtype="bfloat16"), engine=ENGINE)
    prompts = [[1, 5, 9, 200], [1, 7]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with graphkiln.load(tmp_path / "art") as llm:
        llm.wait_ready()  # every decode graph captured before the first step
        assert llm.engine.runner.peers is None and llm.engine.runner.model.shard.size == 1
        assert not any("c10d" in op for op in graph_ops(llm))
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
        assert sum(stats.graphs["decode"].replays.values()) > 0 and stats.steps_without_graph.get("decode", 0) == 0
    with graphkiln.LLM.eager("tiny", "cuda", "bfloat16", ENGINE) as eager:
        assert got == [o.token_ids for o in eager.generate(prompts, params)]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_more_ranks_than_gpus_is_a_config_error(tmp_path: Path) -> None:
    """Compiled for 2 ranks (the graph traced under torch's fake process group on this GPU), loaded on one GPU."""
    config = CompileConfig(device="cuda", dtype="bfloat16", tensor_parallel_size=2)
    graphkiln.compile_model("tiny", tmp_path / "art", config, engine=ENGINE)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 but this machine shows 1 CUDA device"):
        graphkiln.load(tmp_path / "art")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_match_one(tmp_path: Path) -> None:
    """float32 on 2 GPUs (NCCL, one spawned rank): logits and greedy tokens of the single-GPU engine."""
    prompts = [[1, 5, 9, 200, 17, 3], [1, 7]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with graphkiln.LLM.eager("tiny", "cuda", "float32", ENGINE) as one:
        logits = one.score(prompts[0])
        tokens = [o.token_ids for o in one.generate(prompts, params)]
    config = CompileConfig(device="cuda", dtype="float32", tensor_parallel_size=2)
    graphkiln.compile_model("tiny", tmp_path / "art", config, engine=ENGINE)
    with graphkiln.load(tmp_path / "art") as two:
        torch.testing.assert_close(two.score(prompts[0]), logits, atol=1e-3, rtol=0)
        assert [o.token_ids for o in two.generate(prompts, params)] == tokens
