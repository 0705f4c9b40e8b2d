"""Start-up times: a fresh process (`python -m bench _startup SPEC`) loads a model and makes one token.

    python -m bench startup --models 1b,8b --out "$OUT"     # warm starts on the GPU (cold too: --cold)
    python -m bench startup --smoke                          # the built-in tiny model on the CPU
    python -m bench startup --models 8b --load-switch-intervals off,0.0001   # A/B: each warm start per value

The parent notes the time before it spawns the child; the child prints, after CHILD_PREFIX, one
JSON line with the wall-clock time at each mark. The phases between marks, from process start:

  import_torch      Python start and `import torch`
  import_api        graphkiln's API (or transformers' Llama): no Inductor, which `load` imports
  cuda_init         the CUDA context (done by hand, so it is not counted in the load; with
                    `--cuda-in-load` it is left to `load`, as a user's script does, and not a phase)
  compile           cold only: `compile_model` (its stage seconds in `compile_timings`)
  load              `graphkiln.load` (transformers: `from_pretrained`), split for graphkiln by
                    LLM.stats().load into weights (read to the device) and the rest (checks,
                    tokenizer, KV cache). A background load (the default) returns before the compiled
                    pieces are in: its first background job imports Inductor (inductor: torch's cost)
                    and loads them (pieces), done `compiled_after_load` seconds after load returned,
                    and requests are served by the model itself until then. A blocking load does both
                    inside `load`, the weights read beside them.
  first_token       generate(max_tokens=1) of a random prompt, right after load: graphs are still
                    being captured in the background; `first_token_wait` is how long its steps
                    waited behind a capture (EngineStats.step_waits)
  ready             graphkiln: until every graph is captured (LLM.wait_ready())

`--profile` samples every thread's stack in each child (`stack_sampler.py`) and adds the counts to its JSON.

`second_request` (graphkiln; not a phase of the start) is the same request with the prompt reversed,
sent once the first has its token (its own wait behind a capture: `second_request_wait_s`):
what the first request paid beyond it, and beyond its wait, is first-call work (kernels loaded on first
launch, libraries initialised, lazy imports).

The child also lists the modules imported after `load` returned (`imported_after_load`): lazy imports
that the first request or the background captures paid for.

Before any start-up is timed, `ensure_bytecode` writes the .pyc files the installed packages lack,
as `pip install` does: without them every fresh process compiles torch's sources again.
"""

from __future__ import annotations

import argparse
import compileall
import dataclasses
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import REPO, environment, inductor_option, log, random_prompts, write_json
from .stack_sampler import StackSampler

CHILD_PREFIX = "GK_BENCH_CHILD "


