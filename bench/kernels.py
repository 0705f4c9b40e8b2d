"""The kernels inside one decode CUDA graph replay, by name, count and time; what a pipelined decode
step adds to its replay; and where a short prefill's time to first token goes (about a minute).

    python -m bench kernels --out $OUT [--batches 1 8] [--prefill 128] [--model 8b --layers 4]
                            [--disable-pass NAME] [--max-seq-len 512] [--prompt 4000]
                            [--inductor-option triton.enable_pdl=false]
    python -m bench kernels --model 1b --batches 1 --prefill 16384 --prefill-chunk-tokens 2048 --out $OUT

Compiles the bench's random model for the decode batches asked for, decodes 128-token prompts (`--prompt`),
then per batch: the engine step's host time against its graph's replay (CUDA events); the
replay's kernels by name (torch.profiler; count and microseconds per replay, largest first) and
the first ones in launch order; steps back to back as `generate` runs them, with what the device
runs outside the graph and how long it idles inside it and at its edges. Per `--prefill` length:
`generate(max_tokens=1)` profiled (wall time, first kernel start, last kernel end, busy time, its
kernels by name) and timed unprofiled; with `--prefill-chunk-tokens` a longer prompt runs in chunks over steps, as
an engine serves it. On the CPU (--smoke) the profiled events are the top-level
operators of an engine step and of the prefill's call, and replay-only figures are left out.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

from .common import Study, add_study_arguments, inductor_option, log
from .measure import now, time_ms
from .models import QUANTIZATIONS, compiled_llm, decode_graph, decoding, positions_for, stop
from .report import text_table

GEMM = re.compile(r"gemm|gemv|cutlass|nvjet|splitK|sm90_xmma|cublas|addmm|aten::mm|graphkiln::.*linear", re.IGNORECASE)


def device_events(run, repeats: int, cuda: bool) -> list:
    """The events, in start order, of `repeats` calls of run() after one unprofiled call: kernels and copies
    on the GPU, top-level operators on the CPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            run()
        now("cuda" if cuda else "cpu")
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.cpu_parent is None]
    return sorted(events, key=lambda e: e.time_range.start)


def by_name(events: list, repeats: int) -> list[dict]:
    """Count and microseconds per call of each event name, largest first."""
    rows = defaultdict(lambda: [0, 0.0])
    for e in events:
        rows[e.name][0] += 1
        rows[e.name][1] += e.time_range.elapsed_us()
    table = [{"name": name[:90], "per_call": n / repeats, "us": us / repeats} for name, (n, us) in rows.items()]
    return sorted(table, key=lambda r: -r["us"])


def step_and_replay(llm, batch: int, steps: int, cuda: bool, prompt: int) -> dict:
    """Median host time of one engine step (synchronized) and the replay alone (GPU)."""
    seqs = decoding(llm, batch, 3 * steps, prompt)
    walls = []
    for _ in range(steps):
        t = now("cuda" if cuda else "cpu")
        llm.engine.step()
        walls.append(now("cuda" if cuda else "cpu") - t)
    replay = time_ms(decode_graph(llm, batch).replay, "cuda", reps=5, calls=steps).median_ms if cuda else None
    stop(llm, seqs)
    return {"batch": batch, "step_ms_median": statistics.median(walls) * 1e3, "replay_ms": replay}


def pipelined(llm, batch: int, steps: int, cuda: bool, prompt: int) -> dict:
    """Steps back to back; on the GPU also the device work a step adds outside its graph (names that are
    not the replay's) and the device's idle time per step, inside the graph and at its edges."""
    seqs = decoding(llm, batch, 3 * steps, prompt)
    device = "cuda" if cuda else "cpu"
    start = now(device)
    for _ in range(steps):
        llm.engine.step()
    out: dict = {"pipelined_step_ms": (now(device) - start) * 1e3 / steps}
    events = device_events(llm.engine.step, steps, cuda)
    if cuda:
        in_graph = {e.name for e in device_events(decode_graph(llm, batch).replay, 1, cuda)}
        idle = {"inside_graph_us": 0.0, "at_graph_edges_us": 0.0}
        busy_until = events[0].time_range.end
        for before, after in zip(events, events[1:]):
            if (gap := after.time_range.start - busy_until) > 0:
                inside = before.name in in_graph and after.name in in_graph
                idle["inside_graph_us" if inside else "at_graph_edges_us"] += gap / steps
            busy_until = max(busy_until, after.time_range.end)
        out.update(outside_graph=by_name([e for e in events if e.name not in in_graph], steps), idle_per_step=idle)
    else:
        out["step_ops"] = by_name(events, steps)
    stop(llm, seqs)
    return out


