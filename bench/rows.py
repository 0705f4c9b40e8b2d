"""The rows of the main run: transformers eager and static, graphkiln compiled and eager, and the floor.

Each row function measures one engine on one model into its row of the results (decode ms per
step per batch, prefill ms per length, start-up where it applies), saving after every cell.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from .common import error_text, log, random_prompts
from .measure import now
from .startup import run_child

if TYPE_CHECKING:
    from .run import Settings


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


def _prefill_ms_with(model, s: Settings, n: int) -> list[float]:
    return hf_prefill_ms(model, n, s)


def _generate_with(model, s: Settings, prompts: list[list[int]], new_tokens: int) -> dict:
    return hf_generate(model, prompts, new_tokens, s)


def hf_eager(s: Settings, mres: dict, row: dict, save) -> None:
    """The model built for this run (then freed), and its start to first token in a fresh process."""
    model = mres.pop("_hf_model")
    try:
        measure_prefill(row, s, "transformers eager", partial(_prefill_ms_with, model, s))
        vocab = model.config.vocab_size
        measure_decode(row, s, "transformers eager", partial(_generate_with, model, s), vocab, save)
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
            "engine": s.engine, "prompt": mres["_start_prompt"], "quantization": s.quantization, "passes": s.passes}
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
            config = graphkiln.CompileConfig(device=s.device, dtype=s.dtype_name, quantization=s.quantization,
                                             **s.passes)
            _, report = graphkiln.compile_model(mres["model_dir"], artifact, config,
                                                engine=graphkiln.EngineConfig(**s.engine), force=True)
            row["compile_in_process_s"] = time.time() - t
            row["passes"] = [r.name for r in report.passes if r.enabled]
        if s.start:
            start("warm", 60, 300)
        t = time.time()
        llm = graphkiln.load(artifact, **s.engine)
        llm.wait_ready()
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
