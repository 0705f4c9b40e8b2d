"""Steps served beside the background preparation: how long each engine step takes while the pieces job
imports Inductor and the graphs are captured, and where every thread was during a slow one.

    python -m bench steps --out $OUT [--model tiny|1b|8b] [--processes 3] [--slow-ms 50] [--until-ready]
                                     [--no-build-kernels] [--fresh-triton-cache]

The model (the built-in `tiny` by default and with --smoke; `1b`/`8b`: random weights of those shapes) is
compiled into a scratch artifact, then each fresh process loads it (background preparation, the default
buckets), submits six requests right away (32 new tokens each, as tests/gpu/test_startup_gpu.py does) and
times every step until they finish (`--until-ready`: each finished request is replaced by a new one until the
preparation is done, so that steps meet every background capture, then the last ones finish). A watcher thread takes
every thread's Python stack once a step has run `--slow-ms` (and up to three times more, 30 ms apart),
Triton's hooks record every kernel built or read from its cache, and the collector's callbacks every full
collection, with the step each fell in. On CUDA the compile builds our Triton kernels for the artifact's
buckets (compile_model's `build_kernels`), so every process starts warm; with `--no-build-kernels` the
first process builds those it meets (a cold Triton cache, as after such a compile on another machine) and
the next ones show a warm start; with `--fresh-triton-cache` every process starts with an empty Triton cache of
its own, as on a machine the artifact was not compiled on, and reads graphkiln's kernels from the artifact.
Installed packages' bytecode is written first
(`startup.ensure_bytecode`), as `pip install` does: without it the job compiles torch's sources,
holding the interpreter lock for each module.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from .common import REPO, Study, add_study_arguments, log
from .startup import ensure_bytecode, saved_model_dir

CHILD = """
import dataclasses, gc, json, sys, threading, time, traceback
import graphkiln
from bench.stack_sampler import short_path

slow_s = float(sys.argv[2])
until_ready = sys.argv[3] == "1"
SAMPLES, SAMPLE_EVERY_S = 4, 0.03  # stacks a slow step, and how far apart
steps, samples, kernel_loads, full_collections = [], [], [], []
building, collecting = {}, {}  # when each thread began a kernel's build or read; when a collection began
state = {"step": 0, "start": None, "done": False}

def watch():
    taken = {}
    while not state["done"]:
        time.sleep(0.005)
        start, step = state["start"], state["step"]
        if start is None:
            continue
        ran, count = time.perf_counter() - start, taken.get(step, 0)
        if count < SAMPLES and ran > slow_s + SAMPLE_EVERY_S * count:
            taken[step] = count + 1
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = {names.get(i, str(i)): [f"{short_path(s.filename)}:{s.lineno} {s.name}: {s.line}"
                                             for s in traceback.extract_stack(f)[-12:]]
                      for i, f in sys._current_frames().items()}
            samples.append({"step": step, "at_s": ran, "stacks": stacks})

def kernel_load_started(**kwargs):
    building[threading.get_ident()] = time.perf_counter()
    return False

def kernel_loaded(**kwargs):
    fn = kwargs.get("fn")
    began = building.pop(threading.get_ident(), None)
    kernel_loads.append({"step": state["step"] if state["start"] is not None else None,
                         "thread": threading.current_thread().name,
                         "kernel": getattr(getattr(fn, "jit_function", fn), "__name__", str(fn)),
                         "seconds": None if began is None else time.perf_counter() - began})

def on_collection(phase, info):
    if phase == "start":
        collecting["at"] = time.perf_counter()
    elif info["generation"] == 2:
        full_collections.append({"step": state["step"] if state["start"] is not None else None,
                                 "thread": threading.current_thread().name,
                                 "seconds": time.perf_counter() - collecting["at"]})

gc.callbacks.append(on_collection)
try:  # before the load, so that its hooks see every Triton kernel built or read from its cache
    import triton
    triton.knobs.runtime.jit_cache_hook = kernel_load_started
    triton.knobs.runtime.jit_post_compile_hook = kernel_loaded
except ImportError:  # no Triton (the CPU): nothing to see
    pass
