"""What each optional graph pass buys (a few minutes, 1B).

    python -m bench passes --out $OUT [--model 8b --layers 4]


The bench's model is compiled in this process (`compile_module`) with every pass, with each
optional pass switched off in turn, and with every pass again (the spread between the two is the
noise). Per configuration: Inductor compiles, tensors crossing the piece boundaries (from the
compiled model's split graph), the kernels of one decode step at batch 1 (torch.profiler over
graph replays), the decode replay at batch 1 and 64, and the time to first token of a 1024-token
prompt. On the CPU (--smoke) engine steps are timed instead of replays and no kernels are counted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import Study, add_study_arguments, log
from .kernels import by_name, device_events
from .measure import time_ms
from .models import decode_timer, decoding, save_model, stop
from .report import text_table

OPTIONAL = ("silu_mul_epilogue", "linear_op")
COLUMNS = ["config", "inductor_compiles", "boundary_tensors", "decode_kernels_b1", "decode_ms_b1", "decode_ms_b64",
           "prefill_ms"]


def boundary_tensors(compiled) -> int:
    """Tensors one submodule of the split (piece or attention) hands to another, summed over all cuts."""
    graph = compiled.split.gm.graph
    produced = {n for n in graph.nodes if n.op == "call_module"}
    produced |= {n for n in graph.nodes if n.op == "call_function" and n.args and n.args[0] in produced}  # getitem
    return sum(1 for n in graph.nodes if n.op == "call_module" for a in n.all_input_nodes if a in produced)


def measure(study: Study, model_dir: Path, batches: tuple[int, int], prefill: int, **compile_options) -> dict:
    """One configuration's row; `compile_options` are CompileConfig fields (disabled_passes, quantization, ...)."""
    import graphkiln
    from graphkiln.compiler.compile import compile_module
    from graphkiln.models import load_model
    from graphkiln.runtime.builder import build_engine

    net = load_model(model_dir, study.device, study.dtype_name, quantization=compile_options.get("quantization"))
    config = graphkiln.CompileConfig(device=study.device, dtype=study.dtype_name, **compile_options)
    compiled, report = compile_module(net, config)
    engine = graphkiln.EngineConfig(decode_batch_sizes=batches, prefill_token_buckets=(prefill,),
                                    max_num_batched_tokens=max(2048, prefill),
                                    kv_cache_tokens=8192 if study.smoke else 65536)
    llm = graphkiln.LLM(build_engine(net, compiled, engine), None, report.counters.as_dict())
    llm.wait_ready()
    row = {"disabled": list(config.disabled_passes), "enabled": list(config.enabled_passes),
           "compile_s": report.timings["total"], "inductor_compiles": report.counters.inductor_compiles,
           "boundary_tensors": boundary_tensors(compiled),
           "pass_matches": {r.name: r.matches for r in report.passes if r.enabled}}
    prompt = 16 if study.smoke else 128
    for b in batches:
        seqs = decoding(llm, b, 200, prompt)
        run = decode_timer(llm, b, study.cuda)
        row[f"decode_ms_b{b}"] = time_ms(run, study.device, reps=5, calls=2 if study.smoke else 50).median_ms
        if b == 1 and study.cuda:
            row["decode_kernels_b1"] = sum(r["per_call"] for r in by_name(device_events(run, 5, True), 5)
                                           if "Memcpy" not in r["name"])
        stop(llm, seqs)
    params = graphkiln.SamplingParams(max_tokens=1, ignore_eos=True)
    timing = time_ms(lambda: llm.generate([[11] * prefill], params), study.device, reps=10, warmup=1)
    row["prefill_ms"] = timing.median_ms
    llm.close()
    return row


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p)
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill tokens (default 1024; smoke 48)")


def main(a: argparse.Namespace) -> int:
    import torch

    study = Study.of("passes", a)
    batches, prefill = ((1, 2), 48) if study.smoke else ((1, 64), 1024)
    prefill = a.prefill or prefill
    if study.cuda:  # the profiler's own first-use setup, outside every measurement
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.ones(1, device="cuda").add_(1)
    else:
        log("CPU smoke: engine steps timed instead of graph replays; no kernels counted")
    configs = {"all passes": {}, **{f"no {name}": {"disabled_passes": (name,)} for name in OPTIONAL},
               "all passes (again)": {}}
    results = {}
    with study.scratch() as work:
        model_dir = save_model(study.model, work / "model", study.device, study.dtype, study.layers)
        for name, options in configs.items():
            results[name] = {"config": name, **measure(study, model_dir, batches, prefill, **options)}
            numbers = {k: v for k, v in results[name].items() if isinstance(v, (int, float))}
            log(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers.items()))
            study.save({"configs": results, "prefill_tokens": prefill})
    columns = [c.replace("b64", f"b{batches[1]}") for c in COLUMNS]
    print(text_table(list(results.values()), columns))
    log(f"wrote {study.save({'configs': results, 'prefill_tokens': prefill})}")
    return 0