def ensure_bytecode() -> dict:
    """Compile graphkiln's own package (an editable install's sources, which a `pip install` would have compiled;
    where the interpreter writes no bytecode, every fresh process compiles them again), then the site-packages
    that hold torch unless torch's own bytecode is there already."""
    ours = compileall.compile_dir(REPO / "graphkiln", quiet=2)  # up-to-date files are skipped
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    if (torch_dir / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").exists():
        return {"state": "present", "graphkiln": bool(ours)}
    start = time.time()
    ok = compileall.compile_dir(torch_dir.parent, quiet=2, workers=os.cpu_count() or 1)
    return {"state": "written" if ok else "partly written (some directories are read-only)",
            "directory": str(torch_dir.parent), "seconds": round(time.time() - start, 1), "graphkiln": bool(ours)}


def run_child(spec: dict, env_extra: dict, timeout: float | None) -> dict:
    """Run a start-up child; its result with `phases_s` and `start_to_first_token_s` (from the spawn)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "bench", "_startup", json.dumps(spec)], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        raise RuntimeError(f"start-up child {spec['mode']} exited {proc.returncode}: {tail}")
    res = json.loads(lines[-1][len(CHILD_PREFIX):])
    marks = res.pop("marks")
    order = [(k, marks[k]) for k in ("torch_imported", "imported", "cuda_ready", "compiled", "loaded", "first_token",
                                     "ready") if k in marks]  # fmt: skip
    names = {"torch_imported": "import_torch", "imported": "import_api", "cuda_ready": "cuda_init",
             "compiled": "compile", "loaded": "load", "first_token": "first_token", "ready": "ready"}
    phases, previous = {}, t0
    for key, at in order:
        phases[names[key]] = at - previous
        previous = at
    if "load" in res:  # graphkiln: the load split by LLM.stats().load
        stages = res["load"]["stages"]
        phases["weights"] = stages.get("weights", 0.0)
        phases["inductor"] = stages.get("inductor", 0.0)
        phases["pieces"] = stages.get("pieces", 0.0)
        deferred = res.get("compiled_after_load_s") is not None  # pieces loaded by a background job
        phases["load_rest"] = phases["load"] - (0.0 if deferred else phases["inductor"] + phases["pieces"])
        phases["compiled_after_load"] = res.get("compiled_after_load_s")
        phases["first_token_wait"] = res["first_token_wait_s"]
        phases["second_request"] = res["second_request_s"]
        phases["capture"] = res["capture_s"]
    res["phases_s"] = phases
    res["start_to_first_token_s"] = marks["first_token"] - t0
    if "ready" in marks:
        res["start_to_ready_s"] = marks["ready"] - t0
    res["process_wall_s"] = time.time() - t0
    return res


def child_main(spec: dict) -> None:
    """The child: import, CUDA, (compile,) load, first token; prints one JSON line."""
    marks: dict[str, float] = {}
    res: dict = {"mode": spec["mode"]}
    sampler = StackSampler() if spec.get("profile") else None
    import torch

    marks["torch_imported"] = time.time()

    device, prompt = spec["device"], spec["prompt"]
    if spec["mode"] == "hf_start":
        from transformers import LlamaForCausalLM
    else:
        import graphkiln

        graphkiln.load, graphkiln.SamplingParams  # noqa: B018  (the API's modules, imported on first use)
    marks["imported"] = time.time()
    if device == "cuda" and not spec.get("cuda_in_load"):
        torch.zeros(1, device=device)
        marks["cuda_ready"] = time.time()
    if spec["mode"] == "hf_start":
        dtype = getattr(torch, spec["dtype"])
        if importlib.util.find_spec("accelerate"):  # loads straight onto the device
            model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, device_map=device).eval()
        else:
            model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).to(device).eval()
        marks["loaded"] = time.time()
        ids = torch.tensor([prompt], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       pad_token_id=model.config.eos_token_id)
        if device == "cuda":
            torch.cuda.synchronize()
        marks["first_token"] = time.time()
    else:
        if spec["mode"] == "gk_cold":
            config = graphkiln.CompileConfig(device=device, dtype=spec["dtype"], quantization=spec.get("quantization"),
                                             inductor_options=spec.get("inductor_options", {}),
                                             **spec.get("passes", {}))
            engine = graphkiln.EngineConfig(**spec["engine"])
            _, report = graphkiln.compile_model(spec["model_dir"], spec["artifact"], config, engine=engine, force=True,
                                                build_kernels=False)  # (this process loads it next)
            marks["compiled"] = time.time()
            res.update(compile_timings=report.timings, compile_summary=report.summary(),
                       counters=report.counters.as_dict())
        from graphkiln.compiler.counters import torch_compile_events

        _phase(sampler, "load")
        llm = graphkiln.load(spec["artifact"], **spec["engine"])
        marks["loaded"] = time.time()
        _phase(sampler, "first_token")
        loaded = set(sys.modules)
        one_token = graphkiln.SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([prompt], one_token)
        marks["first_token"] = time.time()
        first_waits = llm.stats().step_waits  # this read may wait for a capture: it is not a step
        asked = time.time()
        _phase(sampler, "second_request")
        llm.generate([prompt[::-1]], one_token)
        res["second_request_s"] = time.time() - asked
        _phase(sampler, "until_ready")
        llm.wait_ready()
        marks["ready"] = time.time()
        res["imported_after_load"] = sorted(set(sys.modules) - loaded)
        stats = llm.stats()
        res["first_token_wait_s"] = first_waits.total_s
        res["second_request_wait_s"] = stats.step_waits.total_s - first_waits.total_s
        res["capture_s"] = sum(g.capture_s for g in stats.graphs.values())
        res["graphs"] = stats.graphs_captured
        res["load"] = {**dataclasses.asdict(stats.load), "weights_GBps": stats.load.weights_gb_per_s}
        res["prepare_errors"] = [p.error for p in stats.prepared if p.error]
        slowest = sorted(stats.prepared, key=lambda p: p.seconds, reverse=True)[:8]
        res["slowest_jobs"] = [{"kind": p.kind, "key": p.key, "seconds": p.seconds, "done_at_s": p.done_at_s,
                                "longest_locked_s": p.longest_locked_s}
                               for p in slowest]  # a step waits behind at most one of these  # fmt: skip
        res["steps_without_graph"] = stats.steps_without_graph
        pieces = [p for p in stats.prepared if p.kind == "pieces"]
        res["compiled_after_load_s"] = pieces[0].done_at_s if pieces else None  # the engine is built as load ends
        res["compile_events_after_load"] = torch_compile_events()
        res["transformers_imported"] = "transformers" in sys.modules
        res["flashinfer_imported"] = "flashinfer" in sys.modules
    res["marks"] = marks
    if sampler is not None:
        res["profile"] = sampler.stop()
    print(CHILD_PREFIX + json.dumps(res), flush=True)


def _phase(sampler: StackSampler | None, label: str) -> None:
    if sampler is not None:
        sampler.phase(label)


# The start-up study: `python -m bench startup`.

COLUMNS = ("import_torch", "import_api", "cuda_init", "compile", "load", "weights", "inductor", "pieces",
           "compiled_after_load", "load_rest", "first_token", "first_token_wait", "second_request")  # fmt: skip


def breakdown_table(rows: list[tuple[str, dict]]) -> str:
    """One markdown table: per start, the phases from process start to the first token, then graphs ready."""
    header = ["start", "import torch", "import graphkiln", "CUDA init", "compile", "load", "of it: weights", "GB/s",
              "import Inductor", "pieces", "pieces in (after load)", "rest", "first token", "of it: waited", "2nd request", "start→1st token",
              "capture (background)", "start→ready"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, child in rows:
        if "error" in child:
            lines.append(f"| {name} | " + " | ".join(["err"] * (len(header) - 1)) + " |")
            continue
        p = child["phases_s"]
        cells = [p.get(k) for k in COLUMNS]
        rate = (child.get("load") or {}).get("weights_GBps")
        cells = cells[:6] + [rate] + cells[6:] + [child.get("start_to_first_token_s"), p.get("capture"),
                                                   child.get("start_to_ready_s")]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    import shutil
    import tempfile

    import torch

    device = "cpu" if a.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --smoke on a machine without a GPU", file=sys.stderr)
        return 2
    models = ("tiny",) if a.smoke else tuple(m for m in a.models.split(",") if m)
    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = {"attention_backend": "sdpa" if device == "cpu" else "triton"}
    if a.kv_cache_tokens:
        engine["kv_cache_tokens"] = a.kv_cache_tokens
    from graphkiln.models.switch_interval import LOAD_SWITCH_INTERVAL_ENV

    intervals = [v.strip() for v in a.load_switch_intervals.split(",")] if a.load_switch_intervals else [""]
    scratch = Path(tempfile.mkdtemp(prefix="gk-startup-"))
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"), "TRITON_CACHE_DIR": str(scratch / "triton")}
    results = {"meta": {**environment(device), "bytecode": ensure_bytecode(), "models": models,
                         "cuda_in_load": a.cuda_in_load, "inductor_options": dict(a.inductor_option)}, "starts": {}}
    rows = []
    try:
        for name in models:
            model_dir = saved_model_dir(name, scratch, device, dtype)
            spec = {"model_dir": model_dir, "artifact": str(scratch / f"{name}-artifact"), "device": device,
                    "profile": a.profile, "cuda_in_load": a.cuda_in_load,
                    "dtype": dtype, "engine": engine, "inductor_options": dict(a.inductor_option),
                    "prompt": random_prompts(1, 16 if a.smoke else 128, 4096, 7)[0]}
            whiches = ("cold", "warm", "warm") if a.cold else ("warm", "warm")
            if not a.cold:
                log(f"{name}: compiling the artifact (not timed)")
                _compile(spec, caches)
            for (i, which), interval in itertools.product(enumerate(whiches), intervals):
                label = f"{name} {which}" + (" (again)" if i and whiches[i - 1] == which else "")
                label += f", switch interval {interval}" if interval else ""
                env = {**caches, LOAD_SWITCH_INTERVAL_ENV: interval} if interval else caches
                try:
                    child = run_child({**spec, "mode": f"gk_{which}"}, env, timeout=a.timeout_s)
                    jobs = child.get("slowest_jobs", [])[:3]
                    slowest = ", ".join(f"{j['kind']} {j['key']} {j['seconds']:.3f} s" for j in jobs)
                    log(f"{label}: first token at {child['start_to_first_token_s']:.2f} s, ready at "
                        f"{child.get('start_to_ready_s', 0):.2f} s; slowest preparation jobs: {slowest or 'none'}")
                except Exception as e:  # noqa: BLE001  (kept in the JSON and the table)
                    child = {"error": f"{type(e).__name__}: {e}"[:2000]}
                    log(f"{label} failed: {child['error']}")
                results["starts"][label] = child
                rows.append((label, child))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    table = breakdown_table(rows)
    print(table, flush=True)
    if a.out:
        out = Path(a.out)
        write_json(out / f"startup-{device}.json", results)
        (out / f"startup-{device}.md").write_text(table + "\n")
    return 0


def saved_model_dir(name: str, scratch: Path, device: str, dtype: str) -> str:
    """`tiny` as shipped; `1b`/`8b` random-weight models of those shapes, saved to the scratch folder."""
    if name == "tiny":
        return "tiny"
    import torch

    from .models import build_hf_model, shape_of

    log(f"{name}: building and saving a random-weight model")
    model = build_hf_model(shape_of(name), device, getattr(torch, dtype))
    model.save_pretrained(scratch / name)
    del model
    return str(scratch / name)


def _compile(spec: dict, caches: dict) -> None:
    """The artifact, compiled in a child with the start-up children's caches (so warm starts find them)."""
    import subprocess as sp

    code = ("import graphkiln, json, sys; s = json.loads(sys.argv[1]); graphkiln.compile_model(s['model_dir'], "
            "s['artifact'], graphkiln.CompileConfig(device=s['device'], dtype=s['dtype'], "
            "inductor_options=s['inductor_options']), "
            "engine=graphkiln.EngineConfig(**s['engine']), force=True)")
    sp.run([sys.executable, "-c", code, json.dumps(spec)], env=dict(os.environ, **caches), cwd=str(REPO), check=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="1b,8b", help="comma list of tiny, 1b, 8b (default 1b,8b)")
    p.add_argument("--cold", action="store_true", help="also a cold start (compile_model with empty caches) first")
    p.add_argument("--kv-cache-tokens", type=int, help="KV cache size (default: the engine's)")
    p.add_argument("--timeout-s", type=float, default=400, help="per start-up child (default 400)")
    p.add_argument("--smoke", action="store_true", help="the built-in tiny model on the CPU")
    p.add_argument("--load-switch-intervals",
                   help="comma list of GRAPHKILN_LOAD_SWITCH_INTERVAL values (seconds or off), each start run once "
                        "per value: the switch interval while load reads the weights beside the Inductor import")
    p.add_argument("--profile", action="store_true",
                   help="sample every thread's Python stack in each start (bench/stack_sampler.py): the JSON gets, "
                        "per phase and thread, the functions most often on the stack")
    p.add_argument("--cuda-in-load", action="store_true",
                   help="leave the CUDA context to load, as a user's script does (default: made by hand before it)")
    p.add_argument("--inductor-option", action="append", default=[], type=inductor_option, metavar="KEY=VALUE",
                   help="an Inductor config entry for the compile (as `bench kernels` takes it), e.g. "
                        "triton.enable_pdl=false: what an option costs a start")
    p.add_argument("--out", help="folder for startup-<device>.json and .md")
