"""The kernels inside one decode CUDA graph replay, by name, count and time (one GPU call, ~1 minute),
what a pipelined decode step adds to its replay, and where a short prefill's time to first token goes.

Compiles the bench's random Llama-3.2-1B-like bf16 model for a few decode buckets, decodes a
128-token prompt per row, then profiles replays of each bucket's greedy graph with
torch.profiler and prints per-replay kernel counts and microseconds, largest first, and the
first layer's kernels in launch order. Then it times engine steps back to back, as `generate`
runs them, against the replay alone, and lists what the device runs per step outside the graph
(copies, kernels) and how long it idles inside the graph and at its edges. Then it profiles
`generate(max_tokens=1)` on a prompt of each `--prefill` length: the call's wall time, when its
first kernel started and its last ended, the GPU's busy time in between, and its kernels by name.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import build_model, prefill_ms, start_decoding, step_times, warm_prefill

GEMM = re.compile(r"gemm|gemv|cutlass|nvjet|splitK|sm90_xmma|cublas", re.IGNORECASE)


def device_events(run, repeats: int) -> list:
    """The device's events, in start order, of `repeats` calls of run() after one unprofiled call."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda e: e.time_range.start)


def by_name(events: list, repeats: int) -> list[dict]:
    rows = defaultdict(lambda: [0, 0.0])
    for event in events:
        rows[event.name][0] += 1
        rows[event.name][1] += event.device_time
    table = [{"name": name[:90], "per_replay": count / repeats, "us": total / repeats}
             for name, (count, total) in rows.items()]
    return sorted(table, key=lambda r: -r["us"])


def kernel_table(graph: torch.cuda.CUDAGraph, replays: int) -> list[dict]:
    """The kernels of one replay by name: count and microseconds, largest first (mean of `replays`)."""
    return by_name(device_events(graph.replay, replays), replays)


def launch_order(events: list, count: int) -> list[str]:
    """The first `count` kernels of one replay: start offset and duration in us, name."""
    first = events[0].time_range.start
    return [f"{e.time_range.start - first:7.1f} {e.time_range.elapsed_us():6.1f}  {e.name[:60]}"
            for e in events[:count]]


def pipelined_steps(llm, batch: int, steps: int) -> dict:
    """Engine steps back to back (as generate runs them) against the replay alone, the device work a
    step adds outside its graph (names not among the replay's kernels), and the device's idle time per
    step: inside the graph (between two of its kernels) and at its edges (next to an outside op)."""
    engine = llm.engine
    seqs = start_decoding(llm, batch, 3 * steps + 8)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    graph = engine.runner.graphs.graphs[engine.runner.graphs.bucket(batch), "greedy"][0]
    in_graph = {e.name for e in device_events(graph.replay, 1)}
    events = device_events(engine.step, steps)
    extra = by_name([e for e in events if e.name not in in_graph], steps)
    idle = {"inside_graph_us": 0.0, "at_graph_edges_us": 0.0}
    busy_until = events[0].time_range.end
    for before, after in zip(events, events[1:]):
        gap = after.time_range.start - busy_until
        if gap > 0:
            inside = before.name in in_graph and after.name in in_graph
            idle["inside_graph_us" if inside else "at_graph_edges_us"] += gap / steps
        busy_until = max(busy_until, after.time_range.end)
    for s in seqs:
        engine.abort(s)
    return {"pipelined_step_ms": step_ms, "outside_graph": extra, "idle_per_step": idle}


