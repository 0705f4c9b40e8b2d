#!/usr/bin/env python3
"""graphkiln side by side with transformers (eager; static cache + torch.compile) and the bandwidth floor.

One process (plus fresh child processes for the start-up times), one GPU, one device call:

    python3 bench/gpu_bench.py --out "$OUT"          # 1b and 8b: about 6-9 minutes, at most ~9
    python3 bench/gpu_bench.py --models 1b --out "$OUT"

graphkiln is imported as installed, or else straight from this repository's folders (no install
needed). Rows that would start after --budget-s (450 s) are skipped; the one still running at
--hard-limit-s (530 s) is stopped by a SIGALRM watchdog; the JSON, markdown and table are written
either way.

Random-weight bf16 Llama models (Llama-3.2-1B-like, Llama-3.1-8B-like) are built with transformers'
own classes on the GPU and saved to a scratch directory that graphkiln loads. Per model, in this
order (most important first, so a short budget drops the least important rows):

  transformers eager       model.generate, default dynamic cache; prefill = one forward;
                           start = fresh process: import, from_pretrained, first token
  graphkiln compiled       compile_model in a FRESH process with empty Inductor/Triton caches (cold
                           start), graphkiln.load in another fresh process (warm start, CUDA graph
                           capture included), then load in this process for decode/prefill timings;
                           graph memory = CaptureStats.pool_bytes of the decode (full) and prefill
                           (piecewise) graphs
  graphkiln eager          LLM.eager(..., attention_backend="triton"): the reference engine
and, after all models, transformers with cache_implementation="static" (its automatic
torch.compile; its first call compiles, 24-200 s, recorded separately), batch 1 on 1b by default.

Decode: 128 random prompt tokens, 128 new tokens, EOS ignored; per generate call as a user sees it:
ms/token = (total - time to first token) / (new tokens - 1), and total / new tokens. At batch B one
step makes B tokens, one per sequence, so ms/token is ms per step. Prefill: batch 1; graphkiln =
time to first token with max_tokens=1, transformers = one forward (logits_to_keep=1).
Floor: max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in this run; bytes =
weights read per step (the untied input embedding table is not read, only its rows) + the KV cache
read at the mean decode context (prompt + new/2).

Expected on the H200 (torch 2.11, transformers 5.17), from the issue (comment only, not asserted):
  1b transformers eager 14.6 ms/token at batch 1; static cache + compile 3.19 ms/token; floor 0.58 ms.
  Targets: decode batch 1 <= 1.15x floor on 8b (<= 4.35 ms/token) and <= 1.0 ms/token on 1b;
  batch 64 on 1b <= 1.6 ms/step; prefill 128 <= 2 ms (1b); warm start <= 10 s (1b); cold <= 60 s (1b).

Results: <out>/<date>-<device>.json (rewritten after every row, so a killed run keeps what it had),
<out>/<date>-<device>.md (bench/report.py), <out>/<date>-<device>.png (matplotlib, optional).
A short table is printed last. Every row runs in try/except; errors land in the JSON.

--smoke runs every code path on the CPU in float32 with tiny shapes (graphkiln compiled on the
CPU, no CUDA graphs; transformers' static row auto-compiles on the CPU too).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
CHILD_PREFIX = "GK_BENCH_CHILD "

# Llama-3.2-1B-like and Llama-3.1-8B-like shapes; the smoke shapes exercise tied and untied heads.
MODELS = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "smoke-untied": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, tie_word_embeddings=False),
}
ROW_KEYS = ("hf_eager", "gk_compiled", "gk_eager", "hf_static")
ROW_NAMES = {  # --rows key -> JSON row name (bench/report.py knows the labels)
    "hf_eager": "transformers_eager",
    "hf_static": "transformers_static",
    "gk_eager": "graphkiln_eager",
    "gk_compiled": "graphkiln_compiled",
}
# Seconds a row needs at least; with less budget left it is skipped (recorded, not run).
MIN_BUDGET_S = {"build": 30, "hf_eager": 25, "gk_compiled": 90, "gk_eager": 25, "hf_static": 150}

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:7.1f}s] {msg}", flush=True)


def csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def csv_strs(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, s = [], 1
    while s <= hi:
        if s >= lo:
            out.append(s)
        s *= 2
    return out


class OutOfTime(BaseException):
    """Raised by the SIGALRM watchdog at --hard-limit-s inside whatever runs; like KeyboardInterrupt, the
    rows' `except Exception` handlers let it through, so the run stops and still writes its tables."""


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


# ----------------------------------------------------------------------------- settings


