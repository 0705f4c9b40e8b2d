"""Weights from the page cache to the device: graphkiln's reader (models/weights_reader.py), the reader before
it (bench/weights_baseline.py) and safetensors' own `safe_open(...).get_tensor` + copy, on one safetensors file
of synthetic weights; alone, and beside Python work that holds the interpreter lock the readers need:

    python -m bench weights --gib 16 --device cuda    # the 8B-like model's bytes, on the GPU
    python -m bench weights --gib 1 --device cpu      # CPU: into host memory
    python -m bench weights --gib 15 --layout llama   # the 8B model's own 291 tensors (--layout mlp: 117 MB each)
    python -m bench weights --gib 0.1 --layout small  # 1600 tensors of 64 KB: the cost per tensor
    python -m bench weights --gib 4 --ways graphkiln,baseline --beside-busy-thread --beside-import \\
        --switch-intervals 0.005,0.0005,0.0001

`--beside-busy-thread`: each timed read runs while a thread of this process runs pure Python.
`--beside-import`: each timed read runs in a fresh process (`python -m bench _weights SPEC`) on a thread,
while the main thread imports Inductor, as `load` does; the import's own seconds are reported, and once
more with no read beside it (way `none`). A fresh process also pays for its staging memory (pinned on CUDA:
`staging_s`), which a process that read before finds in torch's cache.
`--switch-intervals`: Python's thread switch interval during each read beside Python work, as a load sets
it (models/switch_interval.py: at most that, the interpreter's own restored after; default: the
interpreter's, 0.005 s, which a load's default of 0.0001 replaces).
`--buffer-mb`: the reader's staging buffer sizes to try (way `graphkiln-<MB>MB` each; `<MB>MB-<N>t`: and N threads).

The file is written once to a scratch folder (/dev/shm when it has room) and read once unmeasured,
so every timed read comes from the page cache. Each way is timed `--reps` times; the best and the
median rate are reported, in GB/s of file bytes (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .common import REPO, log, write_json
from .models import scratch_dir

TENSOR_SHAPE = (4096, 14336)  # an 8B MLP projection: 117 MB in bfloat16
SMALL_SHAPE = (64, 512)
LLAMA_8B_LAYER = {"input_layernorm": (4096,), "q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096),
                  "o_proj": (4096, 4096), "post_attention_layernorm": (4096,), "gate_proj": (14336, 4096),
                  "up_proj": (14336, 4096), "down_proj": (4096, 14336)}  # fmt: skip
LLAMA_8B_EMBEDDING = (128256, 4096)
CHILD_PREFIX = "GK_WEIGHTS_CHILD "


def layout(name: str, gib: float) -> dict[str, tuple[int, ...]]:
    """Tensor shapes by name: `mlp`, 8B MLP projections; `small`, 64 KB tensors (the reader's cost per tensor);
    `llama`, the 8B model's own tensors (embeddings, then as
    many layers as fit, nine tensors each, two of them 8 KB norms), its two 1 GB embeddings from 4 GiB on."""
    budget = gib * 2**30 / 2
    if name in ("mlp", "small"):
        shape = TENSOR_SHAPE if name == "mlp" else SMALL_SHAPE
        return {f"layers.{i}.weight": shape for i in range(max(1, int(budget // math.prod(shape))))}
    shapes: dict[str, tuple[int, ...]] = {}
    if gib >= 4:
        shapes = {"model.embed_tokens.weight": LLAMA_8B_EMBEDDING, "lm_head.weight": LLAMA_8B_EMBEDDING,
                  "model.norm.weight": (4096,)}  # fmt: skip
        budget -= 2 * math.prod(LLAMA_8B_EMBEDDING)
    per_layer = sum(math.prod(s) for s in LLAMA_8B_LAYER.values())
    for i in range(max(1, int(budget // per_layer))):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in LLAMA_8B_LAYER.items()})
    return shapes


def write_weights(folder: Path, gib: float, layout_name: str = "mlp") -> Path:
    """A bfloat16 safetensors file of the layout, written tensor by tensor (one random tensor per shape, its
    bytes repeated for every tensor of that shape: no more than one of each is in memory)."""
    import torch

    g = torch.Generator().manual_seed(0)
    shapes = layout(layout_name, gib)
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = folder / "model.safetensors"
    random: dict[tuple[int, ...], bytes] = {}
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for shape in shapes.values():
            if shape not in random:
                random[shape] = torch.randn(shape, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
            f.write(random[shape])
    return path


def destinations(path: Path, device, dtype: str | None) -> dict:
    """An empty tensor per tensor of the file, of its dtype or `dtype` (a conversion after the copy: on the CPU,
    the reader then stages the bytes as it does for a GPU)."""
    import torch

    from graphkiln.models.safetensors_header import read_header

    return {name: torch.empty(e.shape, dtype=getattr(torch, dtype) if dtype else e.dtype, device=device)
            for name, e in read_header(path).items()}  # fmt: skip


def reader_for(way: str, device):
    """The reader a way names: `graphkiln`, `graphkiln-<MB>MB` (that buffer size), `graphkiln-<MB>MB-<N>t` (and N
    threads) or `baseline`."""
    from graphkiln.models.weights_reader import WeightsReader

    from .weights_baseline import WeightsReader as BaselineReader

    if way == "baseline":
        return BaselineReader(device)
    if way.startswith("graphkiln-"):
        size, _, threads = way.removeprefix("graphkiln-").partition("-")
        options = {"threads": int(threads.removesuffix("t"))} if threads else {}
        return WeightsReader(device, buffer_bytes=int(size.removesuffix("MB")) << 20, **options)
    return WeightsReader(device)


def read_once(way: str, path: Path, dests: dict, device) -> dict:
    """One read the way names, until its bytes are on the device; seconds and the reader's staging figures."""
    import torch

    start = time.perf_counter()
    staging = {}
    if way == "safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for name, dest in dests.items():
                dest.copy_(f.get_tensor(name))
    else:
        from graphkiln.models.safetensors_header import read_header
        from graphkiln.models.weights_reader import TensorRead

        entries = read_header(path)
        stats = reader_for(way, device).read([TensorRead(entries[name], dest) for name, dest in dests.items()])
        staging = {"staging_bytes": getattr(stats, "staging_bytes", 0), "staging_s": getattr(stats, "staging_s", 0.0)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"seconds": time.perf_counter() - start, **staging}


