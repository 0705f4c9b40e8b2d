"""What each graph pass buys on the GPU (one device call, about four minutes).

Compiles a random Llama-3.2-1B-shaped bf16 model once with every pass and once with each optional
pass switched off, and reports per configuration: Inductor compiles, tensors crossing the piece
boundaries, GPU kernels in one decode step at batch 1 (torch.profiler over graph replays), the
decode graph replay time at batch 1 and 64, and prefill latency for 1024 tokens.

    python3 bench/passes_bench.py --out "$OUT"   # not -P: it imports profile_step beside it
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from decode_kernels import kernel_table
from profile_step import build_model, prefill_ms, step_times

CONFIGS = {"all passes": (), **{f"no {name}": (name,) for name in ("boundary_recompute", "silu_mul_linear", "linear_op")}}
PROFILED_REPLAYS = 5


def boundary_tensors(llm) -> int:
    """Tensors one submodule of the split (piece or attention) hands to another, summed over all cuts."""
    graph = llm.engine.runner.forward.split.gm.graph
    produced = {n for n in graph.nodes if n.op == "call_module"}
    produced |= {n for n in graph.nodes if n.op == "call_function" and n.args and n.args[0] in produced}  # getitem
    return sum(1 for n in graph.nodes if n.op == "call_module" for a in n.all_input_nodes if a in produced)


def kernels_per_decode_step(llm) -> float:
    graph, _, _ = llm.engine.runner.graphs.graphs[1, "greedy"]
    return sum(r["per_replay"] for r in kernel_table(graph, PROFILED_REPLAYS) if "Memcpy" not in r["name"])


def measure(model: Path, work: Path, disabled: tuple[str, ...]) -> dict:
    import graphkiln
    from graphkiln import CompileConfig

    config = CompileConfig(device="cuda", dtype="bfloat16", decode_batch_sizes=(1, 64),
                           prefill_token_buckets=(1024,), disabled_passes=disabled)
    art = work / ("art-" + "-".join(disabled or ("all",)))
    shutil.rmtree(art, ignore_errors=True)
    t = time.perf_counter()
    _, report = graphkiln.compile_model(model, art, config)
    compile_s = time.perf_counter() - t
    llm = graphkiln.load(art, kv_cache_tokens=65536)
    steps = {s["batch"]: s["replay_ms"] for s in (step_times(llm, b, 50) for b in (1, 64))}
    return {"disabled": list(disabled), "compile_s": compile_s, "inductor_compiles": report.counters.inductor_compiles,
            "boundary_tensors": boundary_tensors(llm), "decode_kernels_b1": kernels_per_decode_step(llm),
            "replay_ms_b1": steps[1], "replay_ms_b64": steps[64], "prefill_1024_ms": prefill_ms(llm, 1024)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    build_model(work / "model", args.layers)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):  # the profiler's own first-use setup
        torch.ones(1, device="cuda").add_(1)
    results = {name: measure(work / "model", work, disabled) for name, disabled in CONFIGS.items()}
    results["all passes (again)"] = measure(work / "model", work, ())
    (args.out / "passes.json").write_text(json.dumps(results, indent=1))
    columns = ("inductor_compiles", "boundary_tensors", "decode_kernels_b1", "replay_ms_b1", "replay_ms_b64", "prefill_1024_ms")
    print("| config | " + " | ".join(columns) + " |\n|---" * (len(columns) + 1) + "|")
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.3g}" for c in columns) + " |")


if __name__ == "__main__":
    main()