class Settings:
    """Everything a run decides up front (from the command line, or the smoke defaults)."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch

        self.smoke = a.smoke
        self.device = "cpu" if a.smoke else "cuda"
        self.dtype_name = "float32" if a.smoke else "bfloat16"
        self.dtype = getattr(torch, self.dtype_name)
        self.dtype_bytes = torch.tensor([], dtype=self.dtype).element_size()
        self.attention_backend = "sdpa" if a.smoke else "triton"
        self.models = csv_strs(a.models or ("smoke" if a.smoke else "1b,8b"))
        self.rows = csv_strs(a.rows or ",".join(ROW_KEYS))
        self.batches = csv_ints(a.batches or ("1,2" if a.smoke else "1,8,32,64"))
        self.prefill_lens = csv_ints(a.prefill or ("16,48" if a.smoke else "128,1024,4096"))
        self.prompt_len = a.prompt_len or (16 if a.smoke else 128)
        self.new_tokens = a.new_tokens or (8 if a.smoke else 128)
        self.static_models = csv_strs(a.static_models if a.static_models is not None else ("smoke" if a.smoke else "1b"))
        self.static_batches = csv_ints(a.static_batches or "1")
        self.decode_reps = a.decode_reps
        self.prefill_reps = a.prefill_reps or (2 if a.smoke else 5)
        self.budget_s = a.budget_s or (1500 if a.smoke else 450)
        self.hard_limit_s = a.hard_limit_s if a.hard_limit_s is not None else self.budget_s + 80
        self.max_position = 512 if a.smoke else 8192
        self.decode_buckets = csv_ints(a.decode_buckets) if a.decode_buckets else tuple(
            sorted(set(powers_of_two(1, max(self.batches))) | set(self.batches)))
        self.prefill_buckets = csv_ints(a.prefill_buckets) if a.prefill_buckets else (
            (16, 32) if a.smoke else tuple(powers_of_two(16, max(self.prefill_lens))))
        self.copy_bytes = (64 << 20) if a.smoke else (2 << 30)
        self.matmul_n = 256 if a.smoke else 8192
        self.plot = not a.no_plot
        self.keep = a.keep
        self.commit = a.commit
        self.out = Path(a.out or os.environ.get("OUT") or (BENCH_DIR / "results")).resolve()
        # One engine shape for every graphkiln row: room for the largest decode batch or prefill.
        longest = max(max(self.batches) * (self.prompt_len + self.new_tokens), max(self.prefill_lens) + 16)
        self.kv_cache_tokens = -(-(longest + 512) // 1024) * 1024
        self.max_batched_tokens = max(max(self.batches) * self.prompt_len, max(self.prefill_lens))
        self.engine = dict(
            attention_backend=self.attention_backend,
            kv_cache_tokens=self.kv_cache_tokens,
            max_num_batched_tokens=self.max_batched_tokens,
            max_num_seqs=max(256, max(self.batches)),
        )

    def remaining(self) -> float:
        """Seconds until --budget-s: rows that would start later are skipped."""
        return self.budget_s - (time.time() - _T0)

    def child_timeout(self, reserve: float, cap: float | None = None) -> float | None:
        """A subprocess timeout that leaves `reserve` seconds before --hard-limit-s (None: no limit)."""
        if not self.hard_limit_s:
            return cap
        left = max(30.0, self.hard_limit_s - (time.time() - _T0) - reserve)
        return left if cap is None else min(cap, left)

    def compile_config(self) -> dict:
        return dict(device=self.device, dtype=self.dtype_name, decode_batch_sizes=list(self.decode_buckets),
                    prefill_token_buckets=list(self.prefill_buckets))

    def as_dict(self) -> dict:
        keys = ("smoke", "device", "dtype_name", "attention_backend", "models", "rows", "batches", "prefill_lens",
                "prompt_len", "new_tokens", "static_models", "static_batches", "decode_reps", "prefill_reps",
                "budget_s", "hard_limit_s", "max_position", "decode_buckets", "prefill_buckets", "copy_bytes", "matmul_n",
                "kv_cache_tokens", "max_batched_tokens")
        return {k: getattr(self, k) for k in keys}


# ----------------------------------------------------------------------------- timing helpers


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def now(device: str) -> float:
    sync(device)
    return time.perf_counter()


def time_device_ms(fn, device: str, reps: int, warmup: int = 3) -> list[float]:
    """Per-call milliseconds: CUDA events around each call on the GPU, the host clock on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def free_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def peak_reset(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


# ----------------------------------------------------------------------------- hardware ceilings


def measure_hardware(s: Settings) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and the dense matmul rate, medians of 10."""
    import torch

    n = s.copy_bytes // s.dtype_bytes
    src = torch.randn(n, dtype=s.dtype, device=s.device)
    dst = torch.empty_like(src)
    copy_ms = time_device_ms(lambda: dst.copy_(src), s.device, reps=10)
    if not torch.equal(dst, src):
        raise RuntimeError("copy check failed: destination differs from source")
    del src, dst
    m = s.matmul_n
    a = torch.randn(m, m, dtype=s.dtype, device=s.device)
    b = torch.randn(m, m, dtype=s.dtype, device=s.device)
    mm_ms = time_device_ms(lambda: torch.mm(a, b), s.device, reps=10)
    del a, b
    free_memory(s.device)
    copy_med, mm_med = statistics.median(copy_ms), statistics.median(mm_ms)
    return {
        "copy_bytes": s.copy_bytes,
        "copy_ms_median": copy_med,
        "copy_ms_all": copy_ms,
        "copy_bandwidth_Bps": 2 * s.copy_bytes / (copy_med / 1e3),
        "matmul_n": m,
        "matmul_ms_median": mm_med,
        "matmul_flops_per_s": 2 * m**3 / (mm_med / 1e3),
    }


# ----------------------------------------------------------------------------- model shapes and the floor


def shape_of(name: str, s: Settings) -> dict:
    shape = dict(MODELS[name])
    shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    shape["max_position_embeddings"] = s.max_position
    return shape


def model_bytes(shape: dict, dtype_bytes: int) -> dict:
    h, L, nh, nkv, hd = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    inter, vocab, tied = shape["intermediate_size"], shape["vocab_size"], shape["tie_word_embeddings"]
    layer_matmul = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter
    layer_params = layer_matmul + 2 * h
    embed = vocab * h
    params = L * layer_params + h + embed + (0 if tied else embed)
    # Read every decode step: all layers, the final norm and the LM head (the tied table, or the untied
    # head); an untied input embedding table is only gathered from (a few rows), so it is not counted.
    read_params = L * layer_params + h + embed
    return {
        "params": params,
        "weight_bytes_all": params * dtype_bytes,
        "weight_bytes_read": read_params * dtype_bytes,
        "matmul_params_per_token": L * layer_matmul,  # plus the LM head for sampled rows
        "lm_head_params": embed,
        "kv_bytes_per_token": 2 * L * nkv * hd * dtype_bytes,
        "attn_flops_per_token_per_ctx": 4 * L * nh * hd,  # QK^T and PV, 2 flops per multiply-add
    }


def floor_row(mb: dict, hw: dict, s: Settings) -> dict:
    bw, rate = hw["copy_bandwidth_Bps"], hw["matmul_flops_per_s"]
    ctx = s.prompt_len + s.new_tokens / 2
    decode = {}
    for b in s.batches:
        nbytes = mb["weight_bytes_read"] + b * ctx * mb["kv_bytes_per_token"] + b * mb["kv_bytes_per_token"]
        flops = b * (2 * (mb["matmul_params_per_token"] + mb["lm_head_params"]) + mb["attn_flops_per_token_per_ctx"] * ctx)
        mem_ms, comp_ms = nbytes / bw * 1e3, flops / rate * 1e3
        decode[str(b)] = {"ms_per_token": max(mem_ms, comp_ms), "memory_ms": mem_ms, "compute_ms": comp_ms,
                          "bytes": nbytes, "flops": flops}
    prefill = {}
    for n in s.prefill_lens:
        nbytes = mb["weight_bytes_read"] + n * mb["kv_bytes_per_token"]
        flops = 2 * n * mb["matmul_params_per_token"] + 2 * mb["lm_head_params"] + mb["attn_flops_per_token_per_ctx"] * n * n / 2
        mem_ms, comp_ms = nbytes / bw * 1e3, flops / rate * 1e3
        prefill[str(n)] = {"ms": max(mem_ms, comp_ms), "memory_ms": mem_ms, "compute_ms": comp_ms,
                           "bytes": nbytes, "flops": flops}
    return {
        "label": "bandwidth floor",
        "decode": decode,
        "prefill": prefill,
        # The definition: every weight byte over the copy bandwidth, batch 1, no KV.
        "issue_floor_ms_per_token": mb["weight_bytes_all"] / bw * 1e3,
        "error": None,
    }


# ----------------------------------------------------------------------------- building the model


def build_hf_model(shape: dict, s: Settings, seed: int = 0):
    """A random-weight LlamaForCausalLM built on the device: no default init, then normal_(std=0.02)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **shape, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        attention_bias=False, mlp_bias=False,
    )
    try:
        from transformers.initialization import no_init_weights

        skip_init = no_init_weights()
    except ImportError:  # other transformers versions: the default init runs, on the device
        skip_init = contextlib.nullcontext()
    with torch.device(s.device), skip_init:
        try:
            model = LlamaForCausalLM._from_config(cfg, dtype=s.dtype)
        except TypeError:
            model = LlamaForCausalLM._from_config(cfg, torch_dtype=s.dtype)
    model = model.to(device=s.device, dtype=s.dtype)
    gen = torch.Generator(device=s.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm weights (Llama has no biases)
        if shape["tie_word_embeddings"] and model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight = model.model.embed_tokens.weight
        rot = model.model.rotary_emb
        hd = shape["head_dim"]
        want = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.int64, device=s.device).float() / hd))
        if rot.inv_freq.shape != want.shape or not torch.allclose(rot.inv_freq.float(), want, rtol=1e-4):
            rot.inv_freq.copy_(want)
            if isinstance(getattr(rot, "original_inv_freq", None), torch.Tensor):
                rot.original_inv_freq.copy_(want)
    model.eval()
    model.generation_config.pad_token_id = cfg.eos_token_id
    return model


