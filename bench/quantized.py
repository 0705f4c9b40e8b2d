"""fp8, int8 and int4 weight products against bf16 and each format's bytes floor, at decode and prefill row
counts, with sweeps of the few-row kernels' tiles. A few minutes on the 8b shapes.

    python -m bench quantized --out $OUT [--rows 1 8 32 64 4096] [--models 8b] [--formats ...] [--sweep]

  bf16        cuBLAS (torch.mm); at 1 row the Triton GEMV behind graphkiln::linear; from 2 to 64 rows on sm90+ the
              TMA-fed kernel of tma_products.py on the 16-bit weight (tma, where graphkiln::linear sends the weights
              of at least 2048 rows); the LM head in bf16 only, as every format keeps it; for gate_up, that kernel
              and the SiLU-and-mul launch after it (tma_silu_mul, what runs) against the activation in its
              epilogue (tma_activated)
  fp8         fp8_linear with per-channel scales (what it picks), and each candidate: the one-row GEMV,
              the fp8 tensor-core kernel quantizing x in registers (mma) or, above FEW_ROWS rows, multiplying x
              quantized per token by a kernel before it (mma_quantized), from 2 to 64 rows on sm90+ the TMA-fed
              kernel on x quantized per token (tma_quantized, what fp8_linear picks there), per-token quantization +
              torch._scaled_mm (rowwise); above 64 rows also that product alone on x quantized before
              (scaled_mm_only) and with one scale per tensor on each side (scaled_mm_tensor)
  fp8-block   the same with 128 x 128 block scales; candidates: the GEMV, the mma kernel, 1 x 128
              quantization + block-scaled _scaled_mm (where this torch has it), dequantize + torch.mm
  int8        int8_linear W8A8 (per-channel scales, x quantized per token; what it picks), and each candidate:
              the one-row GEMV, the int8 tensor-core kernel quantizing x in registers (mma) or, above FEW_ROWS rows,
              multiplying x quantized per token by a kernel before it (mma_quantized), per-token quantization +
              torch._int_mm and the scaling kernel (int_mm), above 64 rows that product alone on x quantized
              before (int_mm_only)
  int8-w8a16  int8_linear W8A16 (x as it is); candidates: the GEMV, the mma kernel on the weight converted to x's
              dtype, dequantize + torch.mm; int8-w8a16-groups the same with a scale per 128 inputs (8-bit GPTQ)
  int4        int4_linear (groups of 128, what it picks with the layers' tinygemm layout), the same after
              gathering x in a shuffled order as an act-order checkpoint's layers do (act_order), and each
              candidate: torch's tinygemm (aten._weight_int4pack_mm, torchao's int4 layout on CUDA), the word
              kernel (word_dot: the weight read as int32 words, on tensor cores from 2 rows), the dp4a GEMV at 1
              row (dp4a_gemv, int4_dp4a.py), the byte kernels (the GEMV at 1 row, the tiled mm_kernel),
              dequantize + mm
  --quality   instead: each format's logits against the unquantized model's and the tiny model's held-out
              perplexity per format (bench/quality.py)
  --sweep     fp8, fp8-block: at 1 row every GEMV tiling of SWEEP_GEMV, at 2 to 64 rows every tiling of SWEEP_MMA
              (above FEW_ROWS rows on x quantized first, as mma_quantized), or for fp8 on sm90+ every tiling of
              SWEEP_TMA (the TMA-fed kernel, as tma_quantized); bf16 on sm90+: SWEEP_TMA's tilings of tma_product
              at 2 to 64 rows, steps of the same bytes; the int8 formats: the same tilings,
              as int8_linear runs them (W8A16 converting the weight at every row count);
              int4: every tiling of SWEEP_DP4A (the dp4a GEMV) at 1 row, of SWEEP_WORD_DOT at 2 to 64 rows, of
              SWEEP_MM (the byte kernel, which int4_linear leaves to dequantize + mm there) at 65 to 256; each
              with every split of K in SPLITS (bench/quantized_sweep.py). The five fastest, the rule's own tiles (`*_tiling`) and its time are kept per shape and row count
              (quantized-sweep-<formats>.json), and the best per shape printed at the end, one line each

The floor of a format is its weight bytes (with scales and zero points) and the activation and output
bytes, over the copy rate measured in the same run. Each product is timed inside a CUDA graph that
cycles over enough weight copies (600 MiB) that every call reads its weight from memory. On the CPU
(--smoke) only bf16 torch.mm runs: the quantized kernels need CUDA.
"""

