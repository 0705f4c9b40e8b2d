"""Where a decode step and a warm load spend their time (one GPU call, about two minutes).

Builds a random Llama-3.2-1B-shaped bf16 model and compiles it twice, with and without one
Inductor compile per bucket size (`CompileConfig.specialize`); for each: compile and load time, the
load split by function (cProfile), the decode step at batch 1, 8 and 64 as wall time vs the graph
replay alone (CUDA events), prefill latency; then fresh-interpreter import times and a
torch.profiler table of a few decode steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/gpu/, however this file is run

from gpu.models import MODELS, build_hf_model  # noqa: E402


def build_model(path: Path, layers: int, model: str = "1b") -> None:
    """The bench's random-weight Llama-3.2-1B-like (or `model`) model (bench/gpu/models.py) with `layers` layers."""
    shape = {**MODELS[model], "num_hidden_layers": layers, "max_position_embeddings": 8192}
    shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    build_hf_model(shape, SimpleNamespace(device="cuda", dtype=torch.bfloat16)).save_pretrained(path)


def top_functions(profile: cProfile.Profile, count: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(count)
    return out.getvalue()


def start_decoding(llm, batch: int, max_tokens: int, prompt_tokens: int = 128) -> list:
    """`batch` sequences of `prompt_tokens` prompt tokens, prefilled: the engine's next steps are decode steps."""
    import graphkiln

    engine = llm.engine
    params = graphkiln.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request([7 + i] * prompt_tokens, params) for i in range(batch)]
    while any(s.num_computed < len(s.prompt_ids) for s in seqs):
        engine.step()
    return seqs


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int, repeats: int = 1) -> float:
    """Median over `repeats` of the mean time of `replays` back-to-back replays (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[len(times) // 2]


def step_times(llm, batch: int, steps: int, prompt_tokens: int = 128) -> dict:
    engine = llm.engine
    seqs = start_decoding(llm, batch, steps + 8, prompt_tokens)
    graphs = engine.runner.graphs
    graph, _, _ = graphs.graphs[graphs.bucket(batch), "greedy"]
    walls = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    replay = replay_ms(graph, steps)
    for s in seqs:
        engine.abort(s)
    walls.sort()
    return {"batch": batch, "step_ms_median": walls[len(walls) // 2] * 1e3, "replay_ms": replay}


def warm_prefill(llm, tokens: int) -> Callable[[], object]:
    """A call that prefills a `tokens`-long prompt and samples one token, run once already."""
    import graphkiln

    params = graphkiln.SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = [11] * tokens

    def prefill():
        return llm.generate([prompt], params)

    prefill()
    return prefill


def prefill_ms(llm, tokens: int, repeats: int = 10) -> float:
    prefill = warm_prefill(llm, tokens)
    walls = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        prefill()
        walls.append(time.perf_counter() - t)
    walls.sort()
    return walls[len(walls) // 2] * 1e3


def import_seconds() -> dict:
    """Fresh interpreters: `import torch` (twice: cold then warm page cache) and `import graphkiln`."""
    timings = {}
    for name, stmt in (("torch_first", "import torch"), ("torch_again", "import torch"),
                       ("torch_cuda_init", "import torch; torch.zeros(1, device='cuda')"),
                       ("graphkiln", "import graphkiln")):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-P", "-c", stmt], check=True)
        timings[name] = time.perf_counter() - t
    return timings


def measure(work: Path, specialize: bool, out: Path) -> tuple[dict, object]:
    """Compile with or without per-size specialization; load; step and prefill times."""
    import graphkiln
    from graphkiln import CompileConfig

    config = CompileConfig(device="cuda", dtype="bfloat16", decode_batch_sizes=(1, 8, 64),
                           prefill_token_buckets=(128, 1024), specialize=specialize)
    art = work / f"art-{specialize}"
    t = time.perf_counter()
    _, report = graphkiln.compile_model(work / "model", art, config)
    compile_s = time.perf_counter() - t
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    llm = graphkiln.load(art, kv_cache_tokens=65536)
    profile.disable()
    load_s = time.perf_counter() - t
    (out / f"load_profile_specialize_{specialize}.txt").write_text(top_functions(profile, 60))
    result = {"specialize": specialize, "compile_s": compile_s, "inductor_s": report.timings["inductor"],
              "inductor_compiles": report.counters.inductor_compiles, "load_s": load_s,
              "steps": [step_times(llm, b, 50) for b in (1, 8, 64)],
              "prefill_ms": {n: prefill_ms(llm, n) for n in (128, 1024)}}
    return result, llm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    import graphkiln

    imports = import_seconds()
    work = Path(tempfile.mkdtemp())
    build_model(work / "model", args.layers)
    results = []
    for specialize in (False, True):
        result, llm = measure(work, specialize, args.out)
        results.append(result)
    llm.engine.add_request([5] * 16, graphkiln.SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(3):
        llm.engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            llm.engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    kernels = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    (args.out / "step_profile.txt").write_text(table)
    (args.out / "kernel_profile.txt").write_text(kernels)
    summary = {"imports_s": imports, "variants": results}
    (args.out / "profile.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