def scratch_root(models: tuple[str, ...], s: Settings) -> Path:
    need = sum(model_bytes(shape_of(m, s), s.dtype_bytes)["weight_bytes_all"] for m in models) * 1.5 + (1 << 30)
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free > need:
            return Path(tempfile.mkdtemp(prefix="gk-bench-", dir=shm))
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="gk-bench-"))


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


# ----------------------------------------------------------------------------- transformers rows


def _stamp_streamer():
    """A streamer that only records when generate hands it tokens (the first put is the prompt)."""
    try:
        from transformers.generation.streamers import BaseStreamer
    except ImportError:
        BaseStreamer = object

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # generate passes CPU tensors: the device has caught up
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return Stamps()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, s: Settings, **extra) -> dict:
    import torch

    ids = torch.tensor(prompts, device=s.device)
    streamer = _stamp_streamer()
    t0 = now(s.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=model.generation_config.pad_token_id, streamer=streamer, **extra,
    )
    t1 = now(s.device)
    made = out.shape[1] - ids.shape[1]
    if made != new_tokens:
        raise RuntimeError(f"transformers generated {made} tokens, not {new_tokens}")
    ttft = streamer.times[1] - t0 if len(streamer.times) >= 2 else None
    return {"total_s": t1 - t0, "ttft_s": ttft}


