"""The main run: graphkiln beside transformers (eager; static cache + its torch.compile) and the
bandwidth floor, on one GPU, in one command of at most ten minutes.

    python -m bench run --models 1b --out "$OUT"                      # about 3 minutes on an H200
    python -m bench run --models 8b --static-models '' --out "$OUT"   # about 4 minutes
    python -m bench run --smoke --out /tmp/bench-smoke                # CPU, tiny float32 shapes

Random-weight models (models.py) are built with transformers' classes and saved to a scratch
folder both sides load. Per model, most important first (a short budget drops the least
important rows): transformers eager (its start in a fresh process), graphkiln compiled (cold
start: compile_model in a fresh process with empty Inductor/Triton caches; warm start: load in
another; then load here for the timings), graphkiln eager (the reference engine); after all
models, transformers with cache_implementation="static" (it compiles its decode step on the first
call, for minutes). Rows that would start after --budget-s are skipped, the row still running at
--hard-limit-s is stopped (SIGALRM), and the JSON (rewritten after every row), the markdown (also
printed) and the PNG are written either way. Errors land in the JSON, row by row.

The smoke mode runs every line but the CUDA graphs on the CPU (graphkiln engines capture none
there, as the JSON's graph stats show).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import report
from .common import T0, device_slug, environment, error_text, log, random_prompts, write_json
from .measure import copy_rate, matmul_rate, now
from .models import MODELS, build_hf_model, model_bytes, scratch_dir, shape_of
from .startup import ensure_bytecode, run_child

# --rows key -> (JSON row name, what the log calls it, seconds it needs at least: with less budget left
# it is skipped, recorded, not run). In the order a model runs them.
ROWS = {
    "hf_eager": ("transformers_eager", "transformers eager", 25),
    "gk_compiled": ("graphkiln_compiled", "graphkiln compiled + CUDA graphs", 90),
    "gk_eager": ("graphkiln_eager", "graphkiln eager", 25),
    "hf_static": ("transformers_static", "transformers static cache + torch.compile", 150),
}
BUILD_MIN_S = 30  # the same, for building and saving a model


class OutOfTime(BaseException):
    """Raised by the watchdog at --hard-limit-s inside whatever runs; like KeyboardInterrupt, the rows'
    `except Exception` let it through, so the run stops and still writes its tables."""


def csv(text: str, kind=int) -> tuple:
    return tuple(kind(x.strip()) for x in text.split(",") if x.strip())


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(1 << i for i in range(hi.bit_length()) if lo <= 1 << i <= hi)


class Settings:
    """Everything a run decides up front, from the command line or the smoke defaults."""

    def __init__(self, a: argparse.Namespace) -> None:
        smoke = self.smoke = a.smoke
        self.device = "cpu" if smoke else "cuda"
        self.dtype_name = "float32" if smoke else "bfloat16"
        self.dtype_bytes = 4 if smoke else 2
        self.models = csv(a.models or ("smoke" if smoke else "1b,8b"), str)
        self.rows = csv(a.rows or ",".join(ROWS), str)
        self.batches = csv(a.batches or ("1,2" if smoke else "1,8,32,64"))
        self.prefill_lens = csv(a.prefill or ("16,48" if smoke else "128,1024,4096"))
        self.prompt_len = a.prompt_len or (16 if smoke else 128)
        self.new_tokens = a.new_tokens or (8 if smoke else 128)
        self.static_models = csv(a.static_models if a.static_models is not None else ("smoke" if smoke else "1b"), str)
        self.static_batches = csv(a.static_batches or "1")
        self.decode_reps = a.decode_reps
        self.prefill_reps = a.prefill_reps or (2 if smoke else 5)
        self.budget_s = a.budget_s or (1500 if smoke else 450)
        self.hard_limit_s = a.hard_limit_s if a.hard_limit_s is not None else self.budget_s + 80
        self.max_position = 512 if smoke else 8192
        self.copy_bytes = (64 << 20) if smoke else (2 << 30)
        self.matmul_n = 256 if smoke else 8192
        self.plot, self.keep, self.commit, self.start = not a.no_plot, a.keep, a.commit, not a.no_start
        self.out = Path(a.out or os.environ.get("OUT") or "bench/results").resolve()
        # One engine for every graphkiln row: room for the largest decode batch or prefill.
        longest = max(max(self.batches) * (self.prompt_len + self.new_tokens), max(self.prefill_lens) + 16)
        self.engine = dict(
            attention_backend="sdpa" if smoke else "triton",
            decode_batch_sizes=csv(a.decode_buckets) if a.decode_buckets else tuple(
                sorted(set(powers_of_two(1, max(self.batches))) | set(self.batches))),
            prefill_token_buckets=csv(a.prefill_buckets) if a.prefill_buckets else (
                (16, 32) if smoke else powers_of_two(16, max(self.prefill_lens))),
            kv_cache_tokens=-(-(longest + 512) // 1024) * 1024,
            max_num_batched_tokens=max(max(self.batches) * self.prompt_len, max(self.prefill_lens)),
            max_num_seqs=max(256, max(self.batches)),
        )

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    def remaining(self) -> float:
        """Seconds until --budget-s: rows that would start later are skipped."""
        return self.budget_s - (time.time() - T0)

    def child_timeout(self, reserve: float, cap: float | None = None) -> float | None:
        """A subprocess timeout that leaves `reserve` seconds before --hard-limit-s (None: no limit)."""
        if not self.hard_limit_s:
            return cap
        left = max(30.0, self.hard_limit_s - (time.time() - T0) - reserve)
        return left if cap is None else min(cap, left)

    def as_dict(self) -> dict:
        return {**vars(self), "decode_buckets": self.engine["decode_batch_sizes"],
                "prefill_buckets": self.engine["prefill_token_buckets"]}


# Device memory and the loops every row shares.


def free_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def decode_cell(runs: list[dict], new_tokens: int, **extra) -> dict:
    """The fastest of `runs` (each {"total_s", "ttft_s"} of one generate call) as a decode cell."""
    best = min(runs, key=lambda r: r["total_s"])
    cell = {"total_s": best["total_s"], "new_tokens": new_tokens,
            "ms_per_token_plain": best["total_s"] / new_tokens * 1e3}
    if best["ttft_s"] is not None:
        cell["ttft_ms"] = best["ttft_s"] * 1e3
        cell["ms_per_token"] = (best["total_s"] - best["ttft_s"]) / max(1, new_tokens - 1) * 1e3
    return {**cell, **extra, "all_total_s": [r["total_s"] for r in runs]}


def measure_prefill(row: dict, s: Settings, label: str, times_ms) -> None:
    """Per prefill length n: the median of `times_ms(n)` (milliseconds, after a warm-up), or the error."""
    for n in s.prefill_lens:
        try:
            times = times_ms(n)
            row["prefill"][str(n)] = {"ms": statistics.median(times), "all_ms": times}
            log(f"  {label} prefill {n}: {statistics.median(times):.2f} ms")
        except Exception as e:  # noqa: BLE001
            row["prefill"][str(n)] = {"error": error_text(e)}
            log(f"  {label} prefill {n} failed: {error_text(e)}")


def measure_decode(row: dict, s: Settings, label: str, generate, vocab: int, save) -> None:
    """Per batch: a short warm-up call, then the fastest of --decode-reps `generate(prompts, new_tokens)` calls."""
    for b in s.batches:
        if s.remaining() < 5:
            row["decode"][str(b)] = {"error": "skipped: time budget spent"}
            continue
        try:
            prompts = random_prompts(b, s.prompt_len, vocab, seed=b)
            generate(prompts, min(4, s.new_tokens))  # kernels, allocator: the same prefill and decode shapes
            runs = [generate(prompts, s.new_tokens) for _ in range(s.decode_reps)]
            row["decode"][str(b)] = decode_cell(runs, s.new_tokens)
            log(f"  {label} batch {b}: {row['decode'][str(b)].get('ms_per_token', float('nan')):.3f} ms/token")
        except Exception as e:  # noqa: BLE001
            row["decode"][str(b)] = {"error": error_text(e)}
            log(f"  {label} batch {b} failed: {error_text(e)}")
        save()


# The transformers rows.


def hf_generate(model, prompts: list[list[int]], new_tokens: int, s: Settings, **extra) -> dict:
    """One generate call; the time to first token from a streamer's stamps (its first put is the prompt)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # generate hands it CPU tensors: the device has caught up
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    ids = torch.tensor(prompts, device=s.device)
    stamps = Stamps()
    t0 = now(s.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=model.generation_config.pad_token_id, streamer=stamps, **extra)
    total = now(s.device) - t0
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return {"total_s": total, "ttft_s": stamps.times[1] - t0 if len(stamps.times) >= 2 else None}


