"""GEMV tilings tried inside the real decode graph, one weight shape at a time (a few minutes, 1B).

    python -m bench tiles --out $OUT [--model 8b --layers 4] [--context 128] [--quantization fp8]

`python -m bench products --sweep` times each tiling back to back against itself; in the model
every GEMV follows a norm, rope or attention kernel and ramps up on its own, so the fastest tiling
there need not be the fastest in place (`graphkiln.kernels.gemv.tiling` is chosen from this). The
model is compiled for decode batch 1; per projection shape, each candidate tiling is set for that
shape alone, `Engine.recapture()` captures the graphs again, and the batch-1 greedy graph's
replays are timed (CUDA events). The default is timed before and after each shape's candidates; a
row's delta is against their mean. The JSON is rewritten after every shape.

The tiling reaches the kernel through a CUDA kernel registered for graphkiln's three product ops
with `torch.library` (`register_kernel`, torch's documented way to add a device's implementation):
it runs what the ops run, passing the tiling for the chosen shape; graphkiln's modules are not
touched. With `--quantization fp8` the decoder's projections are graphkiln::fp8_linear and
fp8_linear_silu_mul, whose one-row GEMV (`fp8_linear.fp8_gemv`) takes the tilings of FP8_THIN and FP8_WIDE
instead, among them steps as long as K, whose whole slab a program loads before it waits on the kernel
before it (programmatic dependent launch); the LM head stays bf16. On the CPU (--smoke) the sweep's loop runs with engine steps timed instead of replays
(no CUDA graphs, no GEMV there), so its numbers mean nothing.
"""

from __future__ import annotations

import argparse

from .common import Study, add_study_arguments, log
from .measure import time_ms
from .models import compiled_llm, decode_timer, decoding, projections

# Round 1 on the H200 found longer K steps on fewer rows best in place; these are its winners and their neighbours.
THIN = [(4, 1024, 4, 3), (4, 1024, 4, 4), (4, 1024, 8, 3), (2, 1024, 4, 3), (4, 2048, 4, 2), (4, 2048, 8, 2),
        (2, 2048, 4, 2), (8, 1024, 8, 3), (8, 1024, 8, 4), (8, 1024, 4, 4), (8, 2048, 8, 2), (16, 1024, 8, 3)]
WIDE = [(16, 512, 4, 3), (16, 512, 4, 4), (16, 512, 8, 3), (8, 512, 4, 3), (8, 512, 4, 4), (8, 1024, 4, 3),
        (16, 1024, 8, 3), (32, 128, 4, 6), (32, 128, 4, 8), (16, 256, 4, 6), (32, 256, 8, 4)]  # gate_up, LM heads
# fp8 one-row GEMV tilings (BLOCK_N, BLOCK_K, splits, warps, stages): the sweep's neighbours of the rule's, and
# K steps of 4096 (all of K for qkv and o: the slab loaded while attention or rope still runs).
FP8_THIN = [(8, 4096, 1, 8, 1), (16, 4096, 1, 8, 1), (4, 4096, 1, 4, 1), (16, 4096, 1, 16, 1), (8, 2048, 1, 8, 2),
            (16, 2048, 1, 8, 2), (8, 1024, 1, 4, 3), (16, 1024, 1, 8, 3), (8, 2048, 2, 8, 2)]
FP8_WIDE = [(8, 1024, 1, 4, 4), (16, 1024, 1, 4, 4), (8, 2048, 1, 4, 2), (16, 512, 1, 4, 4), (32, 512, 1, 8, 3),
            (8, 512, 1, 4, 6)]