def decode_cell(total_s: float, ttft_s: float | None, new_tokens: int) -> dict:
    cell = {"total_s": total_s, "new_tokens": new_tokens, "ms_per_token_plain": total_s / new_tokens * 1e3}
    if ttft_s is not None:
        cell["ttft_ms"] = ttft_s * 1e3
        cell["ms_per_token"] = (total_s - ttft_s) / max(1, new_tokens - 1) * 1e3
    return cell


def hf_prefill_ms(model, n: int, s: Settings) -> list[float]:
    import torch

    ids = torch.tensor(random_prompts(1, n, model.config.vocab_size, seed=1000 + n), device=s.device)

    def forward():
        try:
            return model(input_ids=ids, use_cache=True, logits_to_keep=1)
        except TypeError:
            return model(input_ids=ids, use_cache=True)

    with torch.inference_mode():
        forward()
        times = []
        for _ in range(s.prefill_reps):
            t = now(s.device)
            forward()
            times.append((now(s.device) - t) * 1e3)
    return times


def run_hf_eager(model, shape: dict, s: Settings, row: dict, save) -> None:
    vocab = shape["vocab_size"]
    for n in s.prefill_lens:
        try:
            times = hf_prefill_ms(model, n, s)
            row["prefill"][str(n)] = {"ms": statistics.median(times), "all_ms": times}
            log(f"  transformers eager prefill {n}: {statistics.median(times):.2f} ms")
        except Exception as e:  # noqa: BLE001
            row["prefill"][str(n)] = {"error": error_text(e)}
            log(f"  transformers eager prefill {n} failed: {error_text(e)}")
    for b in s.batches:
        if s.remaining() < 5:
            row["decode"][str(b)] = {"error": "skipped: time budget spent"}
            continue
        try:
            prompts = random_prompts(b, s.prompt_len, vocab, seed=b)
            hf_generate(model, prompts, min(4, s.new_tokens), s)  # warm-up: kernels, allocator
            runs = [hf_generate(model, prompts, s.new_tokens, s) for _ in range(s.decode_reps)]
            best = min(runs, key=lambda r: r["total_s"])
            row["decode"][str(b)] = decode_cell(best["total_s"], best["ttft_s"], s.new_tokens)
            row["decode"][str(b)]["all_total_s"] = [r["total_s"] for r in runs]
            log(f"  transformers eager batch {b}: {row['decode'][str(b)].get('ms_per_token', float('nan')):.3f} ms/token")
        except Exception as e:  # noqa: BLE001
            row["decode"][str(b)] = {"error": error_text(e)}
            log(f"  transformers eager batch {b} failed: {error_text(e)}")
        save()


def run_hf_static(model, shape: dict, s: Settings, row: dict, save) -> None:
    """cache_implementation="static": transformers compiles the decode step itself on the first call."""
    extra: dict = {"cache_implementation": "static"}
    if s.device != "cuda":  # transformers auto-compiles on CUDA only unless told to compile everywhere
        from transformers import CompileConfig as HFCompileConfig

        cc = HFCompileConfig()
        cc._compile_all_devices = True
        extra["compile_config"] = cc
    row["note"] = "prefill is not compiled by transformers' auto-compile: see the eager row"
    for b in s.static_batches:
        if s.remaining() < 60:
            row["decode"][str(b)] = {"error": "skipped: time budget spent"}
            continue
        try:
            prompts = random_prompts(b, s.prompt_len, shape["vocab_size"], seed=b)
            log(f"  transformers static batch {b}: first call (compiles)...")
            first = hf_generate(model, prompts, s.new_tokens, s, **extra)  # same shapes as the timed call
            log(f"  transformers static batch {b}: first call {first['total_s']:.1f} s")
            hf_generate(model, prompts, s.new_tokens, s, **extra)  # cudagraph trees record on early calls
            runs = [hf_generate(model, prompts, s.new_tokens, s, **extra) for _ in range(s.decode_reps)]
            best = min(runs, key=lambda r: r["total_s"])
            cell = decode_cell(best["total_s"], best["ttft_s"], s.new_tokens)
            cell["first_call_s"] = first["total_s"]
            cell["first_call_ttft_s"] = first["ttft_s"]
            cell["all_total_s"] = [r["total_s"] for r in runs]
            row["decode"][str(b)] = cell
            if "first_call_s" not in row:
                row["first_call_s"] = first["total_s"]
            log(f"  transformers static batch {b}: {cell.get('ms_per_token', float('nan')):.3f} ms/token")
        except Exception as e:  # noqa: BLE001
            row["decode"][str(b)] = {"error": error_text(e)}
            log(f"  transformers static batch {b} failed: {error_text(e)}")
        save()


def hf_reference_logits(model, ids: list[int], s: Settings):
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=s.device)).logits[0].float().cpu()