def hf_prefill_ms(model, n: int, s: Settings) -> list[float]:
    import torch

    ids = torch.tensor(random_prompts(1, n, model.config.vocab_size, seed=1000 + n), device=s.device)
    with torch.inference_mode():
        model(input_ids=ids, logits_to_keep=1)
        times = []
        for _ in range(s.prefill_reps):
            t = now(s.device)
            model(input_ids=ids, logits_to_keep=1)
            times.append((now(s.device) - t) * 1e3)
    return times


def hf_eager(s: Settings, mres: dict, row: dict, save) -> None:
    """The model built for this run (then freed), and its start to first token in a fresh process."""
    model = mres.pop("_hf_model")
    try:
        measure_prefill(row, s, "transformers eager", lambda n: hf_prefill_ms(model, n, s))
        vocab = model.config.vocab_size
        measure_decode(row, s, "transformers eager", lambda p, k: hf_generate(model, p, k, s), vocab, save)
    finally:
        del model
        free_memory(s.device)
    if not s.start:
        return
    try:
        spec = {"mode": "hf_start", "model_dir": mres["model_dir"], "device": s.device, "dtype": s.dtype_name,
                "prompt": mres["_start_prompt"]}
        start = run_child(spec, {}, timeout=s.child_timeout(reserve=60, cap=300))
        start["cold_s"] = start["warm_s"] = start["start_to_first_token_s"]
        row["start"] = start
        log(f"  transformers eager start to first token: {start['start_to_first_token_s']:.1f} s")
    except Exception as e:  # noqa: BLE001
        row["start"] = {"error": error_text(e)}
        log(f"  transformers eager start failed: {error_text(e)}")


