"""GEMV tilings tried inside the real decode graph: one device call, about three minutes for the 1B model.

`bench/skinny_gemm.py --sweep` times each tiling back to back against itself; in the model every
GEMV follows a norm, rope or attention kernel and ramps up on its own, so the fastest tiling
there need not be the fastest in place. This compiles the bench's random-weight model for decode
batch 1, then for each projection shape re-captures the decode graph with one candidate tiling
for that shape (the others at their defaults) and times graph replays with CUDA events. The
default is timed before and after each shape's candidates; a row's delta is against their mean.

    python3 -P bench/tiles_in_graph.py --out $OUT [--model 8b --layers 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import build_model, step_times  # noqa: E402
from skinny_gemm import SHAPES  # noqa: E402

THIN = [(4, 512, 4, 3), (4, 1024, 4, 3), (8, 256, 4, 4), (8, 512, 4, 4), (8, 512, 8, 3), (8, 1024, 4, 3),
        (8, 1024, 8, 3), (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 3)]  # N of a few thousand rows
WIDE = [(16, 256, 4, 5), (32, 256, 4, 5), (32, 256, 4, 3), (16, 512, 4, 3), (32, 128, 4, 6), (64, 128, 4, 5),
        (16, 256, 8, 4), (32, 512, 8, 3)]  # gate_up and LM heads


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 200, repeats: int = 5) -> float:
    """Median over `repeats` of the mean replay time of `replays` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    import graphkiln
    from graphkiln import CompileConfig
    from graphkiln.models import gemv_kernel

    work = Path(tempfile.mkdtemp())
    build_model(work / "model", args.layers, args.model)
    config = CompileConfig(device="cuda", dtype="bfloat16", decode_batch_sizes=(1,), prefill_token_buckets=(128,))
    graphkiln.compile_model(work / "model", work / "art", config)
    llm = graphkiln.load(work / "art", kv_cache_tokens=65536)
    step_times(llm, 1, 10)  # a 128-token context in the cache, the graph's buffers holding its last step
    graphs = llm.engine.runner.graphs
    default_tiling = gemv_kernel.tiling

    def measure(shape: tuple[int, int], tiles: tuple[int, int, int, int] | None) -> float:
        gemv_kernel.tiling = lambda n, k: tiles if tiles and (n, k) == shape else default_tiling(n, k)
        try:
            graphs.capture()
        finally:
            gemv_kernel.tiling = default_tiling
        return replay_ms(graphs.graphs[1, "greedy"][0])

    rows = []
    for name, shape in SHAPES[args.model].items():
        candidates = THIN if shape[0] <= 8192 else WIDE
        before = measure(shape, None)
        timed = [(tiles, measure(shape, tiles)) for tiles in candidates if tiles != default_tiling(*shape)]
        base = (before + measure(shape, None)) / 2
        for tiles, ms in sorted(timed, key=lambda t: t[1]):
            rows.append({"shape": name, "n": shape[0], "k": shape[1], "tiles": tiles, "replay_ms": ms,
                         "delta_us": (ms - base) * 1e3})
        best = min(timed, key=lambda t: t[1])
        print(f"{name:8} {shape}: default {default_tiling(*shape)} {base:.4f} ms; best {best[0]} "
              f"{(best[1] - base) * 1e3:+.1f} us; " + ", ".join(f"{t}:{(ms - base) * 1e3:+.1f}" for t, ms in timed),
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"tiles_in_graph_{args.model}.json").write_text(json.dumps(
        {"model": args.model, "layers": args.layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
