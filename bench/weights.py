"""Weights from the page cache to the device: graphkiln's reader (models/weights_reader.py) beside
safetensors' own `safe_open(...).get_tensor` + copy, on one safetensors file of synthetic weights.

    python -m bench weights --gib 16 --device cuda    # the 8B-like model's bytes, on the GPU
    python -m bench weights --gib 1 --device cpu      # CPU: into host memory

The file is written once to a scratch folder (/dev/shm when it has room) and read once unmeasured,
so every timed read comes from the page cache. Each way is timed `--reps` times; the best and the
median rate are reported, in GB/s of file bytes (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from .common import log, write_json
from .models import scratch_dir

TENSOR_SHAPE = (4096, 14336)  # an 8B MLP projection: 117 MB in bfloat16


def write_weights(folder: Path, gib: float) -> Path:
    import torch
    from safetensors.torch import save_file

    per = TENSOR_SHAPE[0] * TENSOR_SHAPE[1] * 2
    count = max(1, int(gib * 2**30 // per))
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.weight": torch.randn(TENSOR_SHAPE, generator=g).to(torch.bfloat16) for i in range(count)}
    path = folder / "model.safetensors"
    save_file(tensors, str(path))
    return path


def read_graphkiln(path: Path, dests: dict, device) -> None:
    from graphkiln.models.weights_reader import TensorRead, WeightsReader, read_header

    entries = read_header(path)
    WeightsReader(device).read([TensorRead(entries[name], dest) for name, dest in dests.items()])


def read_safetensors(path: Path, dests: dict, device) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for name, dest in dests.items():
            dest.copy_(f.get_tensor(name))


def main(a: argparse.Namespace) -> int:
    import torch

    device = torch.device(a.device)
    folder = scratch_dir(a.gib * 2**30 * 1.2)
    try:
        log(f"writing {a.gib} GiB of bfloat16 weights to {folder}")
        path = write_weights(folder, a.gib)
        size = path.stat().st_size
        from graphkiln.models.weights_reader import read_header

        dests = {name: torch.empty(e.shape, dtype=e.dtype, device=device) for name, e in read_header(path).items()}
        results = {"device": str(device), "file_bytes": size, "reps": a.reps, "ways": {}}
        for way, fn in (("graphkiln", read_graphkiln), ("safetensors", read_safetensors)):
            fn(path, dests, device)  # page cache warm, lazy initialisation done
            rates = []
            for _ in range(a.reps):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                fn(path, dests, device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                rates.append(size / (time.perf_counter() - t) / 1e9)
            results["ways"][way] = {"best_GBps": max(rates), "median_GBps": statistics.median(rates), "all": rates}
            log(f"{way}: best {max(rates):.2f} GB/s, median {statistics.median(rates):.2f} GB/s "
                f"({size / 1e9:.2f} GB, {device})")
        if a.out:
            write_json(Path(a.out) / f"weights-{device.type}.json", results)
        print(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, default=2.0, help="GiB of weights in the file (default 2)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    p.add_argument("--reps", type=int, default=5, help="timed reads per way (default 5)")
    p.add_argument("--out", help="folder for weights-<device>.json")