@contextlib.contextmanager
def busy_thread() -> Iterator[None]:
    """A thread running pure Python inside (it holds the interpreter lock until another thread asks for it)."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            for i in range(1000):
                n += i

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def child_main(spec: dict) -> None:
    """A fresh process: a read on a thread while this thread imports Inductor (or the import alone: way none)."""
    import torch

    from graphkiln.compat import import_inductor
    from graphkiln.models.switch_interval import lowered_switch_interval
    from graphkiln.models.weights_reader import indexed

    reader_for("baseline", "cpu"), reader_for("graphkiln", "cpu")  # their modules imported before the race
    device = indexed(torch.device(spec["device"]))  # (a bare "cuda" names this thread's device, not the reader's)
    if device.type == "cuda":
        torch.zeros(1, device=device)
    path = Path(spec["path"])
    dests = destinations(path, device, spec["dest_dtype"])
    result: dict = {}

    def read() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            result.update(read_once(spec["way"], path, dests, device))
        except Exception as e:  # reported to the parent, which raises it with the row it was for
            result["error"] = f"{type(e).__name__}: {e}"

    with lowered_switch_interval(spec["switch_interval"]):
        start = time.perf_counter()
        thread = threading.Thread(target=read) if spec["way"] != "none" else None
        if thread is not None:
            thread.start()
        import_inductor()
        result["import_s"] = time.perf_counter() - start
        if thread is not None:
            thread.join()
    print(CHILD_PREFIX + json.dumps(result), flush=True)


def beside_import(way: str, path: Path, device, interval: float | None, dest_dtype: str | None) -> dict:
    spec = {"way": way, "path": str(path), "device": str(device), "switch_interval": interval, "dest_dtype": dest_dtype}
    proc = subprocess.run([sys.executable, "-m", "bench", "_weights", json.dumps(spec)], cwd=str(REPO),
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"weights child {way} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    result = json.loads(lines[-1][len(CHILD_PREFIX) :])
    if "error" in result:
        raise RuntimeError(f"weights child {way}: the read beside the import failed: {result['error']}")
    return result


def measure(way: str, condition: str, interval: float | None, path: Path, dests: dict, device, a) -> dict:
    from graphkiln.models.switch_interval import lowered_switch_interval

    size = path.stat().st_size
    runs = []
    for _ in range(a.reps):
        if condition == "import":
            runs.append(beside_import(way, path, device, interval, a.dest_dtype))
            continue
        beside = busy_thread() if condition == "busy-thread" else contextlib.nullcontext()
        with beside, lowered_switch_interval(interval):
            runs.append(read_once(way, path, dests, device))
    row: dict = {"condition": condition, "switch_interval": interval or sys.getswitchinterval(), "way": way}
    if way != "none":
        rates = [size / r["seconds"] / 1e9 for r in runs]
        row.update(best_GBps=max(rates), median_GBps=statistics.median(rates), all_GBps=rates)
        if "staging_s" in runs[0]:
            row.update(staging_s=statistics.median(r["staging_s"] for r in runs),
                       staging_bytes=runs[0]["staging_bytes"])  # fmt: skip
    if condition == "import":
        row["import_s"] = statistics.median(r["import_s"] for r in runs)
    return row


def table(rows: list[dict]) -> str:
    header = ["beside", "switch interval (s)", "way", "best GB/s", "median GB/s", "import (s)", "staging MB",
              "staging alloc (s)"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else ""

    for r in rows:
        staging = format(r["staging_bytes"] / 2**20, ".0f") if "staging_bytes" in r else ""
        lines.append(f"| {r['condition']} | {r['switch_interval']:g} | {r['way']} | {cell(r, 'best_GBps', '.2f')} | "
                     f"{cell(r, 'median_GBps', '.2f')} | {cell(r, 'import_s', '.2f')} | {staging} | "
                     f"{cell(r, 'staging_s', '.3f')} |")  # fmt: skip
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    import torch

    device = torch.device(a.device)
    ways = [w for w in a.ways.split(",") if w]
    if a.buffer_mb:
        sizes = [mb.replace("-", "MB-", 1) if "-" in mb else f"{mb}MB" for mb in a.buffer_mb.split(",")]
        ways = [w for w in ways if w != "graphkiln"] + [f"graphkiln-{size}" for size in sizes]
    intervals = [float(s) for s in a.switch_intervals.split(",")] if a.switch_intervals else [None]
    conditions = ["alone"] + ["busy-thread"] * a.beside_busy_thread + ["import"] * a.beside_import
    folder = scratch_dir(a.gib * 2**30 * 1.2)
    try:
        log(f"writing {a.gib} GiB of bfloat16 weights ({a.layout} layout) to {folder}")
        path = write_weights(folder, a.gib, a.layout)
        dests = destinations(path, device, a.dest_dtype)
        results = {"device": str(device), "file_bytes": path.stat().st_size, "layout": a.layout, "tensors": len(dests),
                   "dest_dtype": a.dest_dtype, "reps": a.reps, "cpus": os.cpu_count(), "rows": []}  # fmt: skip
        for way in ways:
            read_once(way, path, dests, device)  # page cache warm, lazy initialisation done
        for condition in conditions:
            for interval in intervals if condition != "alone" else [None]:
                for way in ways + (["none"] if condition == "import" else []):
                    row = measure(way, condition, interval, path, dests, device, a)
                    results["rows"].append(row)
                    log(json.dumps({k: v for k, v in row.items() if k != "all_GBps"}))
        if a.out:
            write_json(Path(a.out) / f"weights-{device.type}.json", results)
        print(table(results["rows"]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, default=2.0, help="GiB of weights in the file (default 2)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    p.add_argument("--layout", choices=("mlp", "llama", "small"), default="mlp",
                   help="mlp: 117 MB projections; llama: the 8B model's tensors, 9 a layer; small: 64 KB each "
                        "(default mlp)")
    p.add_argument("--dest-dtype", help="the destinations' dtype, such as float32 (default: the file's, bfloat16)")
    p.add_argument("--reps", type=int, default=5, help="timed reads per way and condition (default 5)")
    p.add_argument("--ways", default="graphkiln,baseline,safetensors",
                   help="comma list of graphkiln, baseline (the reader before), safetensors")
    p.add_argument("--buffer-mb", help="comma list of the reader's staging buffer sizes in MB (ways graphkiln-<MB>MB), "
                   "each optionally with a thread count, as 16-4t")
    p.add_argument("--beside-busy-thread", action="store_true", help="also read beside a thread running Python")
    p.add_argument("--beside-import", action="store_true",
                   help="also read in a fresh process beside the Inductor import (and time the import alone)")
    p.add_argument("--switch-intervals", help="comma list of sys.setswitchinterval seconds for the beside conditions")
    p.add_argument("--out", help="folder for weights-<device>.json")