# ----------------------------------------------------------------------------- graphkiln rows


def gk_generate(llm, prompts: list[list[int]], new_tokens: int, s: Settings) -> dict:
    from graphkiln import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = now(s.device)
    outs = llm.generate(prompts, params)
    t1 = now(s.device)
    made = {len(o.token_ids) for o in outs}
    if made != {new_tokens}:
        raise RuntimeError(f"graphkiln generated {sorted(made)} tokens per request, not {new_tokens}")
    return {"total_s": t1 - t0, "ttft_s": max(o.time_to_first_token_s for o in outs)}


def run_gk_timings(llm, shape: dict, s: Settings, row: dict, label: str, save) -> None:
    vocab = shape["vocab_size"]
    for n in s.prefill_lens:
        try:
            prompt = random_prompts(1, n, vocab, seed=1000 + n)
            gk_generate(llm, prompt, 1, s)  # warm-up
            times = [gk_generate(llm, prompt, 1, s)["ttft_s"] * 1e3 for _ in range(s.prefill_reps)]
            row["prefill"][str(n)] = {"ms": statistics.median(times), "all_ms": times}
            log(f"  {label} prefill {n}: {statistics.median(times):.2f} ms")
        except Exception as e:  # noqa: BLE001
            row["prefill"][str(n)] = {"error": error_text(e)}
            log(f"  {label} prefill {n} failed: {error_text(e)}")
    for b in s.batches:
        if s.remaining() < 5:
            row["decode"][str(b)] = {"error": "skipped: time budget spent"}
            continue
        try:
            prompts = random_prompts(b, s.prompt_len, vocab, seed=b)
            gk_generate(llm, prompts, min(4, s.new_tokens), s)  # warm-up: same prefill and decode shapes
            runs = [gk_generate(llm, prompts, s.new_tokens, s) for _ in range(s.decode_reps)]
            best = min(runs, key=lambda r: r["total_s"])
            row["decode"][str(b)] = decode_cell(best["total_s"], best["ttft_s"], s.new_tokens)
            row["decode"][str(b)]["all_total_s"] = [r["total_s"] for r in runs]
            log(f"  {label} batch {b}: {row['decode'][str(b)]['ms_per_token']:.3f} ms/token")
        except Exception as e:  # noqa: BLE001
            row["decode"][str(b)] = {"error": error_text(e)}
            log(f"  {label} batch {b} failed: {error_text(e)}")
        save()


def check_against_hf(llm, ids: list[int], ref) -> dict:
    """Logits of one prompt against transformers': relative error and argmax agreement (recorded only)."""
    got = llm.score(ids).float().cpu()
    rel = float((got - ref).norm() / ref.norm())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"rel_err": rel, "argmax_agreement": agree}


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


