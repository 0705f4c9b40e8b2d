"""The run: environment, per-model and per-row orchestration with the budget and the watchdog, and the
results (JSON rewritten after every row, markdown beside it, the PNG and the short table at the end)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback

from . import rows_graphkiln, rows_transformers
from .bytecode import ensure_bytecode
from .common import REPO, T0, OutOfTime, error_text, log
from .floor import floor_row, measure_hardware
from .markdown import to_markdown
from .models import MODELS, build, model_bytes, scratch_root, shape_of
from .results import add_ratios
from .settings import BENCH_ROWS, BUILD_MIN_S, Settings
from .summary import plot, short_table
from .timing import free_memory, peak_bytes, peak_reset

ROW_FUNCTIONS = {"hf_eager": rows_transformers.eager, "gk_compiled": rows_graphkiln.compiled,
                 "gk_eager": rows_graphkiln.eager, "hf_static": rows_transformers.static}


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
    env["bytecode"] = ensure_bytecode()
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


def arm_watchdog(seconds: float) -> None:
    """Turn the hard limit into an exception, so the row in flight is recorded and the tables still get written."""
    import signal

    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        return

    def fire(signum, frame):
        signal.alarm(0)
        raise OutOfTime(f"hard limit of {seconds:.0f} s reached; the rest of the run was skipped")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(max(1, int(seconds - (time.time() - T0))))


def disarm_watchdog() -> None:
    import signal

    if hasattr(signal, "SIGALRM"):
        signal.alarm(0)


class Run:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.env = environment(s)
        self.results: dict = {"meta": {**self.env, "settings": s.as_dict(), "argv": sys.argv[1:]},
                              "hardware": None, "models": {}, "errors": []}
        s.out.mkdir(parents=True, exist_ok=True)
        self.stem = s.out / f"{self.env['date']}-{device_slug(self.env, s.smoke)}"
        self.json_path = self.stem.with_suffix(".json")
        self.md_path = self.stem.with_suffix(".md")
        self.png_path = self.stem.with_suffix(".png")

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = time.time() - T0
        add_ratios(self.results)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(public(self.results), indent=1, default=str))
        tmp.replace(self.json_path)
        with contextlib.suppress(Exception):
            self.md_path.write_text(to_markdown(public(self.results)))

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

    def row(self, name: str, key: str) -> None:
        """Run one row of model `name` (if asked for and the budget allows), its error recorded in the row."""
        s = self.s
        if key not in s.rows:
            return
        json_name, title, min_s = BENCH_ROWS[key]
        log(f"{name}: {title}")
        mres = self.results["models"][name]
        row = mres["rows"].setdefault(json_name, {"name": json_name, "decode": {}, "prefill": {}, "start": {}, "error": None})
        if s.remaining() < min_s and not s.smoke:
            row["error"] = f"skipped: {s.remaining():.0f} s of budget left, the row needs about {min_s} s"
            log(f"{key}: {row['error']}")
            self.save()
            return
        t = time.time()
        peak_reset(s.device)
        try:
            ROW_FUNCTIONS[key](s, mres, row, self.save)
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
            for name in s.models:  # after all models: the static row's first call compiles for minutes
                if name in s.static_models and name in self.results["models"]:
                    self.row(name, "hf_static")
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
                made = plot(self.results, self.png_path)
                log(f"plot: {self.png_path}" if made else "plot skipped: matplotlib is not installed")
            except Exception as e:  # noqa: BLE001
                log(f"plot failed: {error_text(e)}")
        log(f"wrote {self.json_path} and {self.md_path}")
        print(short_table(self.results), flush=True)

    def hardware(self) -> None:
        hw = measure_hardware(self.s)
        self.results["hardware"] = hw
        log(f"copy bandwidth {hw['copy_bandwidth_Bps'] / 1e12:.3f} TB/s (read+write), "
            f"matmul {hw['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")

    def model(self, name: str, scratch) -> None:
        """Build model `name`, then its rows in order: transformers eager (which frees the built model),
        graphkiln compiled, graphkiln eager."""
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
        if s.remaining() < BUILD_MIN_S and not s.smoke:
            self.results["errors"].append({"where": name, "error": "skipped: time budget spent"})
            return
        if not self.guarded(f"{name}: build", build, mres, s):
            mres.pop("_hf_model", None)
            return
        self.row(name, "hf_eager")
        mres.pop("_hf_model", None)
        free_memory(s.device)
        self.row(name, "gk_compiled")
        self.row(name, "gk_eager")
