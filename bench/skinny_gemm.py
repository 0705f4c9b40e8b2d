"""One-row matrix products (decode at batch 1) on the bench models' weights: cuBLAS vs our Triton GEMV.

Each variant is timed inside a CUDA graph that calls it once per weight copy, rotating over
enough copies that no weight stays in L2, so a call reads its weight from HBM as a decode step
does. Prints achieved bandwidth per shape and the per-launch cost of an empty kernel in a graph.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton

SHAPES = {  # (N, K) of y[M, N] = x[M, K] @ W[N, K]^T
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
           "lm_head": (128256, 2048)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
           "lm_head": (128256, 4096)},
}


@triton.jit
def _empty_kernel(x_ptr):
    pass


def graph_time_us(fn, weights: list[torch.Tensor], calls: int) -> float:
    """Microseconds per call of fn(w) inside one CUDA graph, cycling through `weights`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:3]:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main() -> None:
    from graphkiln.kernels.gemv import gemv

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true", help="also time every tiling of the GEMV kernel")
    args = parser.parse_args()
    torch.manual_seed(0)
    dummy = torch.empty(1, device="cuda")
    empty_us = graph_time_us(lambda w: _empty_kernel[(1,)](dummy), [dummy], 200)
    results = {"empty_kernel_us": empty_us, "shapes": []}
    print(f"empty Triton kernel in a graph: {empty_us:.2f} us")
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            nbytes = n * k * 2
            copies = max(2, -(-(600 << 20) // nbytes))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            calls = max(copies, 24)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            row = {"model": model, "name": name, "n": n, "k": k}
            row["cublas_us"] = graph_time_us(lambda w, x=x: torch.mm(x, w.t()), weights, calls)
            row["gemv_us"] = graph_time_us(lambda w, x=x: gemv(x, w), weights, calls)
            row["gemv_max_err"] = (gemv(x, weights[0]).float() - x.float() @ weights[0].float().t()).abs().max().item()
            if args.sweep:
                sweep = {}
                for cfg in itertools.product((8, 16, 32, 64), (128, 256, 512, 1024), (4, 8), (3, 5)):
                    sweep[cfg] = graph_time_us(lambda w, x=x, cfg=cfg: gemv(x, w, tiles=cfg), weights, calls)
                row["top5"] = sorted((v, c) for c, v in sweep.items())[:5]
            for key in ("cublas_us", "gemv_us"):
                row[key.replace("_us", "_tbps")] = nbytes / row[key] / 1e6
            results["shapes"].append(row)
            print(f"{model:3} {name:8} cublas {row['cublas_us']:7.1f} us {row['cublas_tbps']:.2f} TB/s | "
                  f"gemv {row['gemv_us']:7.1f} us {row['gemv_tbps']:.2f} TB/s | err {row['gemv_max_err']:.3g}"
                  + (f" | best {row['top5'][0]}" if args.sweep else ""), flush=True)
            del weights
            torch.cuda.empty_cache()
    (args.out / "skinny_gemm.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
