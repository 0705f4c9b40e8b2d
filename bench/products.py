"""The bench models' weight products at decode (1 row) and short-prefill (128 rows) sizes, against the
copy-rate floor (weight and activation bytes / copy rate). A few minutes.

    python -m bench products --out $OUT [--rows 1 128] [--models 1b 8b] [--sweep]

  1 row      cuBLAS (torch.mm) against the Triton GEMV behind graphkiln::linear, and its modes: gate_up with the
             activation applied to its outputs (graphkiln::linear_silu_mul), down on a gated input
             (graphkiln::silu_mul_linear); --sweep: every tiling of the GEMV too (of the activated one for
             gate_up), back to back (`python -m bench tiles` tries them in place)
  M rows     cuBLAS, cuBLASLt and Inductor's max-autotune choice (its Triton templates vs ATen;
             --no-inductor leaves it out)

Each product is timed inside a CUDA graph that calls it once per weight copy, cycling over enough
copies (600 MiB) that every call reads its weight from memory, as a decode step or a prefill does.
Also the cost of an empty Triton kernel in a graph. On the CPU (--smoke) torch.mm and Inductor's
default choice run; cuBLASLt, the GEMV and the empty kernel need CUDA.
"""

from __future__ import annotations

import argparse
import itertools

from .common import Study, add_study_arguments, log
from .measure import copy_rate, in_graph, time_ms
from .models import projections
from .report import text_table

SWEEP = list(itertools.product((8, 16, 32, 64), (128, 256, 512, 1024), (4, 8), (3, 5)))


def per_call_us(fn, weights: list, calls: int, device: str) -> float:
    """Microseconds per fn(w) inside one CUDA graph of `calls` calls cycling through `weights`."""
    replay = in_graph(lambda: [fn(weights[i % len(weights)]) for i in range(calls)], device)
    return time_ms(replay, device, reps=5, warmup=1).median_ms * 1e3 / calls


def with_blas(library: str, fn):
    """fn run with torch's preferred BLAS library set to `library` (restored after)."""
    import torch

    def run(w):
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn(w)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    return run


def variants(study: Study, x, rows: int, inductor: bool = True, projection: str = "") -> dict:
    """name -> fn(weight) of every product timed at this row count (those this device can run); at one row the
    GEMV's mode for `projection` too (activated for gate_up, gated for down)."""
    import torch

    def product(a, w):
        return a @ w.t()

    out = {"cublas": lambda w: torch.mm(x, w.t())}
    if rows == 1 and study.cuda:
        from graphkiln.kernels.gemv import gemv

        out["gemv"] = lambda w: gemv(x, w)
        if projection == "gate_up":
            out["gemv_activated"] = lambda w: gemv(x, w, activated=True)
        if projection == "down":
            gate_up = torch.cat([x, x], dim=1)
            out["gemv_gated"] = lambda w: gemv(gate_up, w, gated=True)
    if rows > 1:
        if study.cuda:
            out["cublas"] = with_blas("cublas", out["cublas"])
            out["cublaslt"] = with_blas("cublaslt", lambda w: torch.mm(x, w.t()))
    if rows > 1 and inductor:
        tuned = torch.compile(product, mode="max-autotune-no-cudagraphs" if study.cuda else None, dynamic=False)
        out["inductor"] = lambda w: tuned(x, w)
    return out


def sweep(x, weights: list, calls: int, activated: bool = False) -> dict:
    """Microseconds per call of the GEMV (`activated`: applying the activation to its outputs) at every tiling in
    SWEEP that fits the GPU."""
    from triton.runtime.errors import OutOfResources

    from graphkiln.kernels.gemv import gemv

    timed = {}
    for tiles in SWEEP:
        try:
            timed[tiles] = per_call_us(lambda w, t=tiles: gemv(x, w, tiles=t, activated=activated), weights, calls,
                                       "cuda")
        except OutOfResources:
            continue
    return timed


def empty_kernel_us(study: Study) -> float | None:
    """One launch of an empty Triton kernel inside a CUDA graph: the floor under every small kernel."""
    if not study.cuda:
        return None
    import torch
    import triton

    @triton.jit
    def empty(x_ptr):
        pass

    dummy = torch.empty(1, device="cuda")
    return per_call_us(lambda w: empty[(1,)](dummy), [dummy], 200, "cuda")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 128], help="rows of x (default 1 128; smoke 1 8)")
    p.add_argument("--models", nargs="+", default=["1b", "8b"], help="whose weight shapes (default 1b 8b)")
    p.add_argument("--sweep", action="store_true", help="at 1 row, also every GEMV tiling (GPU)")
    p.add_argument("--inductor", action=argparse.BooleanOptionalAction, default=True,
                   help="beyond one row, also Inductor's max-autotune choice (compiles per shape: slow)")


def main(a: argparse.Namespace) -> int:
    import torch

    study = Study.of("products", a)
    device, dtype = study.device, study.dtype
    models, row_counts = (["smoke"], [1, 8]) if study.smoke else (a.models, a.rows)
    if not study.cuda:
        log("CPU smoke: torch.mm and Inductor's default choice; the GEMV, cuBLASLt and the empty kernel need CUDA")
    torch.manual_seed(0)
    rate = copy_rate(device, (64 << 20) if study.smoke else (1 << 30))
    results: dict = {"copy_Bps": rate, "empty_kernel_us": empty_kernel_us(study), "shapes": []}
    log(f"copy {rate / 1e12:.3f} TB/s; empty Triton kernel in a graph: {results['empty_kernel_us']} us")
    for model in models:
        for name, (n, k) in projections(model).items():
            nbytes = n * k * dtype.itemsize
            copies = max(2, -(-(600 << 20) // nbytes)) if study.cuda else 2
            weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
            calls = max(copies, 24)
            for m in row_counts:
                x = torch.randn(m, k, device=device, dtype=dtype)
                floor_us = (nbytes + dtype.itemsize * m * (n + k)) / rate * 1e6
                row = {"model": model, "name": name, "m": m, "n": n, "k": k, "floor_us": floor_us}
                for variant, fn in variants(study, x, m, a.inductor, name).items():
                    row[f"{variant}_us"] = per_call_us(fn, weights, calls, device)
                    row[f"{variant}_of_floor"] = floor_us / row[f"{variant}_us"]
                if m == 1 and "gemv_us" in row:
                    want = x.float() @ weights[0].float().t()
                    row["gemv_max_err"] = (variants(study, x, 1)["gemv"](weights[0]).float() - want).abs().max().item()
                    if a.sweep:
                        row["sweep_top5"] = sorted((us, t) for t, us in sweep(x, weights, calls).items())[:5]
                    if a.sweep and name == "gate_up":
                        row["sweep_activated_top5"] = sorted(
                            (us, t) for t, us in sweep(x, weights, calls, activated=True).items())[:5]
                results["shapes"].append(row)
                log(f"{model:5} {name:8} m={m:<4} floor {floor_us:8.1f} us | " + " | ".join(
                    f"{v.removesuffix('_us')} {row[v]:8.1f} us ({row[v.replace('_us', '_of_floor')]:.0%})"
                    for v in row if v.endswith("_us") and v != "floor_us"))
            del weights
            if study.cuda:
                torch.cuda.empty_cache()
    columns = ["model", "name", "m", "floor_us"] + sorted({k for r in results["shapes"] for k in r if k.endswith("_us")}
                                                          - {"floor_us"})
    print(text_table(results["shapes"], columns))
    log(f"wrote {study.save(results)}")
    return 0