def decode_kernels(llm, batch: int, cuda: bool, prompt: int) -> dict:
    """The replay's kernels by name (GPU), or an engine step's operators (CPU); the first few in order."""
    seqs = decoding(llm, batch, 40, prompt)
    run = decode_graph(llm, batch).replay if cuda else llm.engine.step
    table = by_name(device_events(run, 10, cuda), 10)
    events = device_events(run, 1, cuda)
    first = events[0].time_range.start
    order = [f"{e.time_range.start - first:7.1f} {e.time_range.elapsed_us():6.1f}  {e.name[:60]}" for e in events[:14]]
    stop(llm, seqs)
    return {"table": table, "launch_order": order, "kernel_us": sum(r["us"] for r in table),
            "gemm_us": sum(r["us"] for r in table if GEMM.search(r["name"])),
            "launches": sum(r["per_call"] for r in table)}


def prefill_timeline(llm, tokens: int, cuda: bool, repeats: int = 5) -> dict:
    """`generate(max_tokens=1)` of a `tokens`-long prompt, profiled (offsets in us from the call's start;
    the median call by wall time), and timed unprofiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import graphkiln

    params = graphkiln.SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = [11] * tokens

    def prefill():
        return llm.generate([prompt], params)

    prefill()
    timelines = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(repeats):
        now("cuda" if cuda else "cpu")
        with profile(activities=activities) as prof, record_function("generate"):
            prefill()
        events = prof.events()
        call = next(e for e in events if e.name == "generate" and e.device_type != torch.autograd.DeviceType.CUDA)
        if cuda:  # the annotation shows on the GPU's timeline too
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "generate"]
        else:
            kernels = [e for e in events if e.cpu_parent is call]
        kernels.sort(key=lambda e: e.time_range.start)
        start = call.time_range.start
        timelines.append({
            "tokens": tokens, "wall_us": call.time_range.elapsed_us(), "kernels": len(kernels),
            "first_kernel_us": kernels[0].time_range.start - start,
            "last_kernel_end_us": kernels[-1].time_range.end - start,
            "busy_us": sum(e.time_range.elapsed_us() for e in kernels),
            "longest": [f"{e.time_range.start - start:8.0f} {e.time_range.elapsed_us():6.0f} {e.name[:70]}"
                        for e in sorted(kernels, key=lambda e: -e.time_range.elapsed_us())[:8]],
            "table": by_name(kernels, 1),
        })
    median = sorted(timelines, key=lambda t: t["wall_us"])[len(timelines) // 2]
    return {**median, "unprofiled_ms": time_ms(prefill, "cuda" if cuda else "cpu", reps=10, warmup=1).median_ms}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p, layers=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batches (smoke: 1 2)")
    p.add_argument("--prefill", type=int, nargs="*", default=[128], help="prefill lengths profiled (smoke: 16)")
    p.add_argument("--disable-pass", action="append", default=[], help="a graph pass to switch off (repeatable)")
    p.add_argument("--enable-pass", action="append", default=[], help="an optional graph pass to switch on (repeatable)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="compile with --quantization")
    p.add_argument("--inductor-option", action="append", default=[], type=inductor_option, metavar="KEY=VALUE",
                   help="an Inductor config entry for the compile (CompileConfig.inductor_options; VALUE as JSON, "
                        "else a string; repeatable), e.g. triton.enable_pdl=false")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="EngineConfig.max_seq_len (default: the model's 8192); it sizes the decode graphs' block tables, "
                        "and with them the decode attention's planned splits")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="EngineConfig.max_num_batched_tokens: prefills longer than this run in chunks over steps "
                        "(default: the longest --prefill, unchunked); a prefill past 8192 tokens widens the model")
    p.add_argument("--prompt", type=int, default=128,
                   help="prompt tokens of each decoding sequence (the decode attention's context; smoke: 16)")
    p.add_argument("--specialize-sizes", type=int, nargs="*", default=[],
                   help="token counts compiled specialized (CompileConfig.specialize_sizes)")


def main(a: argparse.Namespace) -> int:
    study = Study.of("kernels", a)
    cuda = study.cuda
    batches, lengths = ([1, 2], [16]) if study.smoke else (a.batches, a.prefill)
    prompt, steps = (16, 8) if study.smoke else (a.prompt, 30)
    if not cuda:
        log("CPU smoke: no CUDA graphs on the CPU; profiling engine steps' operators instead of graph replays")
    longest = max(lengths, default=0)
    chunk = a.prefill_chunk_tokens or max([2048, *lengths])
    max_seq_len = a.max_seq_len or (longest + 16 if longest + 16 > 8192 else None)
    with study.scratch() as work:
        options = {"enabled_passes": tuple(a.enable_pass), "quantization": a.quantization,
                   "specialize_sizes": tuple(a.specialize_sizes), "inductor_options": dict(a.inductor_option)}
        llm = compiled_llm(study, work, disabled_passes=tuple(a.disable_pass), compile_options=options,
                           max_position=max(8192, positions_for(longest + 16)),
                           decode_batch_sizes=tuple(batches),
                           prefill_token_buckets=tuple(sorted({16, 128, *(min(n, chunk) for n in lengths)})),
                           max_num_batched_tokens=chunk,
                           kv_cache_tokens=4096 if study.smoke else max(65536, max(batches) * (prompt + 128),
                                                                         longest + 16),
                           max_seq_len=max_seq_len)
        results: dict = {"batches": {}, "prefill": {}, "disabled_passes": a.disable_pass, "max_seq_len": max_seq_len,
                         "prefill_chunk_tokens": chunk,
                         "prompt": prompt, **options}
        for batch in batches:
            r = {**step_and_replay(llm, batch, steps, cuda, prompt), **pipelined(llm, batch, steps, cuda, prompt),
                 **decode_kernels(llm, batch, cuda, prompt)}
            results["batches"][batch] = r
            replay = f"replay {r['replay_ms']:.3f} ms, " if cuda else ""
            print(f"\n== batch {batch}: step {r['step_ms_median']:.3f} ms host, {r['pipelined_step_ms']:.3f} ms "
                  f"pipelined; {replay}kernels {r['kernel_us']:.0f} us in {r['launches']:.0f} launches, "
                  f"GEMM {r['gemm_us']:.0f} us")
            print(text_table(r["table"][:28], ["us", "per_call", "name"]))
            print("first kernels of a replay (start us, us, name):\n" + "\n".join(r["launch_order"]))
            if cuda:
                idle = r["idle_per_step"]
                print(f"per pipelined step: device idle {idle['inside_graph_us']:.1f} us inside the graph, "
                      f"{idle['at_graph_edges_us']:.1f} us at its edges; outside the graph:")
                print(text_table(r["outside_graph"][:10], ["us", "per_call", "name"]))
            study.save(results)
        for tokens in lengths:
            t = results["prefill"][tokens] = prefill_timeline(llm, tokens, cuda)
            print(f"\n== prefill {tokens}: {t['unprofiled_ms']:.2f} ms; profiled {t['wall_us']:.0f} us, "
                  f"{t['kernels']} kernels from {t['first_kernel_us']:.0f} to {t['last_kernel_end_us']:.0f} us, "
                  f"busy {t['busy_us']:.0f} us; longest (start us, us, name):\n" + "\n".join(t["longest"]))
            print(text_table(t["table"][:24], ["us", "per_call", "name"]))
        log(f"wrote {study.save(results)}")
        llm.close()
    return 0