from __future__ import annotations

import argparse

from .common import Study, add_study_arguments, log
from .measure import copy_rate
from .models import projections
from .products import per_call_us
from .quantized_sweep import (
    GROUP,
    blockwise_scaled_mm,
    int8_quantized_mma,
    quantized_mma,
    quantized_tma,
    rowwise_scaled_mm,
    sweep,
    sweep_summary,
    swept,
)
from .report import text_table

FORMATS = ("fp8", "fp8-block", "int8", "int8-w8a16", "int8-w8a16-groups", "int4")
def weight_bytes(fmt: str, n: int, k: int) -> int:
    if fmt == "bf16":
        return 2 * n * k
    if fmt in ("fp8", "int8", "int8-w8a16"):
        return n * k + 4 * n
    if fmt == "int8-w8a16-groups":
        return n * k + 4 * n * -(-k // GROUP)
    if fmt == "fp8-block":
        return n * k + 4 * -(-n // 128) * -(-k // 128)
    return n * k // 2 + 2 * 2 * n * (k // GROUP)  # int4: bf16 scales and zero points


def make_weights(fmt: str, n: int, k: int, copies: int, device: str) -> list:
    """`copies` random weights in the format, as the arguments after x of its product."""
    import torch

    def one():
        if fmt == "bf16":
            return (torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02,)
        if fmt.startswith("int8"):
            shape = (n, -(-k // GROUP)) if fmt.endswith("groups") else (n,)
            weight = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
            return weight, torch.rand(shape, device=device) * 1e-3
        if fmt.startswith("fp8"):
            w = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            shape = (-(-n // 128), -(-k // 128)) if fmt == "fp8-block" else (n,)
            return w, torch.rand(shape, device=device) * 1e-3 + 1e-4
        q = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8)
        scales = (torch.rand(n, k // GROUP, device=device) * 1e-3).to(torch.bfloat16)
        zeros = torch.full((n, k // GROUP), 8.0, device=device, dtype=torch.bfloat16)
        return q, scales, zeros

    return [one() for _ in range(copies)]


def tinygemm_weights(weights: list) -> dict:
    """id(qweight) -> the weight in tinygemm's layout (quantized_linear.tinygemm_layout: what int4 layers keep
    on CUDA in bfloat16) for each int4 copy; empty where its kernel does not apply."""
    from graphkiln.models.quantized_linear import tinygemm_inner_k_tiles, tinygemm_layout

    packed = {}
    for q, scales, zeros in weights:
        tiles = tinygemm_inner_k_tiles(q, scales, GROUP)
        if tiles is None:
            return {}
        packed[id(q)] = tinygemm_layout(q, scales, zeros, GROUP, tiles)
    return packed


def candidates(fmt: str, x, rows: int, tinygemm: dict | None = None, projection: str = "") -> dict:
    """name -> fn(weight args) of every product of this format timed at this row count (of `projection`)."""
    import torch

    if fmt == "bf16":
        out = {"cublas": lambda w: torch.mm(x, w.t())}
        if x.is_cuda:  # triton is optional: our kernels only where they run
            from graphkiln.kernels.gemv import gemv, silu_mul
            from graphkiln.kernels.tma_products import TMA_ROWS, has_tma, tma_product

            if rows == 1:
                out["gemv"] = lambda w: gemv(x, w)
            if 1 < rows <= TMA_ROWS and has_tma(x.device):
                out["tma"] = lambda w: tma_product(x, w)
                if projection == "gate_up":  # with the MLP's activation: a launch after, or in the epilogue
                    out["tma_silu_mul"] = lambda w: silu_mul(tma_product(x, w))
                    out["tma_activated"] = lambda w: tma_product(x, w, activated=True)
        return out
    if fmt.startswith("int8"):
        return int8_candidates(fmt, x, rows)
    if fmt.startswith("fp8"):
        from graphkiln.kernels import fp8_linear as f
        from graphkiln.kernels.fp8_mma import fp8_mma
        from graphkiln.kernels.tma_products import has_tma

        out = {"picked": lambda w, s: f.fp8_linear(x, w, s)}
        if rows == 1:
            out["gemv"] = lambda w, s: f.fp8_gemv(x, w, s)
        if rows <= 256:
            out["mma"] = lambda w, s: fp8_mma(x, w, s)
        if f.FEW_ROWS < rows <= 256:
            out["mma_quantized"] = lambda w, s: quantized_mma(x, w, s)
        if fmt == "fp8" and 1 < rows <= f.MMA_ROWS and has_tma(x.device):
            out["tma_quantized"] = lambda w, s: quantized_tma(x, w, s)
        if fmt == "fp8":
            out["scaled_mm"] = lambda w, s: rowwise_scaled_mm(x, w, s)
            if rows > f.MMA_ROWS:  # the product alone, on x quantized before the timing
                q, scale_a = f.quantize_rows(x)
                unit = torch.ones((), device=x.device)
                out["scaled_mm_only"] = lambda w, s: f.scaled_mm(q, w.t(), scale_a, s.view(1, -1), x.dtype)
                out["scaled_mm_tensor"] = lambda w, s: f.scaled_mm(q, w.t(), unit, unit, x.dtype)
        else:
            if rows > f.FEW_ROWS and f.blockwise_scaled_mm(x.device.index or 0):  # as fp8_linear uses it
                out["scaled_mm"] = lambda w, s: blockwise_scaled_mm(x, w, s)
            out["dequant_mm"] = lambda w, s: torch.mm(x, f.dequantize(w, s, x.dtype).t())
        return out
    from graphkiln.kernels import int4_linear as i4
    from graphkiln.kernels import int4_words as w4
    from graphkiln.kernels.int4_dp4a import int4_dp4a_gemv

    layout = tinygemm or {}
    order = torch.randperm(x.shape[1], device=x.device)  # an act-order checkpoint's gather of x
    out = {"picked": lambda q, s, z: i4.int4_linear(x, q, s, z, GROUP, *layout.get(id(q), ())),
           "act_order": lambda q, s, z: i4.int4_linear(x.index_select(-1, order), q, s, z, GROUP,
                                                       *layout.get(id(q), ()))}
    if 2 <= rows <= 256:
        out["word_dot"] = lambda q, s, z: w4.int4_dot(x, w4.words(q), s, z, GROUP)
    if rows == 1:
        out["gemv"] = lambda q, s, z: i4.int4_gemv(x, q, s, z, GROUP)
        out["dp4a_gemv"] = lambda q, s, z: int4_dp4a_gemv(x, w4.words(q), s, z, GROUP)
    out["mm_kernel"] = lambda q, s, z: i4.int4_mm(x, q, s, z, GROUP)
    out["dequant_mm"] = lambda q, s, z: torch.mm(x, i4.dequantize(q, s, z, GROUP, x.dtype).t())
    if tinygemm:
        def tiny(q, s, z):
            packed, scales_and_zeros = tinygemm[id(q)]
            return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scales_and_zeros)

        out["tinygemm"] = tiny
    return out


def int8_candidates(fmt: str, x, rows: int) -> dict:
    """name -> fn(weight, scale) of every int8 product timed at this row count (W8A8, or W8A16 for int8-w8a16 and
    int8-w8a16-groups; `scale_rows` 1 reads group scales, and is ignored by per-channel ones)."""
    import torch

    from graphkiln.kernels import fp8_linear as f
    from graphkiln.kernels import int8_linear as i8
    from graphkiln.kernels.fp8_mma import fp8_mma

    w8a8 = fmt == "int8"
    out = {"picked": lambda w, s: i8.int8_linear(x, w, s, quantize_input=w8a8)}
    if rows == 1:
        out["gemv"] = lambda w, s: f.fp8_gemv(x, w, s, scale_rows=1)
    if rows <= 256:
        out["mma"] = lambda w, s: fp8_mma(x, w, s, weight_to_x=not w8a8, scale_rows=1)
    if not w8a8:
        out["dequant_mm"] = lambda w, s: torch.mm(x, f.dequantize(w, s, x.dtype, scale_rows=1).t())
        return out
    if f.FEW_ROWS < rows <= 256:
        out["mma_quantized"] = lambda w, s: int8_quantized_mma(x, w, s)
    if rows > 16:  # what torch._int_mm takes (the projections' N and K are multiples of 8)
        out["int_mm"] = lambda w, s: i8.scaled_int_mm(*f.quantize_rows(x, dtype=torch.int8), w, s, x.dtype)
        if rows > f.MMA_ROWS:  # the product alone, on x quantized before the timing
            q, scale_a = f.quantize_rows(x, dtype=torch.int8)
            out["int_mm_only"] = lambda w, s: torch._int_mm(q, w.t())
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p, model="8b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 4096],
                   help="rows of x (default 1 8 32 64 4096)")
    p.add_argument("--models", nargs="+", default=["8b"], help="whose weight shapes (default 8b)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=("bf16", *FORMATS),
                   help="quantized formats (default all; bf16 alone: only the 16-bit products, always measured)")
    p.add_argument("--sweep", action="store_true", help="tilings of the few-row kernels at 1 to 64 rows (GPU)")
    p.add_argument("--quality", action="store_true",
                   help="logits of each format against the unquantized model over 64 prompts, and the tiny model's "
                        "held-out perplexity per format (bench/quality.py), instead of the products")


def main(a: argparse.Namespace) -> int:
    import torch

    if a.quality:
        from .quality import main as quality

        return quality(a)
    study = Study.of("quantized", a)
    device = study.device
    models, row_counts = (["smoke"], [1, 8]) if study.smoke else (a.models, a.rows)
    formats = ["bf16"] + ([f for f in a.formats if f != "bf16"] if study.cuda else [])
    if not study.cuda:
        log("CPU smoke: bf16 torch.mm only; the fp8 and int4 kernels need CUDA")
    kernel_errors: tuple = ()
    if study.cuda:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        kernel_errors = (CompilationError, OutOfResources, RuntimeError)  # RuntimeError: a failed compiler pass
    torch.manual_seed(0)
    rate = copy_rate(device, (64 << 20) if study.smoke else (1 << 30))
    results: dict = {"copy_Bps": rate, "group_size": GROUP, "shapes": []}
    log(f"copy {rate / 1e12:.3f} TB/s")
    suffix = ("sweep-" + "-".join(a.formats)) if a.sweep else ""
    for model in models:
        for name, (n, k) in projections(model).items():
            for fmt in formats if name != "lm_head" else ["bf16"]:  # every format keeps the LM head in bf16
                nbytes = weight_bytes(fmt, n, k)
                copies = max(2, -(-(600 << 20) // nbytes)) if study.cuda else 2
                weights = make_weights(fmt, n, k, copies, device)
                tinygemm = tinygemm_weights(weights) if fmt == "int4" else None
                calls = max(copies, 24)
                for m in row_counts:
                    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                    floor_us = (nbytes + 2 * m * (n + k)) / rate * 1e6
                    row = {"model": model, "name": name, "format": fmt, "m": m, "n": n, "k": k, "floor_us": floor_us}
                    for variant, fn in candidates(fmt, x, m, tinygemm, name).items():
                        try:
                            us = per_call_us(lambda w, fn=fn: fn(*w), weights, calls, device)
                        except kernel_errors as e:  # one kernel that does not build leaves the others measured
                            row[f"{variant}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                            log(f"{name} {fmt} m={m} {variant}: {row[f'{variant}_error']}")
                            continue
                        row[f"{variant}_us"], row[f"{variant}_of_floor"] = us, floor_us / us
                    if a.sweep and study.cuda and swept(fmt, x, weights):
                        row["sweep"] = sweep(fmt.removesuffix("-block"), x, m, weights, calls)
                    results["shapes"].append(row)
                    log(f"{model:5} {name:8} {fmt:9} m={m:<5} floor {floor_us:8.1f} us | " + " | ".join(
                        f"{v.removesuffix('_us')} {row[v]:8.1f} us ({row[v.replace('_us', '_of_floor')]:.0%})"
                        for v in row if v.endswith("_us") and v != "floor_us"))
                    if "sweep" in row:
                        log(sweep_summary([row]))
                study.save(results, suffix)  # after every weight: a run stopped early keeps what it measured
                del weights, tinygemm
                if study.cuda:
                    torch.cuda.empty_cache()
    columns = ["model", "name", "format", "m", "floor_us"] + sorted(
        {k for r in results["shapes"] for k in r if k.endswith("_us")} - {"floor_us"})
    print(text_table(results["shapes"], columns))
    if a.sweep:
        print(sweep_summary(results["shapes"]))
    log(f"wrote {study.save(results, suffix)}")
    return 0