def run_child(spec: dict, env_extra: dict, timeout: float | None) -> dict:
    """Run this script as `--child SPEC` in a fresh process; returns its result plus start-to-token time."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
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


def ensure_graphkiln() -> str:
    """Import graphkiln; when it is not installed, from this repository's folders, mapped as pyproject maps
    them (graphkiln/ plus models/, compiler/, passes/, runtime/ as its subpackages). Returns how."""
    try:
        import graphkiln  # noqa: F401

        return "installed"
    except ImportError:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "graphkiln", REPO / "graphkiln" / "__init__.py", submodule_search_locations=[str(REPO / "graphkiln"), str(REPO)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["graphkiln"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop("graphkiln", None)
            raise
        return "from the repository (not installed)"


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
    print(CHILD_PREFIX + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- driver


def new_row(key: str) -> dict:
    return {"name": ROW_NAMES[key], "decode": {}, "prefill": {}, "start": {}, "error": None}


def environment(s: Settings) -> dict:
    import platform

    import torch
    import transformers

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    try:
        import graphkiln

        env["graphkiln"] = graphkiln.__version__
    except Exception as e:  # noqa: BLE001
        env["graphkiln"] = f"not importable: {error_text(e)}"
    if s.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["device_name"] = torch.cuda.get_device_name(0)
        env["device_memory_bytes"] = props.total_memory
        env["multiprocessors"] = props.multi_processor_count
        env["capability"] = f"{props.major}.{props.minor}"
    else:
        env["device_name"] = "cpu"
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    env["git_commit"], env["git_dirty"] = git_state(s.commit)
    return env


def git_state(given: str | None) -> tuple[str, bool | None]:
    if given:
        return given, None
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            return head.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GRAPHKILN_COMMIT", "unknown"), None


def device_slug(env: dict, smoke: bool) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", env["device_name"].lower()).strip("-") or "device"
    return slug + ("-smoke" if smoke else "")


def public(obj):
    """The results without in-memory helpers (keys starting with '_': the live model, reference logits)."""
    if isinstance(obj, dict):
        return {k: public(v) for k, v in obj.items() if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(obj, (list, tuple)):
        return [public(v) for v in obj]
    return obj


class Run:
    def __init__(self, s: Settings) -> None:
        import report

        self.s = s
        self.report = report
        self.env = environment(s)
        self.results: dict = {"meta": {**self.env, "settings": s.as_dict(), "argv": sys.argv[1:]},
                              "hardware": None, "models": {}, "errors": []}
        s.out.mkdir(parents=True, exist_ok=True)
        self.stem = s.out / f"{self.env['date']}-{device_slug(self.env, s.smoke)}"
        self.json_path = self.stem.with_suffix(".json")
        self.md_path = self.stem.with_suffix(".md")
        self.png_path = self.stem.with_suffix(".png")

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = time.time() - _T0
        self.report.add_ratios(self.results)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(public(self.results), indent=1, default=str))
        tmp.replace(self.json_path)
        with contextlib.suppress(Exception):
            self.md_path.write_text(self.report.to_markdown(public(self.results)))

    def guarded(self, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except OutOfTime as e:
            self.results["errors"].append({"where": what, "error": error_text(e)})
            raise
        except Exception as e:  # noqa: BLE001
            self.results["errors"].append({"where": what, "error": error_text(e), "trace": traceback.format_exc()[-3000:]})
            log(f"{what} failed: {error_text(e)}")
            return False
        finally:
            free_memory(self.s.device)
            self.save()

    def row(self, mres: dict, key: str, fn, *args) -> None:
        """Run one row (if asked for and the budget allows), its error recorded in the row."""
        s = self.s
        if key not in s.rows:
            return
        row = mres["rows"].setdefault(ROW_NAMES[key], new_row(key))
        if s.remaining() < MIN_BUDGET_S[key] and not s.smoke:
            row["error"] = f"skipped: {s.remaining():.0f} s of budget left, the row needs about {MIN_BUDGET_S[key]} s"
            log(f"{key}: {row['error']}")
            self.save()
            return
        t = time.time()
        peak_reset(s.device)
        try:
            fn(row, *args)
        except OutOfTime as e:
            row["error"] = error_text(e)
            raise
        except Exception as e:  # noqa: BLE001
            row["error"] = error_text(e)
            row["trace"] = traceback.format_exc()[-3000:]
            log(f"{key} failed: {row['error']}")
        finally:
            row["seconds"] = time.time() - t
            row["peak_allocated_bytes"] = peak_bytes(s.device)
            free_memory(s.device)
            self.save()

    # -- the rows --------------------------------------------------------------------------------

    def hf_eager(self, row: dict, name: str, mres: dict, scratch: Path) -> None:
        s, shape = self.s, mres["shape"]
        model = mres.pop("_hf_model")
        try:
            run_hf_eager(model, shape, s, row, self.save)
        finally:
            del model
            free_memory(s.device)
        try:
            spec = {"mode": "hf_start", "model_dir": mres["model_dir"], "device": s.device, "dtype": s.dtype_name,
                    "prompt": random_prompts(1, s.prompt_len, shape["vocab_size"], seed=7)[0]}
            start = run_child(spec, {}, timeout=s.child_timeout(reserve=60, cap=300))
            start["cold_s"] = start["warm_s"] = start["start_to_first_token_s"]
            row["start"] = start
            log(f"  transformers eager start to first token: {start['start_to_first_token_s']:.1f} s")
        except Exception as e:  # noqa: BLE001
            row["start"] = {"error": error_text(e)}
            log(f"  transformers eager start failed: {error_text(e)}")

    def gk_compiled(self, row: dict, name: str, mres: dict, scratch: Path) -> None:
        import graphkiln

        s, shape = self.s, mres["shape"]
        artifact = scratch / f"{name}-artifact"
        caches = scratch / f"{name}-caches"  # fresh: the cold start compiles everything
        cache_env = {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
        prompt = random_prompts(1, s.prompt_len, shape["vocab_size"], seed=7)[0]
        spec = {"model_dir": mres["model_dir"], "artifact": str(artifact), "config": s.compile_config(),
                "engine": s.engine, "prompt": prompt}
        row["compile_config"] = s.compile_config()
        row["engine"] = dict(s.engine)
        try:
            log("  graphkiln cold start (compile in a fresh process, empty caches) ...")
            cold = run_child({**spec, "mode": "gk_cold"}, cache_env, timeout=s.child_timeout(reserve=90))
            row["start"]["cold"] = cold
            row["start"]["cold_s"] = cold["start_to_first_token_s"]
            row["compile_s"] = cold.get("compile_s")
            log(f"  graphkiln cold start to first token: {cold['start_to_first_token_s']:.1f} s "
                f"(compile {cold.get('compile_s', float('nan')):.1f} s; {cold.get('compile_summary', '')})")
        except subprocess.TimeoutExpired as e:
            row["start"]["cold"] = {"error": error_text(e)}
            raise RuntimeError(f"the cold compile ran past its {e.timeout:.0f} s (the time left before --hard-limit-s)") from e
        except Exception as e:  # noqa: BLE001
            row["start"]["cold"] = {"error": error_text(e)}
            log(f"  graphkiln cold start failed: {error_text(e)}")
        if not (artifact / "manifest.json").is_file():
            log("  no artifact from the cold child: compiling in this process instead")
            t = time.time()
            graphkiln.compile_model(mres["model_dir"], artifact, graphkiln.CompileConfig(**s.compile_config()), force=True)
            row["compile_in_process_s"] = time.time() - t
        try:
            warm = run_child({**spec, "mode": "gk_warm"}, cache_env, timeout=s.child_timeout(reserve=60, cap=300))
            row["start"]["warm"] = warm
            row["start"]["warm_s"] = warm["start_to_first_token_s"]
            log(f"  graphkiln warm start to first token: {warm['start_to_first_token_s']:.1f} s "
                f"(load {warm['load_s']:.1f} s, capture {warm.get('capture_s') or 0:.1f} s)")
        except Exception as e:  # noqa: BLE001
            row["start"]["warm"] = {"error": error_text(e)}
            log(f"  graphkiln warm start failed: {error_text(e)}")
        t = time.time()
        with env_override(cache_env):  # load as the warm start did: the caches the cold compile filled
            llm = graphkiln.load(artifact, **s.engine)
        row["load_in_process_s"] = time.time() - t
        try:
            row.update(graph_stats(llm))
            if s.device == "cuda" and not row.get("decode_graphs"):
                row["warning"] = "no decode CUDA graphs were captured"
            if "_ref_logits" in mres:
                row["check"] = check_against_hf(llm, mres["_check_ids"], mres["_ref_logits"])
                log(f"  graphkiln compiled vs transformers logits: {row['check']}")
            run_gk_timings(llm, shape, s, row, "graphkiln compiled", self.save)
        finally:
            del llm

    def gk_eager(self, row: dict, name: str, mres: dict, scratch: Path) -> None:
        import graphkiln

        s, shape = self.s, mres["shape"]
        t = time.time()
        llm = graphkiln.LLM.eager(mres["model_dir"], device=s.device, dtype=s.dtype_name, **s.engine)
        row["load_in_process_s"] = time.time() - t
        try:
            if "_ref_logits" in mres:
                row["check"] = check_against_hf(llm, mres["_check_ids"], mres["_ref_logits"])
                log(f"  graphkiln eager vs transformers logits: {row['check']}")
            run_gk_timings(llm, shape, s, row, "graphkiln eager", self.save)
        finally:
            del llm

    def hf_static(self, row: dict, name: str, mres: dict, scratch: Path) -> None:
        import torch
        from transformers import LlamaForCausalLM

        s, shape = self.s, mres["shape"]
        t = time.time()
        model = LlamaForCausalLM.from_pretrained(mres["model_dir"], dtype=s.dtype).to(s.device).eval()
        row["load_in_process_s"] = time.time() - t
        try:
            run_hf_static(model, shape, s, row, self.save)
        finally:
            del model
            torch._dynamo.reset()  # drops the compiled code and its cudagraph trees' memory

    # -- the whole run ---------------------------------------------------------------------------

    def run(self) -> None:
        s = self.s
        log(f"graphkiln bench: {self.env['device_name']}, torch {self.env['torch']}, transformers "
            f"{self.env['transformers']}, triton {self.env['triton']}; models {','.join(s.models)}; rows "
            f"{','.join(s.rows)}; batches {s.batches}; budget {s.budget_s:.0f} s; out {self.json_path}")
        self.guarded("hardware", self.hardware)
        scratch = scratch_root(s.models, s)
        log(f"scratch directory {scratch}")
        try:
            for name in s.models:
                self.model(name, scratch)
            for name in s.models:
                if "hf_static" in s.rows and name in s.static_models and name in self.results["models"]:
                    mres = self.results["models"][name]
                    log(f"{name}: transformers static cache + torch.compile")
                    self.row(mres, "hf_static", self.hf_static, name, mres, scratch)
        except OutOfTime as e:
            log(error_text(e))
        finally:
            disarm_watchdog()
            for mres in self.results["models"].values():
                for k in [k for k in mres if k.startswith("_")]:
                    del mres[k]
            if not s.keep:
                shutil.rmtree(scratch, ignore_errors=True)
            else:
                log(f"kept scratch directory {scratch}")
        self.save()
        if s.plot:
            try:
                made = self.report.plot(self.results, self.png_path)
                log(f"plot: {self.png_path}" if made else "plot skipped: matplotlib is not installed")
            except Exception as e:  # noqa: BLE001
                log(f"plot failed: {error_text(e)}")
        log(f"wrote {self.json_path} and {self.md_path}")
        print(self.report.short_table(self.results), flush=True)

    def hardware(self) -> None:
        hw = measure_hardware(self.s)
        self.results["hardware"] = hw
        log(f"copy bandwidth {hw['copy_bandwidth_Bps'] / 1e12:.3f} TB/s (read+write), "
            f"matmul {hw['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")

    def model(self, name: str, scratch: Path) -> None:
        s = self.s
        if name not in MODELS:
            self.results["errors"].append({"where": name, "error": f"unknown model {name!r}; use {sorted(MODELS)}"})
            return
        shape = shape_of(name, s)
        mb = model_bytes(shape, s.dtype_bytes)
        mres = {"shape": shape, "bytes": mb, "rows": {}, "model_dir": str(scratch / name)}
        self.results["models"][name] = mres
        log(f"{name}: {mb['params'] / 1e6:.1f} M params, {mb['weight_bytes_all'] / 2**30:.3f} GiB of weights")
        if self.results["hardware"]:
            mres["rows"]["floor"] = floor_row(mb, self.results["hardware"], s)
            f1 = mres["rows"]["floor"]["decode"].get("1", {}).get("ms_per_token")
            log(f"  floor at batch 1: {f1:.3f} ms/token" if f1 else "  floor computed")
        if s.remaining() < MIN_BUDGET_S["build"] and not s.smoke:
            self.results["errors"].append({"where": name, "error": "skipped: time budget spent"})
            return

        def build() -> None:
            t = time.time()
            model = build_hf_model(shape, s)
            mres["build_s"] = time.time() - t
            mres["params_hf"] = sum(p.numel() for p in model.parameters())
            t = time.time()
            model.save_pretrained(mres["model_dir"])
            mres["save_s"] = time.time() - t
            mres["_hf_model"] = model
            mres["_check_ids"] = random_prompts(1, 32, shape["vocab_size"], seed=3)[0]
            mres["_ref_logits"] = hf_reference_logits(model, mres["_check_ids"], s)
            log(f"  built in {mres['build_s']:.1f} s, saved in {mres['save_s']:.1f} s ({mres['params_hf']} params)")

        if not self.guarded(f"{name}: build", build):
            mres.pop("_hf_model", None)
            return
        if "hf_eager" in s.rows:
            log(f"{name}: transformers eager")
            self.row(mres, "hf_eager", self.hf_eager, name, mres, scratch)
        mres.pop("_hf_model", None)
        free_memory(s.device)
        if "gk_compiled" in s.rows:
            log(f"{name}: graphkiln compiled + CUDA graphs")
            self.row(mres, "gk_compiled", self.gk_compiled, name, mres, scratch)
        if "gk_eager" in s.rows:
            log(f"{name}: graphkiln eager")
            self.row(mres, "gk_eager", self.gk_eager, name, mres, scratch)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", help="comma list of 1b, 8b (default 1b,8b; smoke: smoke; also smoke-untied)")
    p.add_argument("--rows", help=f"comma list of {','.join(ROW_KEYS)} (default all; the floor is always computed)")
    p.add_argument("--batches", help="decode batch sizes (default 1,8,32,64; smoke 1,2)")
    p.add_argument("--prefill", help="prefill prompt lengths at batch 1 (default 128,1024,4096; smoke 16,48)")
    p.add_argument("--prompt-len", type=int, help="decode prompt tokens (default 128; smoke 16)")
    p.add_argument("--new-tokens", type=int, help="decode new tokens (default 128; smoke 8)")
    p.add_argument("--static-models", help="models that get the transformers static+compile row (default 1b; '' for none)")
    p.add_argument("--static-batches", help="batches for that row (default 1; each new batch recompiles)")
    p.add_argument("--decode-reps", type=int, default=1, help="timed generate calls per batch, the fastest kept")
    p.add_argument("--prefill-reps", type=int, help="timed prefills per length, the median kept (default 5)")
    p.add_argument("--decode-buckets", help="graphkiln decode batch buckets (default powers of 2 up to the largest batch)")
    p.add_argument("--prefill-buckets", help="graphkiln prefill token buckets (default 16..largest prefill, powers of 2)")
    p.add_argument("--budget-s", type=float, help="rows that would start past this many seconds are skipped "
                   "(default 450; smoke 1500)")
    p.add_argument("--hard-limit-s", type=float, help="the row still running at this many seconds is stopped "
                   "(default budget + 80; 0 = never)")
    p.add_argument("--reuse-caches", action="store_true", help="keep this process's Inductor/Triton cache "
                   "environment instead of fresh empty caches (the graphkiln cold start always starts empty)")
    p.add_argument("--out", help="results folder (default $OUT, else bench/results)")
    p.add_argument("--commit", help="git commit to record when the tree has no .git")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--keep", action="store_true", help="keep the scratch model and artifact directories")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes: every code path, minutes")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def arm_watchdog(seconds: float) -> None:
    """Turn the hard limit into an exception, so the row in flight is recorded and the tables still get written."""
    import signal

    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        return

    def fire(signum, frame):
        signal.alarm(0)
        raise OutOfTime(f"hard limit of {seconds:.0f} s reached; the rest of the run was skipped")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(max(1, int(seconds - (time.time() - _T0))))


def disarm_watchdog() -> None:
    import signal

    if hasattr(signal, "SIGALRM"):
        signal.alarm(0)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        child_main(json.loads(a.child))
        return 0
    sys.path.insert(0, str(BENCH_DIR))  # bench/report.py
    # Fresh Inductor and Triton caches for this process (set before torch reads them), so transformers'
    # first static-cache call compiles from scratch on every run; graphkiln's children get their own.
    caches = Path(tempfile.mkdtemp(prefix="gk-bench-caches-"))
    if not a.reuse_caches:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(caches / "triton")
    try:
        return _run(a)
    finally:
        shutil.rmtree(caches, ignore_errors=True)


def _run(a: argparse.Namespace) -> int:
    s = Settings(a)
    if s.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on a machine without a GPU", file=sys.stderr)
            return 2
    try:
        how = ensure_graphkiln()
    except Exception as e:  # noqa: BLE001
        print(f"graphkiln is not importable ({error_text(e)}); run `pip install --no-deps --no-build-isolation -e .` "
              "in the repository first", file=sys.stderr)
        return 2
    if how != "installed":
        log(f"graphkiln imported {how}")
    arm_watchdog(s.hard_limit_s)
    Run(s).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
