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
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from graphkiln.runtime.config import ATTENTION_BACKENDS

from . import report
from .common import T0, device_slug, environment, error_text, log, random_prompts, write_json
from .measure import copy_rate, matmul_rate
from .models import MODELS, QUANTIZATIONS, build_hf_model, model_bytes, scratch_dir, shape_of
from .rows import ROW_FUNCTIONS, floor_row, free_memory
from .startup import ensure_bytecode

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
        self.quantization = a.quantization
        self.passes = {"disabled_passes": tuple(a.disable_pass), "enabled_passes": tuple(a.enable_pass)}
        self.attention_backend = a.attention_backend or ("sdpa" if smoke else "triton")
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
            attention_backend=self.attention_backend,
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
        mb = model_bytes(shape, s.dtype_bytes, s.quantization)
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
    p.add_argument("--quantization", choices=QUANTIZATIONS, help="compile the graphkiln compiled row with "
                   "--quantization (its floor counts the quantized bytes; the other rows stay unquantized)")
    p.add_argument("--disable-pass", action="append", default=[], help="a graph pass the graphkiln compiled row's "
                   "compile leaves out (repeatable)")
    p.add_argument("--enable-pass", action="append", default=[], help="an optional graph pass it runs (repeatable)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, help="the graphkiln rows' attention backend "
                   "(default triton; smoke: sdpa)")
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
