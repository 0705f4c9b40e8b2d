"""CPU micro-benchmarks of the built-in tiny model (pytest-benchmark): compile, warm load, one decode step.

    python -m pytest bench -q                       # table of min/mean/median per benchmark
    python -m pytest bench -q --benchmark-autosave  # keep a JSON under .benchmarks/ to compare later

Each stays small: the tiny model, decode buckets 1,2,4 and prefill buckets 16,32. The compile benchmark
runs after the module fixture compiled once, so it measures a compile with Inductor's cache warm.
One intra-op thread by default (GRAPHKILN_BENCH_THREADS=N to change).
"""

from __future__ import annotations

import os

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, SamplingParams

CONFIG = CompileConfig(decode_batch_sizes=(1, 2, 4), prefill_token_buckets=(16, 32))
ENGINE = {"kv_cache_tokens": 2048}
PROMPT_LEN = 16
DECODE_ROUNDS = 60


@pytest.fixture(scope="module", autouse=True)
def threads():
    """One intra-op thread (GRAPHKILN_BENCH_THREADS to change): the tiny model gains nothing from more,
    and on a shared runner extra threads turn into noise."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("GRAPHKILN_BENCH_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("bench") / "tiny"
    graphkiln.compile_model("tiny", out, CONFIG, force=True)
    return out


@pytest.fixture(scope="module")
def compiled_llm(artifact) -> graphkiln.LLM:
    return graphkiln.load(artifact, **ENGINE)


@pytest.fixture(scope="module")
def eager_llm() -> graphkiln.LLM:
    return graphkiln.LLM.eager("tiny", **ENGINE)


def test_compile_time(benchmark, artifact, tmp_path):
    """compile_model of tiny into a fresh artifact directory (Inductor's cache warm from the fixture)."""
    out = tmp_path / "tiny"
    _, report = benchmark.pedantic(graphkiln.compile_model, args=("tiny", out, CONFIG), kwargs={"force": True},
                                   rounds=1, iterations=1)
    benchmark.extra_info.update({f"stage_{k}_s": v for k, v in report.timings.items()})
    benchmark.extra_info.update(report.counters.as_dict())
    assert (out / "manifest.json").is_file()


def test_warm_load_time(benchmark, artifact):
    """graphkiln.load of an existing artifact in this process: checks, unpickling, weights, engine."""
    llm = benchmark.pedantic(graphkiln.load, args=(artifact,), kwargs=ENGINE, rounds=3, iterations=1, warmup_rounds=1)
    out = llm.generate([list(range(5, 5 + PROMPT_LEN))], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("which", ["compiled", "eager"])
def test_decode_step_time(benchmark, request, which, batch):
    """One engine step of `batch` running sequences, each adding one token (a pure decode step)."""
    llm = request.getfixturevalue(f"{which}_llm")
    engine = llm.engine
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(5, 4000, (batch, PROMPT_LEN), generator=g).tolist()
    params = SamplingParams(max_tokens=DECODE_ROUNDS + 10, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    try:
        while not all(len(s.output_ids) == 1 for s in seqs):
            engine.step()  # the prefill (every prompt fits one step), then its read-back
        events = benchmark.pedantic(engine.step, rounds=DECODE_ROUNDS, iterations=1, warmup_rounds=3)
        assert len(events) == batch
        benchmark.extra_info["threads"] = torch.get_num_threads()
    finally:
        for s in seqs:
            if s.finish_reason is None:
                engine.abort(s)
    assert not engine.has_work()