def hf_static(s: Settings, mres: dict, row: dict, save) -> None:
    """cache_implementation="static": transformers compiles its decode step on the first call (per batch)."""
    import torch
    from transformers import CompileConfig as HFCompileConfig
    from transformers import LlamaForCausalLM

    t = time.time()
    model = LlamaForCausalLM.from_pretrained(mres["model_dir"], dtype=s.dtype).to(s.device).eval()
    row["load_in_process_s"] = time.time() - t
    extra: dict = {"cache_implementation": "static"}
    if s.device != "cuda":  # transformers auto-compiles on CUDA only unless told to compile everywhere
        extra["compile_config"] = HFCompileConfig()
        extra["compile_config"]._compile_all_devices = True
    row["note"] = "prefill is not compiled by transformers' auto-compile: see the eager row"
    try:
        for b in s.static_batches:
            if s.remaining() < 60:
                row["decode"][str(b)] = {"error": "skipped: time budget spent"}
                continue
            try:
                prompts = random_prompts(b, s.prompt_len, model.config.vocab_size, seed=b)
                log(f"  transformers static batch {b}: first call (compiles)...")
                first = hf_generate(model, prompts, s.new_tokens, s, **extra)
                hf_generate(model, prompts, s.new_tokens, s, **extra)  # cudagraph trees record on early calls
                runs = [hf_generate(model, prompts, s.new_tokens, s, **extra) for _ in range(s.decode_reps)]
                row["decode"][str(b)] = decode_cell(runs, s.new_tokens, first_call_s=first["total_s"])
                row.setdefault("first_call_s", first["total_s"])
                log(f"  transformers static batch {b}: first call {first['total_s']:.1f} s, then "
                    f"{row['decode'][str(b)].get('ms_per_token', float('nan')):.3f} ms/token")
            except Exception as e:  # noqa: BLE001
                row["decode"][str(b)] = {"error": error_text(e)}
                log(f"  transformers static batch {b} failed: {error_text(e)}")
            save()
    finally:
        del model
        torch._dynamo.reset()  # drops the compiled code and its cudagraph trees' memory


# The graphkiln rows.


