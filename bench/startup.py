"""Start-up times: a fresh process (`python -m bench _startup SPEC`) loads a model and makes one token.

The parent notes the time before it spawns the child; the child prints, after CHILD_PREFIX, one
JSON line with the wall-clock time at each mark. The phases between marks, from process start:

  import       Python start, `import torch` and graphkiln's API (or transformers' Llama)
  cuda_init    the CUDA context (done by hand, so it is not counted in the load)
  compile      cold only: `compile_model` (its stage seconds in `compile_timings`)
  load         `graphkiln.load` (transformers: `from_pretrained`), split for graphkiln into
               capture (LLM.stats(): every graph kind's capture seconds), weights (`load_model` of
               the same files with the manifest's config, as load calls it, timed again after the
               first token: the page cache as warm as in the load) and pieces_etc (the rest:
               checks, compiled pieces, tokenizer, KV cache)
  first_token  generate(max_tokens=1) of a random prompt

Before any start-up is timed, `ensure_bytecode` writes the .pyc files the installed packages lack,
as `pip install` does: without them every fresh process compiles torch's sources again.
"""

from __future__ import annotations

import compileall
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import REPO

CHILD_PREFIX = "GK_BENCH_CHILD "


def ensure_bytecode() -> dict:
    """Compile the site-packages that hold torch unless torch's own bytecode is there already."""
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    if (torch_dir / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").exists():
        return {"state": "present"}
    start = time.time()
    ok = compileall.compile_dir(torch_dir.parent, quiet=2, workers=os.cpu_count() or 1)
    return {"state": "written" if ok else "partly written (some directories are read-only)",
            "directory": str(torch_dir.parent), "seconds": round(time.time() - start, 1)}


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
    order = [(k, marks[k]) for k in ("imported", "cuda_ready", "compiled", "loaded", "first_token") if k in marks]
    names = {"imported": "import", "cuda_ready": "cuda_init", "compiled": "compile", "loaded": "load",
             "first_token": "first_token"}
    phases, previous = {}, t0
    for key, at in order:
        phases[names[key]] = at - previous
        previous = at
    if "weights_s" in res:  # graphkiln: the load split into weights, capture and the rest
        phases["weights"] = res["weights_s"]
        phases["capture"] = res["capture_s"]
        phases["pieces_etc"] = phases["load"] - res["weights_s"] - res["capture_s"]
    res["phases_s"] = phases
    res["start_to_first_token_s"] = marks["first_token"] - t0
    res["process_wall_s"] = time.time() - t0
    return res


def child_main(spec: dict) -> None:
    """The child: import, CUDA, (compile,) load, first token; prints one JSON line."""
    marks: dict[str, float] = {}
    res: dict = {"mode": spec["mode"]}
    import torch

    device, prompt = spec["device"], spec["prompt"]
    if spec["mode"] == "hf_start":
        from transformers import LlamaForCausalLM
    else:
        import graphkiln

        graphkiln.load, graphkiln.SamplingParams  # noqa: B018  (the API's modules, imported on first use)
    marks["imported"] = time.time()
    if device == "cuda":
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
            config = graphkiln.CompileConfig(device=device, dtype=spec["dtype"], quantization=spec["quantization"])
            engine = graphkiln.EngineConfig(**spec["engine"])
            _, report = graphkiln.compile_model(spec["model_dir"], spec["artifact"], config, engine=engine, force=True)
            marks["compiled"] = time.time()
            res.update(compile_timings=report.timings, compile_summary=report.summary(),
                       counters=report.counters.as_dict())
        llm = graphkiln.load(spec["artifact"], **spec["engine"])
        marks["loaded"] = time.time()
        llm.generate([prompt], graphkiln.SamplingParams(max_tokens=1, ignore_eos=True))
        marks["first_token"] = time.time()
        stats = llm.stats()
        res["capture_s"] = sum(g.capture_s for g in stats.graphs.values())
        res["graphs"] = stats.graphs_captured
        res["transformers_imported"] = "transformers" in sys.modules
        from graphkiln.models import ModelConfig, load_model

        t = time.time()  # as load reads them: with the config the manifest recorded
        load_model(spec["model_dir"], device, spec["dtype"], ModelConfig.from_dict(llm.manifest["model"]["config"]))
        if device == "cuda":
            torch.cuda.synchronize()
        res["weights_s"] = time.time() - t
    res["marks"] = marks
    print(CHILD_PREFIX + json.dumps(res), flush=True)
