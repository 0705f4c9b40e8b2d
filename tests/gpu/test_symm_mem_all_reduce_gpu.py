"""symm_mem_all_reduce on CUDA. One GPU: compiling `tiny` for 2 ranks puts the one-shot all-reduce into the
compiles specialized to the decode sizes only, and a group of one rank runs the rewritten code (symmetric memory
on a 1-rank NCCL group), also captured in a CUDA graph. Two GPUs: the artifact compiled with the pass on
generates the tokens and logits of the one compiled with it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import graphkiln
from graphkiln import CompileConfig, EngineConfig, SamplingParams
from graphkiln.compat import all_reduce_sum, inductor_output_code, symm_mem_multicast_off
from graphkiln.passes.manager import PassManager
from graphkiln.passes.pipeline import default_passes
from graphkiln.passes.symm_mem_all_reduce import NAME

from test_tensor_parallel_gpu import record

DECODE_SIZES = (1, 2, 4)
ENGINE = EngineConfig(decode_batch_sizes=DECODE_SIZES, prefill_token_buckets=(16, 32), kv_cache_tokens=8192)
ONE_SHOT = "symm_mem.one_shot_all_reduce_copy"
SYMMETRIC_BUFFER = "= empty_strided_p2p("


def tp2_config(dtype: str, enabled: tuple[str, ...]) -> CompileConfig:
    return CompileConfig(device="cuda", dtype=dtype, tensor_parallel_size=2, specialize_sizes=DECODE_SIZES,
                         enabled_passes=enabled)  # fmt: skip


def test_only_the_specialized_compiles_use_symmetric_memory(tmp_path: Path) -> None:
    """Compiled under the fake 2-rank group on this GPU: every specialized compile of a piece with all-reduces has
    one-shot all-reduces on symmetric buffers and no NCCL all-reduce; the dynamic compiles keep NCCL's."""
    with inductor_output_code() as codes:
        manifest, report = graphkiln.compile_model("tiny", tmp_path / "art", tp2_config("bfloat16", (NAME,)),
                                                   engine=ENGINE)
    assert NAME in [p["name"] for p in manifest["passes"]] and list(manifest["config"]["enabled_passes"]) == [NAME]
    rewritten = [code for code in codes if ONE_SHOT in code]
    nccl = [code for code in codes if "_c10d_functional.all_reduce" in code]
    assert rewritten and nccl and not any(ONE_SHOT in code for code in nccl)
    assert all(SYMMETRIC_BUFFER in code for code in rewritten)
    assert len(rewritten) == len(DECODE_SIZES) * len(nccl)  # per piece: the dynamic compile, then each size
    calls = sum(code.count(f"torch.ops.{ONE_SHOT}.default(") for code in rewritten)
    record("symm_mem_one_shot_calls_tiny_tp2", calls)
    run = {r.name: r for r in report.passes}[NAME]  # post-grad passes run only where Inductor's cache missed
    assert run.runs == 0 or run.matches == calls


def layer(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """A row-parallel projection (graphkiln::linear after linear_op), the sum over ranks, residual add, RMSNorm."""
    h = residual + all_reduce_sum(F.linear(x, w))
    return gamma * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype)


def test_one_rank_group_runs_the_one_shot_all_reduce(tmp_path: Path) -> None:
    """On a 1-rank NCCL group, the layer compiled with the pass equals the layer compiled without it, called
    directly and from a CUDA graph replayed on new inputs (the symmetric buffer is allocated before capture).
    In a process of its own: symmetric memory keeps its rendezvous with a group for the life of the process,
    which a later group of the same name (the 2-GPU test's) must not meet."""
    child = mp.get_context("spawn").Process(target=_one_rank_group, args=(str(tmp_path / "store"),))
    child.start()
    child.join(300)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, "the one-rank group failed or hung: its error is printed above"


def _one_rank_group(store: str) -> None:
    symm_mem_multicast_off()
    dist.init_process_group("nccl", store=dist.FileStore(store, 1), rank=0, world_size=1)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)

        def inputs() -> list[torch.Tensor]:
            shapes = ((4, 512), (4, 256), (256, 512), (256,))
            return [torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) for s in shapes]

        def compiled(manager: PassManager):  # a backend of its own each: Dynamo compiles `layer` once per backend
            return torch.compile(layer, fullgraph=True, dynamic=False, options={"post_grad_custom_post_pass": manager})

        on = PassManager(default_passes(), enabled=[NAME])
        rewritten, plain = compiled(on), compiled(PassManager(default_passes()))
        args = inputs()
        with inductor_output_code() as codes:
            got = rewritten(*args)
        assert any(ONE_SHOT in code for code in codes)
        assert on.records[NAME].runs == 0 or on.records[NAME].matches == 1  # runs only where Inductor's cache missed
        torch.testing.assert_close(got, plain(*args), rtol=0, atol=0)

        static = inputs()
        graph = torch.cuda.CUDAGraph()
        rewritten(*static)  # warm-up: the symmetric buffer and its rendezvous, outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = rewritten(*static)
        for _ in range(3):
            for buffer, new in zip(static, inputs()):
                buffer.copy_(new)
            graph.replay()
            torch.testing.assert_close(out, plain(*static), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def greedy_and_logits(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    with graphkiln.load(path) as llm:
        assert llm.wait_ready(300)
        tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
        stats = llm.stats()
        assert all(p.error is None and [r.rank for r in p.ranks] == [0, 1] for p in stats.prepared)
        assert sum(stats.graphs["decode"].replays.values()) > 0 and stats.steps_without_graph.get("decode", 0) == 0
        return tokens, llm.score(prompts[0])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_same_tokens_and_logits_with_the_pass(dtype: str, tmp_path: Path) -> None:
    """tiny on 2 GPUs, decode graphs captured on both ranks: the pass changes how two partial sums meet, not
    their sum, so greedy tokens are the same and logits match (two addends sum the same in either order)."""
    prompts = [[1, 5, 9, 200, 17, 3], [1, 7], [1, 300, 301, 302]]
    results = {}
    for name, enabled in (("nccl", ()), ("symm_mem", (NAME,))):
        graphkiln.compile_model("tiny", tmp_path / name, tp2_config(dtype, enabled), engine=ENGINE)
        results[name] = greedy_and_logits(tmp_path / name, prompts)
    (nccl_tokens, nccl_logits), (tokens, logits) = results["nccl"], results["symm_mem"]
    record(f"symm_mem_tp2_{dtype}_max_logit_diff", float((logits.float() - nccl_logits.float()).abs().max()))
    assert tokens == nccl_tokens
    torch.testing.assert_close(logits, nccl_logits, rtol=0, atol=1e-5 if dtype == "float32" else 1e-2)