class TilingForOneShape:
    """graphkiln::linear, graphkiln::silu_mul_linear and graphkiln::linear_silu_mul on CUDA, with `tiles` for
    weights of `shape` (N, K) and the kernel's own tiling for the others."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None
        self.tiles: tuple[int, int, int, int] | None = None

    def chosen(self, weight) -> tuple[int, int, int, int] | None:
        return self.tiles if tuple(weight.shape) == self.shape else None

    def register(self) -> None:
        import torch

        from graphkiln.kernels.gemv import gemv, silu_mul
        from graphkiln.models import linear as ops

        def linear(x, weight):
            return gemv(x, weight, tiles=self.chosen(weight)) if ops.uses_gemv(x, weight) else torch.mm(x, weight.t())

        def silu_mul_linear(gate_up, weight):
            if gate_up.shape[0] == 1 and ops.on_triton(gate_up, weight):
                return gemv(gate_up, weight, gated=True, tiles=self.chosen(weight))
            return torch.mm(silu_mul(gate_up), weight.t())  # what the op runs on CUDA at more rows

        def linear_silu_mul(x, weight):
            if x.shape[0] == 1 and ops.on_triton(x, weight):
                return gemv(x, weight, activated=True, tiles=self.chosen(weight))
            return silu_mul(torch.mm(x, weight.t()))  # what the op runs on CUDA at more rows

        ops.linear.register_kernel("cuda", linear)
        ops.silu_mul_linear.register_kernel("cuda", silu_mul_linear)
        ops.linear_silu_mul.register_kernel("cuda", linear_silu_mul)

    def register_fp8(self) -> None:
        from graphkiln.kernels import fp8_linear as f
        from graphkiln.models import quantized_linear as ops

        def product(activated: bool):
            def run(x, weight, weight_scale, input_scale):
                if x.shape[0] == 1 and x.stride(1) == 1:
                    return f.fp8_gemv(x, weight, weight_scale.contiguous(), tiles=self.chosen(weight),
                                      activated=activated)
                return f.fp8_linear(x, weight, weight_scale, input_scale, activated=activated)

            return run

        ops.fp8_linear.register_kernel("cuda", product(False))
        ops.fp8_linear_silu_mul.register_kernel("cuda", product(True))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p)
    p.add_argument("--context", type=int, default=128, help="prompt tokens in the cache while replaying")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="compile with fp8 weights: the fp8 GEMV's tilings are tried (the LM head's bf16 ones)")


def main(a: argparse.Namespace) -> int:
    study = Study.of("tiles", a)
    fp8 = a.quantization == "fp8"
    if study.cuda:
        from graphkiln.kernels.fp8_linear import gemv_tiling
        from graphkiln.kernels.gemv import tiling
        from graphkiln.kernels.split_k import multiprocessors

        def default_tiles(name: str, n: int, k: int) -> tuple:
            if fp8 and name != "lm_head":
                return gemv_tiling(n, k, multiprocessors(study.device))
            return tiling(n, k, activated=name == "gate_up")  # its GEMV applies the activation
    else:
        log("CPU smoke: no CUDA graphs and no GEMV (Triton) on the CPU; the sweep's loop runs on engine steps")

        def default_tiles(name: str, n: int, k: int) -> None:
            return None

    with study.scratch() as work:
        llm = compiled_llm(study, work, compile_options={"quantization": a.quantization}, decode_batch_sizes=(1,),
                           prefill_token_buckets=(128,), kv_cache_tokens=4096 if study.smoke else 65536)
        decoding(llm, 1, 1000, 16 if study.smoke else a.context)  # a context in the cache; the graph's buffers hold it
        override = TilingForOneShape()
        if study.cuda:
            override.register()
            if fp8:
                override.register_fp8()
        reps, calls = (3, 2) if study.smoke else (5, 200)

        def replay_ms(shape, tiles) -> float | None:
            """The replay time with `tiles` for `shape`; None where they do not fit the GPU (Triton raises
            at the warm-up call before the capture)."""
            override.shape, override.tiles = shape, tiles
            try:
                llm.engine.recapture()
            except Exception as e:  # noqa: BLE001  (triton.runtime.errors.OutOfResources)
                if type(e).__name__ != "OutOfResources":
                    raise
                return None
            return time_ms(decode_timer(llm, 1, study.cuda), study.device, reps=reps, calls=calls).median_ms

        rows = []
        for name, shape in projections(study.model).items():
            default = default_tiles(name, *shape)
            thin, wide = (FP8_THIN, FP8_WIDE) if fp8 and name != "lm_head" else (THIN, WIDE)
            candidates = [t for t in (thin if shape[0] <= 8192 else wide) if t != default][: 2 if study.smoke else None]
            before = replay_ms(shape, None)
            timed = [(t, ms) for t in candidates if (ms := replay_ms(shape, t)) is not None]
            base = (before + replay_ms(shape, None)) / 2
            log(f"{name} {shape} (default {default}): {base:.4f} ms; "
                + ", ".join(f"{t}: {(ms - base) * 1e3:+.1f} us" for t, ms in timed))
            rows += [{"what": name, "shape": shape, "default": default, "tiles": t, "replay_ms": ms,
                      "delta_us": (ms - base) * 1e3} for t, ms in sorted(timed, key=lambda r: r[1])]
            study.save({"context": a.context, "quantization": a.quantization, "rows": rows})  # kept if cut short
        log(f"wrote {study.save({'context': a.context, 'quantization': a.quantization, 'rows': rows})}")
        llm.close()
    return 0
