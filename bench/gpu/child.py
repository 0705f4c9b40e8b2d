"""Start-up times: a fresh process (the entry script with --child SPEC) loads a model and makes one token.

run_child is the parent's side, child_main the child's; the child prints one JSON line after CHILD_PREFIX.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .common import ENTRY, REPO, ensure_graphkiln
from .timing import sync

CHILD_PREFIX = "GK_BENCH_CHILD "


def run_child(spec: dict, env_extra: dict, timeout: float | None) -> dict:
    """Run the entry script as `--child SPEC` in a fresh process; returns its result plus start-to-token time."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    cmd = [sys.executable, str(ENTRY), "--child", json.dumps(spec)]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    wall = time.time() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        raise RuntimeError(f"child {spec['mode']} exited {proc.returncode}: {tail}")
    result = json.loads(lines[-1][len(CHILD_PREFIX):])
    result["process_wall_s"] = wall
    result["start_to_first_token_s"] = result.pop("first_token_wall") - t0
    return result


def graph_stats(llm) -> dict:
    """CaptureStats of the decode (full) and prefill (piecewise) CUDA graphs; pool bytes summed over both."""
    out: dict = {"graph_pool_bytes": None, "capture_s": None, "graphs": 0}
    runner = llm.engine.runner
    for kind, attr in (("decode", "graphs"), ("prefill", "prefill_graphs")):
        stats = getattr(getattr(runner, attr, None), "stats", None)
        if stats is None:
            continue
        out[f"{kind}_graphs"] = stats.graphs
        out[f"{kind}_capture_s"] = stats.seconds
        out[f"{kind}_pool_bytes"] = stats.pool_bytes
        out["graph_pool_bytes"] = (out["graph_pool_bytes"] or 0) + stats.pool_bytes
        out["capture_s"] = (out["capture_s"] or 0.0) + stats.seconds
        out["graphs"] += stats.graphs
    return out


def child_main(spec: dict) -> None:
    """A fresh process: (compile,) load, first token; prints one JSON line."""
    t_import = time.time()
    import torch

    res: dict = {"mode": spec["mode"]}
    prompt = spec["prompt"]
    if spec["mode"] == "hf_start":
        from transformers import LlamaForCausalLM

        res["import_s"] = time.time() - t_import
        t = time.time()
        dtype = getattr(torch, spec["dtype"])
        try:
            model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, device_map=spec["device"])
        except Exception:  # noqa: BLE001  (no accelerate, or an older keyword)
            model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).to(spec["device"])
        model.eval()
        res["load_s"] = time.time() - t
        ids = torch.tensor([prompt], device=spec["device"])
        t = time.time()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       pad_token_id=model.config.eos_token_id)
        sync(spec["device"])
        res["first_token_wall"] = time.time()
        res["generate_s"] = res["first_token_wall"] - t
    else:
        ensure_graphkiln()
        import graphkiln
        from graphkiln import CompileConfig, SamplingParams

        res["import_s"] = time.time() - t_import
        if spec["mode"] == "gk_cold":
            t = time.time()
            _, report = graphkiln.compile_model(spec["model_dir"], spec["artifact"], CompileConfig(**spec["config"]), force=True)
            res["compile_s"] = time.time() - t
            res["compile_timings"] = report.timings
            res["compile_summary"] = report.summary()
            res["counters"] = report.counters.as_dict()
        t = time.time()
        llm = graphkiln.load(spec["artifact"], **spec["engine"])
        res["load_s"] = time.time() - t
        res.update(graph_stats(llm))
        t = time.time()
        out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        res["first_token_wall"] = time.time()
        res["generate_s"] = res["first_token_wall"] - t
        res["ttft_s"] = out[0].time_to_first_token_s
        res["transformers_imported"] = "transformers" in sys.modules
    print(CHILD_PREFIX + json.dumps(res), flush=True)