def gk_generate(llm, prompts: list[list[int]], new_tokens: int, s: Settings) -> dict:
    from graphkiln import SamplingParams

    t0 = now(s.device)
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    total = now(s.device) - t0
    if {len(o.token_ids) for o in outs} != {new_tokens}:
        raise RuntimeError(f"graphkiln generated {sorted({len(o.token_ids) for o in outs})} tokens, not {new_tokens}")
    return {"total_s": total, "ttft_s": max(o.time_to_first_token_s for o in outs)}


def gk_prefill_ms(llm, n: int, s: Settings, vocab: int) -> list[float]:
    """Time to first token with max_tokens=1, after one warm-up."""
    prompt = random_prompts(1, n, vocab, seed=1000 + n)
    gk_generate(llm, prompt, 1, s)
    return [gk_generate(llm, prompt, 1, s)["ttft_s"] * 1e3 for _ in range(s.prefill_reps)]


def engine_stats(llm) -> dict:
    """LLM.stats() as JSON: graphs per kind (sizes, count, capture seconds, pool bytes, replays), steps
    without a graph, the KV cache."""
    import dataclasses

    st = llm.stats()
    return {"graphs": {k: dataclasses.asdict(g) for k, g in st.graphs.items()}, "graph_pool_bytes": st.graph_pool_bytes,
            "graphs_captured": st.graphs_captured, "steps_without_graph": st.steps_without_graph,
            "kv_cache_blocks": st.kv_cache_blocks, "kv_cache_bytes": st.kv_cache_bytes,
            "attention_backend": st.attention_backend, "compile_counters": st.compile_counters}


