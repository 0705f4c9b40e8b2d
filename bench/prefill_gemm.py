"""Short-prefill matrix products (M = 128 rows) on the bench models' weights: cuBLAS, cuBLASLt and
Inductor's max-autotune choice (its Triton templates against ATen), against the copy-rate floor.

These products are a short prefill's longest kernels (`bench/decode_kernels.py --prefill 128`). On
the H200 at M=128 on the 8B-like shapes cuBLAS reaches 60% (o) to 93% (lm_head) of the copy rate;
Inductor's choice is at most 3% faster (gate_up) and up to 15% slower (q/k/v)
(bench/results/2026-11-29-nvidia-h200-prefill-gemm-8b.json). Each variant is timed as in
`skinny_gemm.py`: inside a CUDA graph, cycling through enough weight copies that every call reads
its weight from HBM. One device call, a few minutes (max-autotune benchmarks every template once
per shape).

    python3 -P bench/prefill_gemm.py --out $OUT [--rows 128 512] [--models 8b]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_kernels import copy_bandwidth  # noqa: E402
from skinny_gemm import SHAPES, graph_time_us  # noqa: E402


def with_blas(library: str, fn):
    """fn run with torch's preferred BLAS library set to `library` (restored after)."""
    def run(w):
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn(w)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[128])
    parser.add_argument("--models", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    args = parser.parse_args()
    torch.manual_seed(0)
    rate = copy_bandwidth() / 1e12  # TB/s
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tbps": rate, "shapes": []}
    print(f"{results['device']}: copy {rate:.2f} TB/s", flush=True)

    def product(x, w):
        return x @ w.t()

    for model in args.models:
        for name, (n, k) in SHAPES[model].items():
            nbytes = n * k * 2
            copies = max(2, -(-(600 << 20) // nbytes))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            calls = max(copies, 24)
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                floor_us = (nbytes + 2 * m * (n + k)) / (rate * 1e6)
                tuned = torch.compile(product, mode="max-autotune-no-cudagraphs", dynamic=False)
                row = {"model": model, "name": name, "m": m, "n": n, "k": k, "floor_us": floor_us}
                for variant, fn in (("cublas_us", with_blas("cublas", lambda w, x=x: torch.mm(x, w.t()))),
                                    ("cublaslt_us", with_blas("cublaslt", lambda w, x=x: torch.mm(x, w.t()))),
                                    ("inductor_us", lambda w, x=x, tuned=tuned: tuned(x, w))):
                    row[variant] = graph_time_us(fn, weights, calls)
                results["shapes"].append(row)
                print(f"{model:3} {name:8} m={m:4} floor {floor_us:6.1f} us | " + " | ".join(
                    f"{v.removesuffix('_us')} {row[v]:6.1f} us ({floor_us / row[v]:.0%})"
                    for v in ("cublas_us", "cublaslt_us", "inductor_us")), flush=True)
            del weights
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
