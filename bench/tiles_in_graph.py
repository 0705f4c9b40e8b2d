"""GEMV tilings and decode-attention tiles tried inside the real decode graph (one device call, ~4 min, 1B).

`bench/skinny_gemm.py --sweep` times each tiling back to back against itself; in the model every
GEMV follows a norm, rope or attention kernel and ramps up on its own, so the fastest tiling
there need not be the fastest in place. This compiles the bench's random-weight model for decode
batch 1, then for each projection shape re-captures the decode graph with one candidate tiling
for that shape (the others at their defaults) and times graph replays with CUDA events. The
default is timed before and after each shape's candidates; a row's delta is against their mean.
Then the same for the Triton decode attention's tiles (splits, block_n, warps, stages) at each
context length asked for. Results go to $OUT after every sweep.

    python3 -P bench/tiles_in_graph.py --out $OUT [--model 8b --layers 4] [--contexts 128 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import build_model, replay_ms, step_times  # noqa: E402
from skinny_gemm import SHAPES  # noqa: E402

# Round 1 (bench/results/2026-11-29-nvidia-h200-tiles-in-graph-1b-round1.json) found longer K steps
# on fewer rows best in place; these are its winners and their neighbours.
THIN = [(4, 1024, 4, 3), (4, 1024, 4, 4), (4, 1024, 8, 3), (2, 1024, 4, 3), (4, 2048, 4, 2), (4, 2048, 8, 2),
        (2, 2048, 4, 2), (8, 1024, 8, 3), (8, 1024, 8, 4), (8, 1024, 4, 4), (8, 2048, 8, 2), (16, 1024, 8, 3)]
WIDE = [(16, 512, 4, 3), (16, 512, 4, 4), (16, 512, 8, 3), (8, 512, 4, 3), (8, 512, 4, 4), (8, 1024, 4, 3),
        (16, 1024, 8, 3), (32, 128, 4, 6), (32, 128, 4, 8), (16, 256, 4, 6), (32, 256, 8, 4)]  # gate_up, LM heads
ATTENTION = [(None, 32, 4, 3), (None, 64, 2, 3), (None, 32, 2, 2), (None, 64, 8, 3), (None, 16, 2, 2),
             (4, 64, 4, 3), (8, 64, 4, 3), (16, 64, 4, 3)]  # (splits or the planned ones, block_n, warps, stages)


def replay_with(graphs, module, attribute: str, replacement) -> float:
    """Replay time of the batch-1 greedy decode graph re-captured with `module.attribute` replaced."""
    original = getattr(module, attribute)
    setattr(module, attribute, replacement)
    try:
        graphs.capture()
    finally:
        setattr(module, attribute, original)
    return replay_ms(graphs.graphs[1, "greedy"][0], replays=200, repeats=5)


def sweep(label: str, candidates: list, measure) -> list[dict]:
    """measure(candidate) for each candidate and measure(None) (the default) before and after them."""
    before = measure(None)
    timed = [(c, measure(c)) for c in candidates]
    base = (before + measure(None)) / 2
    print(f"{label}: default {base:.4f} ms; " + ", ".join(f"{c}:{(ms - base) * 1e3:+.1f} us" for c, ms in timed),
          flush=True)
    return [{"what": label, "tiles": c, "replay_ms": ms, "delta_us": (ms - base) * 1e3}
            for c, ms in sorted(timed, key=lambda t: t[1])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128],
                        help="prompt lengths the attention tiles are tried at (the GEMVs at the first)")
    args = parser.parse_args()
    import graphkiln
    from graphkiln import CompileConfig
    from graphkiln.kernels import gemv as gemv_kernel
    from graphkiln.runtime.attention import triton_backend

    work = Path(tempfile.mkdtemp())
    build_model(work / "model", args.layers, args.model)
    config = CompileConfig(device="cuda", dtype="bfloat16", decode_batch_sizes=(1,), prefill_token_buckets=(128,))
    graphkiln.compile_model(work / "model", work / "art", config)
    llm = graphkiln.load(work / "art", kv_cache_tokens=65536)
    step_times(llm, 1, 10, args.contexts[0])  # a context in the cache, the graph's buffers holding its last step
    graphs = llm.engine.runner.graphs
    tiling, decode_tiles = gemv_kernel.tiling, triton_backend.decode_tiles

    def gemv_tiles(shape: tuple[int, int]):
        def measure(tiles):
            chosen = (lambda n, k: tiles if (n, k) == shape else tiling(n, k)) if tiles else tiling
            return replay_with(graphs, gemv_kernel, "tiling", chosen)
        return measure

    def attention_tiles(tiles):
        def chosen(*plan_args):
            planned = decode_tiles(*plan_args)
            splits, *rest = tiles
            return triton_backend.DecodeTiles(splits or planned.num_splits, *rest)
        return replay_with(graphs, triton_backend, "decode_tiles", chosen if tiles else decode_tiles)

    rows = []
    out = args.out / f"tiles_in_graph_{args.model}.json"
    args.out.mkdir(parents=True, exist_ok=True)

    def record(new_rows: list[dict]) -> None:  # after every sweep: a run cut short keeps what it measured
        rows.extend(new_rows)
        out.write_text(json.dumps({"model": args.model, "layers": args.layers, "rows": rows}, indent=1))

    for name, shape in SHAPES[args.model].items():
        candidates = [t for t in (THIN if shape[0] <= 8192 else WIDE) if t != tiling(*shape)]
        record(sweep(f"{name} {shape} (default {tiling(*shape)})", candidates, gemv_tiles(shape)))
    for context in args.contexts:
        if context != args.contexts[0]:
            step_times(llm, 1, 10, context)
        record(sweep(f"decode attention at {context} tokens (planned tiles)", ATTENTION, attention_tiles))


if __name__ == "__main__":
    main()