llm = graphkiln.load(sys.argv[1], kv_cache_tokens=16384)
engine = llm.engine
params = graphkiln.SamplingParams(max_tokens=32, ignore_eos=True)
seqs = [engine.add_request([5 + i] * (1 + 3 * i), params) for i in range(6)]
watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
while any(s.finish_reason is None for s in seqs):
    state["step"], state["start"] = len(steps), time.perf_counter()
    engine.step()
    steps.append(time.perf_counter() - state["start"])
    state["start"] = None
    if until_ready and not engine.preparation.ready:  # a finished request's place goes to a new one
        seqs = [s if s.finish_reason is None else engine.add_request([5 + i] * (1 + 3 * i), params)
                for i, s in enumerate(seqs)]
state["done"] = True
llm.wait_ready()
stats = llm.stats()
print("GK_STEPS " + json.dumps({"steps_s": steps, "slow_steps": samples, "kernel_loads": kernel_loads,
      "full_collections": full_collections,
      "step_waits": dataclasses.asdict(stats.step_waits),
      "prepared": [[p.kind, p.key, p.seconds, p.done_at_s, p.longest_locked_s] for p in stats.prepared]}))
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p, model="tiny")
    p.add_argument("--processes", type=int, default=3, help="fresh processes, one after another (default 3)")
    p.add_argument("--slow-ms", type=float, default=50, help="a step past this is sampled (default 50)")
    p.add_argument("--until-ready", action="store_true",
                   help="a finished request's place goes to a new one until every graph is captured, so that steps "
                        "meet every capture (default: the six requests only)")
    p.add_argument("--fresh-triton-cache", action="store_true",
                   help="each process with a Triton cache of its own, empty, as on a machine the artifact was not "
                        "compiled on: graphkiln's kernels then come from the artifact (triton-kernels/)")
    p.add_argument("--no-build-kernels", dest="build_kernels", action="store_false",
                   help="compile without building the serving kernels (compile_model's build_kernels), as a "
                        "compile on another machine: the first process then builds them (a cold Triton cache)")


def main(a: argparse.Namespace) -> int:
    import graphkiln

    study = Study.of("steps", a)
    results: dict = {"bytecode": ensure_bytecode(), "processes": []}
    name = "tiny" if study.smoke else study.model
    results["model"] = name
    with study.scratch() as scratch:
        artifact = scratch / f"{name}-artifact"
        source = saved_model_dir(name, scratch, study.device, study.dtype_name)
        started = time.perf_counter()
        _, report = graphkiln.compile_model(source, artifact, graphkiln.CompileConfig(device=study.device,
                                            dtype=study.dtype_name), build_kernels=a.build_kernels)  # fmt: skip
        results["compile"] = {"seconds": time.perf_counter() - started, "timings": report.timings}
        log(f"compiled in {results['compile']['seconds']:.1f} s; stages: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in report.timings.items()))
        for i in range(a.processes):
            env = dict(os.environ)
            if a.fresh_triton_cache:
                env.pop("TRITON_CACHE_DIR", None)
                env["TRITON_HOME"] = str(scratch / f"triton-home-{i}")
            proc = subprocess.run([sys.executable, "-c", CHILD, str(artifact), str(a.slow_ms / 1000),
                                   str(int(a.until_ready))],
                                  cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GK_STEPS ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"process {i} exited {proc.returncode}: {proc.stderr[-2000:]}")
            run = json.loads(lines[-1].removeprefix("GK_STEPS "))
            results["processes"].append(run)
            steps = run["steps_s"]
            slowest = sorted(range(len(steps)), key=lambda j: -steps[j])[:4]
            over = sum(step > a.slow_ms / 1000 for step in steps)
            log(f"process {i}: {len(steps)} steps, first {steps[0] * 1e3:.0f} ms, median "
                f"{statistics.median(steps) * 1e3:.1f} ms, {over} over {a.slow_ms:g} ms, slowest "
                + ", ".join(f"#{j} {steps[j] * 1e3:.0f} ms" for j in slowest)
                + f"; longest wait for the step lock {run['step_waits']['longest_s'] * 1e3:.0f} ms"
                + "; longest lock hold by a job {1} {2} {0:.0f} ms".format(*max(
                    (p[4] * 1e3, p[0], p[1]) for p in run["prepared"]))
                + f"; pieces in at {run['prepared'][0][3]:.2f} s, ready at {run['prepared'][-1][3]:.2f} s; "
                + f"{len(run['slow_steps'])} sampled; "
                + f"{sum(k['step'] is not None for k in run['kernel_loads'])} Triton kernels loaded and "
                + f"{sum(c['step'] is not None for c in run['full_collections'])} full collections during steps")
    log(f"wrote {study.save(results)}")
    return 0
