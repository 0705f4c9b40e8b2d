"""The kernels inside one decode CUDA graph replay, by name, count and time (one GPU call, ~1 minute).

Compiles the bench's random Llama-3.2-1B-like bf16 model for a few decode buckets, decodes a
128-token prompt per row, then profiles replays of each bucket's greedy graph with
torch.profiler and prints per-replay kernel counts and microseconds, largest first.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import build_model, step_times

GEMM = re.compile(r"gemm|gemv|cutlass|nvjet|splitK|sm90_xmma|cublas", re.IGNORECASE)


def kernel_table(graph: torch.cuda.CUDAGraph, replays: int) -> list[dict]:
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            rows[event.name][0] += 1
            rows[event.name][1] += event.device_time
    table = [{"name": name[:90], "per_replay": count / replays, "us": total / replays}
             for name, (count, total) in rows.items()]
    return sorted(table, key=lambda r: -r["us"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    import graphkiln
    from graphkiln import CompileConfig

    work = Path(tempfile.mkdtemp())
    build_model(work / "model", 16)
    config = CompileConfig(device="cuda", dtype="bfloat16", decode_batch_sizes=tuple(args.batches),
                           prefill_token_buckets=(128,))
    graphkiln.compile_model(work / "model", work / "art", config)
    llm = graphkiln.load(work / "art", kv_cache_tokens=65536)
    summary = {}
    for batch in args.batches:
        timing = step_times(llm, batch, 30)
        graph = llm.engine.runner.graphs.graphs[batch, "greedy"][0]
        table = kernel_table(graph, 10)
        gemm_us = sum(r["us"] for r in table if GEMM.search(r["name"]))
        total_us = sum(r["us"] for r in table)
        launches = sum(r["per_replay"] for r in table)
        summary[batch] = {**timing, "kernel_us": total_us, "gemm_us": gemm_us, "launches": launches, "table": table}
        print(f"\n== batch {batch}: step {timing['step_ms_median']:.3f} ms, replay {timing['replay_ms']:.3f} ms, "
              f"kernels {total_us:.0f} us in {launches:.0f} launches, GEMM {gemm_us:.0f} us")
        for r in table[:28]:
            print(f"{r['us']:8.1f} us {r['per_replay']:5.0f}x  {r['name']}")
    (args.out / "decode_kernels.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