def time_graphkiln(llm, s: Settings, mres: dict, row: dict, label: str, save) -> None:
    ids = mres["_check_ids"]
    got = llm.score(ids).float().cpu()
    ref = mres["_ref_logits"]
    row["check"] = {"rel_err": float((got - ref).norm() / ref.norm()),
                    "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}
    log(f"  {label} vs transformers logits: {row['check']}")
    vocab = mres["shape"]["vocab_size"]
    measure_prefill(row, s, label, lambda n: gk_prefill_ms(llm, n, s, vocab))
    measure_decode(row, s, label, lambda p, k: gk_generate(llm, p, k, s), vocab, save)


@contextlib.contextmanager
def env_override(values: dict):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def gk_compiled(s: Settings, mres: dict, row: dict, save) -> None:
    """compile_model in a fresh process with empty caches (cold start), load in another (warm start),
    then load here for the timings; graphs from LLM.stats(). With --no-start: compile here."""
    import graphkiln

    artifact = mres["model_dir"] + "-artifact"
    caches = Path(mres["model_dir"] + "-caches")  # fresh: the cold start compiles everything
    cache_env = {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    cache_env = cache_env if s.start else {}  # without children: this process's caches
    spec = {"model_dir": mres["model_dir"], "artifact": artifact, "device": s.device, "dtype": s.dtype_name,
            "engine": s.engine, "prompt": mres["_start_prompt"]}
    row["engine"] = dict(s.engine)

    def start(which: str, reserve: float, cap: float | None) -> None:
        try:
            child = run_child({**spec, "mode": f"gk_{which}"}, cache_env, timeout=s.child_timeout(reserve, cap))
            row["start"][which], row["start"][f"{which}_s"] = child, child["start_to_first_token_s"]
            log(f"  graphkiln {which} start to first token: {child['start_to_first_token_s']:.1f} s ("
                + ", ".join(f"{k} {v:.1f}" for k, v in child["phases_s"].items()) + ")")
        except Exception as e:  # noqa: BLE001  (a timeout of the cold child: the budget is spent)
            row["start"][which] = {"error": error_text(e)}
            log(f"  graphkiln {which} start failed: {error_text(e)}")

    if s.start:
        start("cold", 90, None)
    with env_override(cache_env):  # as the start-up children did: the caches the cold compile filled
        if not (Path(artifact) / "manifest.json").is_file():
            log("  compiling in this process" + (" (no artifact from the cold start child)" if s.start else ""))
            t = time.time()
            config = graphkiln.CompileConfig(device=s.device, dtype=s.dtype_name)
            graphkiln.compile_model(mres["model_dir"], artifact, config, engine=graphkiln.EngineConfig(**s.engine),
                                    force=True)
            row["compile_in_process_s"] = time.time() - t
        if s.start:
            start("warm", 60, 300)
        t = time.time()
        llm = graphkiln.load(artifact, **s.engine)
    row["load_in_process_s"] = time.time() - t
    try:
        row["graph_pool_bytes"] = llm.stats().graph_pool_bytes if s.device == "cuda" else None
        if s.device == "cuda" and "decode" not in llm.stats().graphs:
            row["warning"] = "no decode CUDA graphs were captured"
        time_graphkiln(llm, s, mres, row, "graphkiln compiled", save)
    finally:
        row["stats"] = engine_stats(llm)
        llm.close()


def gk_eager(s: Settings, mres: dict, row: dict, save) -> None:
    """LLM.eager on the saved model: the reference engine, no compile."""
    import graphkiln

    t = time.time()
    llm = graphkiln.LLM.eager(mres["model_dir"], device=s.device, dtype=s.dtype_name, **s.engine)
    row["load_in_process_s"] = time.time() - t
    try:
        time_graphkiln(llm, s, mres, row, "graphkiln eager", save)
    finally:
        llm.close()


ROW_FUNCTIONS = {"hf_eager": hf_eager, "gk_compiled": gk_compiled, "gk_eager": gk_eager, "hf_static": hf_static}


# The floor.


def floor_row(mb: dict, hw: dict, s: Settings) -> dict:
    """Per decode batch (KV read at the mean decode context) and per prefill length:
    max(bytes / copy rate, FLOPs / matmul rate), and both sides."""

    def bound(nbytes: float, flops: float) -> dict:
        mem, comp = nbytes / hw["copy_bandwidth_Bps"] * 1e3, flops / hw["matmul_flops_per_s"] * 1e3
        return {"ms": max(mem, comp), "memory_ms": mem, "compute_ms": comp, "bytes": nbytes, "flops": flops}

    ctx, kv, weights = s.prompt_len + s.new_tokens / 2, mb["kv_bytes_per_token"], mb["weight_bytes_read"]
    matmul, head, attn = mb["matmul_params_per_token"], mb["lm_head_params"], mb["attn_flops_per_token_per_ctx"]
    decode = {}
    for b in s.batches:
        cell = bound(weights + b * (ctx + 1) * kv, b * (2 * (matmul + head) + attn * ctx))
        decode[str(b)] = {"ms_per_token": cell.pop("ms"), **cell}
    prefill = {str(n): bound(weights + n * kv, 2 * n * matmul + 2 * head + attn * n * n / 2) for n in s.prefill_lens}
    return {"label": "bandwidth floor", "decode": decode, "prefill": prefill, "error": None,
            "issue_floor_ms_per_token": mb["weight_bytes_all"] / hw["copy_bandwidth_Bps"] * 1e3}


# The run.


class Run:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.env = environment(s.device, s.commit)
        self.env["bytecode"] = ensure_bytecode()
        self.results: dict = {"meta": {**self.env, "settings": s.as_dict(), "argv": sys.argv[1:]},
                              "hardware": None, "models": {}, "errors": []}
        slug = device_slug(self.env) + ("-smoke" if s.smoke else "")
        self.stem = s.out / f"{self.env['date']}-{slug}"

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = time.time() - T0
        report.add_ratios(self.results)
        public = {**self.results, "models": {n: {k: v for k, v in m.items() if not k.startswith("_")}
                                             for n, m in self.results["models"].items()}}
        write_json(self.stem.with_suffix(".json"), public)
        with contextlib.suppress(Exception):
            self.stem.with_suffix(".md").write_text(report.to_markdown(public))

    def record_error(self, where: str, e: BaseException) -> None:
        self.results["errors"].append({"where": where, "error": error_text(e), "trace": traceback.format_exc()[-3000:]})
        log(f"{where} failed: {error_text(e)}")

    def row(self, name: str, key: str) -> None:
        """Run one row of model `name`, if asked for and the budget allows; its error is kept in the row."""
        s = self.s
        if key not in s.rows:
            return
        json_name, title, min_s = ROWS[key]
        log(f"{name}: {title}")
        mres = self.results["models"][name]
        row = mres["rows"].setdefault(json_name, {"name": json_name, "decode": {}, "prefill": {}, "start": {},
                                                  "error": None})
        if s.remaining() < min_s and not s.smoke:
            row["error"] = f"skipped: {s.remaining():.0f} s of budget left, the row needs about {min_s} s"
            log(f"{key}: {row['error']}")
            return self.save()
        t = time.time()
        if s.device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
        try:
            ROW_FUNCTIONS[key](s, mres, row, self.save)
        except OutOfTime as e:
            row["error"] = error_text(e)
            raise
        except Exception as e:  # noqa: BLE001
            row["error"], row["trace"] = error_text(e), traceback.format_exc()[-3000:]
            log(f"{key} failed: {row['error']}")
        finally:
            row["seconds"] = time.time() - t
            if s.device == "cuda":
                import torch

                row["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            free_memory(s.device)
            self.save()

    def model(self, name: str, scratch: Path) -> None:
        """Build model `name` and save it, then its rows in order."""
        s = self.s
        shape = shape_of(name, s.max_position)
        mb = model_bytes(shape, s.dtype_bytes)
        mres = {"shape": shape, "bytes": mb, "rows": {}, "model_dir": str(scratch / name)}
        self.results["models"][name] = mres
        log(f"{name}: {mb['params'] / 1e6:.1f} M params, {mb['weight_bytes_all'] / 2**30:.3f} GiB of weights")
        if self.results["hardware"]:
            mres["rows"]["floor"] = floor_row(mb, self.results["hardware"], s)
            first = mres["rows"]["floor"]["decode"][str(s.batches[0])]["ms_per_token"]
            log(f"  floor at batch {s.batches[0]}: {first:.3f} ms/token")
        if s.remaining() < BUILD_MIN_S and not s.smoke:
            self.results["errors"].append({"where": name, "error": "skipped: time budget spent"})
            return
        try:
            t = time.time()
            model = build_hf_model(shape, s.device, s.dtype)
            model.save_pretrained(mres["model_dir"])
            mres["build_and_save_s"] = time.time() - t
            mres["_hf_model"] = model  # for the transformers eager row, which frees it
            mres["_check_ids"] = random_prompts(1, 32, shape["vocab_size"], seed=3)[0]
            mres["_start_prompt"] = random_prompts(1, s.prompt_len, shape["vocab_size"], seed=7)[0]
            import torch

            with torch.inference_mode():
                ids = torch.tensor([mres["_check_ids"]], device=s.device)
                mres["_ref_logits"] = model(input_ids=ids).logits[0].float().cpu()
            log(f"  built and saved in {mres['build_and_save_s']:.1f} s")
        except Exception as e:  # noqa: BLE001
            mres.pop("_hf_model", None)
            return self.record_error(f"{name}: build", e)
        self.row(name, "hf_eager")
        mres.pop("_hf_model", None)
        free_memory(s.device)
        self.row(name, "gk_compiled")
        self.row(name, "gk_eager")

    def run(self) -> None:
        s = self.s
        log(f"graphkiln bench: {self.env['device_name']}, torch {self.env['torch']}, transformers "
            f"{self.env['transformers']}, triton {self.env['triton']}; models {','.join(s.models)}; rows "
            f"{','.join(s.rows)}; batches {s.batches}; budget {s.budget_s:.0f} s; out {self.stem}.json")
        if s.device != "cuda":
            log("CPU smoke: graphkiln engines capture no CUDA graphs on the CPU; every other line runs")
        try:
            self.results["hardware"] = hw = {"copy_bytes": s.copy_bytes, "matmul_n": s.matmul_n,
                                             "copy_bandwidth_Bps": copy_rate(s.device, s.copy_bytes),
                                             "matmul_flops_per_s": matmul_rate(s.device, s.dtype, s.matmul_n)}
            log(f"copy {hw['copy_bandwidth_Bps'] / 1e12:.3f} TB/s (read+write), "
                f"matmul {hw['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")
        except Exception as e:  # noqa: BLE001
            self.record_error("hardware", e)
        weights = sum(model_bytes(shape_of(m), s.dtype_bytes)["weight_bytes_all"] for m in s.models if m in MODELS)
        scratch = scratch_dir(weights * 1.5 + (1 << 30))
        try:
            for name in s.models:
                self.model(name, scratch)
            for name in s.models:  # after all models: the static row's first call compiles for minutes
                if name in s.static_models and name in self.results["models"]:
                    self.row(name, "hf_static")
        except OutOfTime as e:
            log(error_text(e))
        finally:
            signal.alarm(0)
            for mres in self.results["models"].values():
                for k in [k for k in mres if k.startswith("_")]:
                    del mres[k]
            if s.keep:
                log(f"kept scratch folder {scratch}")
            else:
                shutil.rmtree(scratch, ignore_errors=True)
        self.save()
        if s.plot:
            try:
                made = report.plot(self.results, self.stem.with_suffix(".png"))
                log(f"plot: {self.stem}.png" if made else "plot skipped: matplotlib is not installed")
            except Exception as e:  # noqa: BLE001
                log(f"plot failed: {error_text(e)}")
        print(report.to_markdown(self.results), flush=True)
        log(f"wrote {self.stem}.json and .md")


def arm_watchdog(seconds: float) -> None:
    """Turn the hard limit into OutOfTime, so the row in flight is recorded and the tables still get written."""

    def fire(signum, frame):
        signal.alarm(0)
        raise OutOfTime(f"hard limit of {seconds:.0f} s reached; the rest of the run was skipped")

    if seconds > 0:
        signal.signal(signal.SIGALRM, fire)
        signal.alarm(max(1, int(seconds - (time.time() - T0))))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", help="comma list of 1b, 8b (default 1b,8b; smoke: smoke; also smoke-untied)")
    p.add_argument("--rows", help=f"comma list of {','.join(ROWS)} (default all; the floor is always computed)")
    p.add_argument("--batches", help="decode batch sizes (default 1,8,32,64; smoke 1,2)")
    p.add_argument("--prefill", help="prefill prompt lengths at batch 1 (default 128,1024,4096; smoke 16,48)")
    p.add_argument("--prompt-len", type=int, help="decode prompt tokens (default 128; smoke 16)")
    p.add_argument("--new-tokens", type=int, help="decode new tokens (default 128; smoke 8)")
    p.add_argument("--static-models", help="models that get the transformers static+compile row (default 1b; '' none)")
    p.add_argument("--static-batches", help="batches for that row (default 1; each new batch recompiles)")
    p.add_argument("--decode-reps", type=int, default=1, help="timed generate calls per batch, the fastest kept")
    p.add_argument("--prefill-reps", type=int, help="timed prefills per length, the median kept (default 5)")
    p.add_argument("--decode-buckets", help="graphkiln decode batch sizes (default: powers of 2 to the largest batch)")
    p.add_argument("--prefill-buckets", help="graphkiln prefill token buckets (default: powers of 2 from 16)")
    p.add_argument("--budget-s", type=float, help="rows that would start past this many seconds are skipped "
                   "(default 450; smoke 1500)")
    p.add_argument("--hard-limit-s", type=float, help="the row running then is stopped (default budget + 80; 0: never)")
    p.add_argument("--reuse-caches", action="store_true", help="keep this process's Inductor/Triton caches instead of "
                   "fresh empty ones (graphkiln's cold start always starts empty)")
    p.add_argument("--out", help="results folder (default $OUT, else bench/results)")
    p.add_argument("--commit", help="git commit to record where the tree has no .git")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-start", action="store_true", help="no start-up children: compile in this process (quick runs, "
                   "the CPU test)")
    p.add_argument("--keep", action="store_true", help="keep the scratch model and artifact folders")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes: every code path, a minute or two")


def main(a: argparse.Namespace) -> int:
    s = Settings(a)
    import torch

    if s.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --smoke on a machine without a GPU", file=sys.stderr)
        return 2
    unknown = [m for m in s.models if m not in MODELS] + [r for r in s.rows if r not in ROWS]
    if unknown:
        print(f"unknown models or rows {unknown}; models: {sorted(MODELS)}, rows: {list(ROWS)}", file=sys.stderr)
        return 2
    # Fresh Inductor and Triton caches for this process (before torch reads them), so transformers' static
    # row compiles from scratch on every run; graphkiln's start-up children get their own.
    caches = Path(tempfile.mkdtemp(prefix="gk-bench-caches-"))
    if not a.reuse_caches:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(caches / "triton")
    try:
        arm_watchdog(s.hard_limit_s)
        Run(s).run()
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    return 0