def prefill_timeline(llm, tokens: int, repeats: int = 5) -> dict:
    """One `generate(max_tokens=1)` of `tokens` prompt tokens, profiled: offsets in us from the call's start."""
    prefill = warm_prefill(llm, tokens)
    timelines = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof, torch.profiler.record_function("generate"):
            prefill()
        events = prof.events()
        call = next(e for e in events if e.name == "generate" and e.device_type != torch.autograd.DeviceType.CUDA)
        kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                          and e.name != "generate"),  # the annotation shows on the GPU's timeline too
                         key=lambda e: e.time_range.start)
        start = call.time_range.start
        timelines.append({
            "tokens": tokens, "wall_us": call.time_range.elapsed_us(), "kernels": len(kernels),
            "first_kernel_us": kernels[0].time_range.start - start, "last_kernel_end_us": kernels[-1].time_range.end - start,
            "gpu_busy_us": sum(e.time_range.elapsed_us() for e in kernels),
            "top": [f"{e.time_range.start - start:8.0f} {e.time_range.elapsed_us():6.0f} {e.name[:70]}"
                    for e in sorted(kernels, key=lambda e: -e.time_range.elapsed_us())[:8]],
            "table": by_name(kernels, 1),
        })
    return {**sorted(timelines, key=lambda t: t["wall_us"])[len(timelines) // 2],
            "unprofiled_ms": prefill_ms(llm, tokens)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prefill", type=int, nargs="*", default=[128])
    parser.add_argument("--model", default="1b", help="bench/gpu/models.py shape (default 1b)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--disable-pass", action="append", default=[], help="a pass to switch off (repeatable)")
    args = parser.parse_args()
    import graphkiln
    from graphkiln import CompileConfig

    work = Path(tempfile.mkdtemp())
    build_model(work / "model", args.layers, args.model)
    config = CompileConfig(device="cuda", dtype="bfloat16", decode_batch_sizes=tuple(args.batches),
                           prefill_token_buckets=tuple(sorted({128, *args.prefill})),
                           disabled_passes=tuple(args.disable_pass))
    graphkiln.compile_model(work / "model", work / "art", config)
    llm = graphkiln.load(work / "art", kv_cache_tokens=65536)
    summary = {}
    for batch in args.batches:
        timing = step_times(llm, batch, 30)
        graph = llm.engine.runner.graphs.graphs[batch, "greedy"][0]
        table = kernel_table(graph, 10)
        order = launch_order(device_events(graph.replay, 1), 14)
        pipelined = pipelined_steps(llm, batch, 30)
        gemm_us = sum(r["us"] for r in table if GEMM.search(r["name"]))
        total_us = sum(r["us"] for r in table)
        launches = sum(r["per_replay"] for r in table)
        summary[batch] = {**timing, **pipelined, "kernel_us": total_us, "gemm_us": gemm_us, "launches": launches,
                          "table": table, "launch_order": order}
        print(f"\n== batch {batch}: step {timing['step_ms_median']:.3f} ms host, "
              f"{pipelined['pipelined_step_ms']:.3f} ms pipelined; replay {timing['replay_ms']:.3f} ms, "
              f"kernels {total_us:.0f} us in {launches:.0f} launches, GEMM {gemm_us:.0f} us")
        for r in table[:28]:
            print(f"{r['us']:8.1f} us {r['per_replay']:5.0f}x  {r['name']}")
        print("first kernels of a replay (start us, us, name):\n" + "\n".join(order))
        idle = pipelined["idle_per_step"]
        print(f"per pipelined step: device idle {idle['inside_graph_us']:.1f} us inside the graph, "
              f"{idle['at_graph_edges_us']:.1f} us at its edges; outside the graph:")
        for r in pipelined["outside_graph"][:10]:
            print(f"{r['us']:8.1f} us {r['per_replay']:5.1f}x  {r['name']}")
    for tokens in args.prefill:
        timeline = prefill_timeline(llm, tokens)
        summary[f"prefill_{tokens}"] = timeline
        print(f"\n== prefill {tokens}: {timeline['unprofiled_ms']:.2f} ms; profiled {timeline['wall_us']:.0f} us, "
              f"{timeline['kernels']} kernels from "
              f"{timeline['first_kernel_us']:.0f} to {timeline['last_kernel_end_us']:.0f} us, busy "
              f"{timeline['gpu_busy_us']:.0f} us (start, us, name of the longest):")
        print("\n".join(timeline["top"]))
        print("by name:")
        for r in timeline["table"][:24]:
            print(f"{r['us']:8.1f} us {r['per_replay']:5.0f}x  {r['name']}")
    (args.out / "decode_kernels.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
