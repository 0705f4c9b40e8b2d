"""What every command shares: the clock and log, error text, the environment a result was measured in,
JSON output, random prompts, and the arguments and settings of the studies.

Only the standard library is imported at the top: torch, transformers and graphkiln are imported
where they are used, so `python -m bench report` and the start-up children stay light.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
T0 = time.time()  # the command's start: the log, --budget-s and --hard-limit-s count from here


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def greedy_agreement(tokens: list[list[int]], reference: list[list[int]],
                     reference_gaps: list[list[float]]) -> tuple[float, list[float]]:
    """The share of `tokens` equal to `reference`'s (per prompt, position by position), and where a prompt's
    tokens first part from the reference's, the reference's top-two logit gap there: a near-tie parts on a
    rounding difference, a wide gap on a wrong result."""
    pairs = [(a, b) for x, y in zip(tokens, reference) for a, b in zip(x, y)]
    parted = [(next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), None), gaps)
              for x, y, gaps in zip(tokens, reference, reference_gaps)]  # fmt: skip
    return sum(a == b for a, b in pairs) / len(pairs), [gaps[k] for k, gaps in parted if k is not None]


def top2_gaps(outputs) -> list[list[float]]:
    """Per request of `outputs` (generated with logprobs=2 or more), each new token's top-two logprob gap."""
    return [[t.top[0][1] - t.top[1][1] for t in o.logprobs] for o in outputs]


def git_commit(given: str | None = None, repo: Path = REPO) -> tuple[str, bool | None]:
    """(commit, uncommitted changes?): `given` (a copy without .git), else git's answer, else 'unknown'. A copy
    inside another repository's work tree gets 'unknown', not that repository's commit."""
    if given:
        return given, None
    try:
        found = subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                               capture_output=True, text=True, timeout=10)
        top_and_head = found.stdout.splitlines()
        if found.returncode == 0 and len(top_and_head) == 2 and Path(top_and_head[0]).resolve() == repo.resolve():
            dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            return top_and_head[1], bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown", None


def environment(device: str, commit: str | None = None) -> dict:
    """Date, versions, device and commit: the head of every result file."""
    import torch
    import transformers

    import graphkiln

    now = _dt.datetime.now(_dt.timezone.utc)
    env = {"date": now.strftime("%Y-%m-%d"), "time_utc": now.isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "graphkiln": graphkiln.__version__, "host": platform.node()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=torch.cuda.get_device_name(0), device_memory_bytes=props.total_memory,
                   multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    else:
        env.update(device_name="cpu", threads=torch.get_num_threads())
    env.update(cpu=cpu_model(), cpu_count=os.cpu_count())  # host-bound figures (serving, launch) follow the CPU
    env["git_commit"], env["git_dirty"] = git_commit(commit)
    return env


def cpu_model() -> str:
    """The host CPU's model name (Linux /proc/cpuinfo), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def device_slug(env: dict) -> str:
    """'nvidia-h200', 'cpu': the device part of result file names."""
    return re.sub(r"[^a-z0-9]+", "-", env["device_name"].lower()).strip("-") or "device"


def write_json(path: Path, data: dict) -> Path:
    """Write atomically (a run stopped mid-write keeps the previous file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    return path


def read_results(path: Path) -> dict:
    """A result JSON of `python -m bench run`; one missing, unreadable or not such JSON ends the command in one
    line naming it."""
    try:
        results = json.loads(Path(path).read_text())
    except OSError as e:
        raise SystemExit(f"{path}: {e.strerror}; give a result JSON of `python -m bench run`") from None
    except ValueError as e:  # (not UTF-8, or not JSON)
        raise SystemExit(f"{path}: not JSON ({e}); give a result JSON of `python -m bench run`") from None
    if not isinstance(results, dict):
        raise SystemExit(f"{path}: not a result JSON of `python -m bench run` (no object at its top)")
    return results


# The studies' shared arguments and settings.


def inductor_option(text: str) -> tuple[str, object]:
    """KEY=VALUE as (key, value), VALUE read as JSON where it parses, else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_study_arguments(p: argparse.ArgumentParser, model: str = "1b", layers: int | None = None) -> None:
    p.add_argument("--out", type=Path, default=None, help="results folder (default $OUT, else the current folder)")
    p.add_argument("--model", default=model, help=f"model shape: 1b, 8b, 70b (default {model}; smoke: smoke)")
    p.add_argument("--layers", type=int, default=layers, help="decoder layers (default: the model's)")
    p.add_argument("--commit", help="git commit to record where the tree has no .git")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes: every code path the CPU can run")


@dataclass(frozen=True)
class Study:
    """Where and what a study runs: device, dtype, model shape, output folder."""

    name: str
    device: str
    dtype_name: str
    model: str
    layers: int | None
    out: Path
    smoke: bool
    commit: str | None

    @classmethod
    def of(cls, name: str, a: argparse.Namespace) -> Study:
        import torch

        if not a.smoke and not torch.cuda.is_available():
            raise SystemExit(f"bench {name}: no CUDA device here; --smoke runs it on the CPU with tiny shapes")
        out = Path(a.out or os.environ.get("OUT") or ".").resolve()
        return cls(name, "cpu" if a.smoke else "cuda", "float32" if a.smoke else "bfloat16",
                   "smoke" if a.smoke else a.model, a.layers, out, a.smoke, a.commit)

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def two_gpus(self) -> None:
        """Exit, naming the study, where it runs on CUDA with fewer than 2 GPUs (its TP-2 rows need them)."""
        import torch

        if self.cuda and (count := torch.cuda.device_count()) < 2:
            raise SystemExit(f"bench {self.name}: needs 2 GPUs (this machine shows {count}); --smoke runs it on the CPU")

    def chosen(self, text: str, known: tuple[str, ...], what: str) -> list[str]:
        """The names of the comma list `text`, in order; exit naming any not in `known`."""
        names = [n.strip() for n in text.split(",") if n.strip()]
        if unknown := sorted(set(names) - set(known)):
            raise SystemExit(f"bench {self.name}: unknown {what} {unknown}; use some of {list(known)}")
        return names

    def gpu_only(self, what: str) -> bool:
        """False, after saying so, where `what` needs the GPU (CUDA graphs, Triton kernels)."""
        if not self.cuda:
            log(f"{what}: skipped on the CPU (needs CUDA)")
        return self.cuda

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """A scratch folder for the study's model and artifacts, removed after."""
        with tempfile.TemporaryDirectory(prefix=f"gk-bench-{self.name}-") as folder:
            yield Path(folder)

    def save(self, results: dict, suffix: str = "") -> Path:
        """<out>/<study>[-suffix].json with the environment at its head."""
        env = environment(self.device, self.commit)
        name = f"{self.name}{'-' + suffix if suffix else ''}.json"
        return write_json(self.out / name, {"meta": {**env, "study": self.name, "model": self.model,
                                                     "layers": self.layers, "smoke": self.smoke}, **results})
