"""The few-row kernels' tilings `python -m bench quantized --sweep` tries (bench/quantized.py has the study):
each format's kernel at a row count with given tiles, the tiles its rule picks, and the fastest found.

The products on x quantized before the kernel (`quantized_mma`, `quantized_tma`, `int8_quantized_mma`, the
per-token and block-scaled torch._scaled_mm) live here too: the sweep and the study's candidates both call them."""

from __future__ import annotations

from .products import per_call_us

GROUP = 128  # the int4 weights' group
SPLITS = (1, 2, 4, 8)  # K splits tried with every tiling (split K is a run-time argument: no extra compiles)
# (BLOCK_N, BLOCK_K, warps, stages) of the fp8 GEMV (either scale layout) tried at 1 row; one stage: loads not pipelined
SWEEP_GEMV = [(n, k, 4, 4) for n in (8, 16, 32) for k in (512, 1024, 2048)] + [(n, 1024, 4, 1) for n in (8, 16, 32)]
SWEEP_GEMV += [(n, k, 8, stages) for n in (8, 16) for k, stages in ((1024, 3), (2048, 2))]
# (BLOCK_N, BLOCK_K, warps, stages) of the int4 dp4a GEMV tried at 1 row
SWEEP_DP4A = [(n, k, 4, stages) for n in (8, 16, 32) for k in (512, 1024, 2048) for stages in (3, 4)]
SWEEP_DP4A += [(n, k, 8, 2) for n in (16, 32) for k in (1024, 2048)]
# (BLOCK_N, warps, stages) of int4_dot tried at 2 to 64 rows; BLOCK_M: the rows up to a power of two (16 to 64),
# BLOCK_K: 128 (a dot's 16 words)
SWEEP_WORD_DOT = [(n, warps, 4) for n in (32, 64, 128) for warps in (4, 8)]
# (BLOCK_M, BLOCK_N, BLOCK_K, swap_ab, warps, stages) of the int4 byte kernel (int4_mm) tried above 64 rows;
# BLOCK_K divides the group; swapped, the dequantized weight tile is the dot's left operand, kept in registers
SWEEP_MM = [(m, n, k, False, warps, stages) for m in (64, 128) for n, k, warps, stages in
            ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 8, 4), (128, 64, 4, 4))]
SWEEP_MM += [(m, n, k, True, warps, stages) for m, n, k, warps, stages in
             ((64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (128, 128, 64, 8, 4),
              (128, 128, 128, 4, 3), (64, 128, 64, 4, 4), (128, 64, 128, 4, 3), (64, 256, 64, 8, 3),
              (128, 256, 64, 8, 3), (256, 128, 64, 8, 3))]
# (BLOCK_N, BLOCK_K, warps, stages) of the fp8 tensor-core kernel (fp8_mma.py) tried at 2 to 64 rows
SWEEP_MMA = [(n, k, warps, stages) for n in (64, 128) for k in (64, 128) for warps, stages in ((4, 3), (4, 5), (8, 4))]
SWEEP_MMA += [(256, 128, 8, stages) for stages in (3, 4)]
# (BLOCK_N, BLOCK_K, splits, warps, stages) of the TMA-fed fp8 kernel (tma_products.py) tried at 2 to 64 rows on sm90+
SWEEP_TMA = [(n, k, 1, 4, stages) for n in (32, 64, 128) for k in (128, 256, 512) for stages in (3, 4, 6, 8)]
SWEEP_TMA += [(n, 256, splits, 4, stages) for n in (32, 64) for splits in (2, 4) for stages in (4, 6)]


def int8_quantized_mma(x, weight, scale, tiles=None):
    """x quantized to int8 per token, then fp8_mma on the int8 rows: what int8_linear runs (W8A8) from FEW_ROWS + 1
    to MMA_ROWS rows."""
    import torch

    from graphkiln.kernels.fp8_linear import quantize_rows
    from graphkiln.kernels.fp8_mma import fp8_mma

    q, scale_a = quantize_rows(x, dtype=torch.int8)
    return fp8_mma(q, weight, scale, tiles, x_scale=scale_a, out_dtype=x.dtype)


def quantized_mma(x, weight, scale, tiles=None):
    """x quantized as for torch._scaled_mm (per token, per 1 x 128 group for block scales), then fp8_mma on the
    fp8 rows: what fp8_linear runs from FEW_ROWS + 1 to MMA_ROWS rows."""
    from graphkiln.kernels.fp8_linear import BLOCK, quantize_rows
    from graphkiln.kernels.fp8_mma import fp8_mma

    q, scale_a = quantize_rows(x, BLOCK if scale.dim() == 2 else None)
    return fp8_mma(q, weight, scale, tiles, x_scale=scale_a, out_dtype=x.dtype)


def quantized_tma(x, weight, scale, tiles=None):
    """x quantized per token, then fp8_tma on the fp8 rows: what fp8_linear runs from 2 to MMA_ROWS rows where
    fp8_tma fits."""
    from graphkiln.kernels.fp8_linear import quantize_rows
    from graphkiln.kernels.tma_products import fp8_tma

    q, scale_a = quantize_rows(x)
    return fp8_tma(q, scale_a, weight, scale, x.dtype, tiles)


def takes_tma(fmt: str, x, weights: list) -> bool:
    """Whether this format's product of x's rows is swept on the TMA-fed kernel: fp8 where fp8_linear sends it
    there (sm90+, per-channel fp8), bf16 (tma_product, the candidate) from 2 to TMA_ROWS rows on sm90+."""
    from graphkiln.kernels.tma_products import TMA_ROWS, has_tma, tma_fits

    if fmt == "bf16":
        return 1 < x.shape[0] <= TMA_ROWS and has_tma(x.device)
    return fmt == "fp8" and x.shape[0] > 1 and tma_fits(x, *weights[0])


def rowwise_scaled_mm(x, weight, scale):
    """Per-token fp8 x times the per-channel fp8 weight in torch._scaled_mm, whatever the row count."""
    from graphkiln.kernels.fp8_linear import quantize_rows, scaled_mm

    q, scale_a = quantize_rows(x)
    return scaled_mm(q, weight.t(), scale_a, scale.view(1, -1), x.dtype)


def blockwise_scaled_mm(x, weight, scale):
    """1 x 128-group fp8 x times the 128 x 128-block fp8 weight in torch._scaled_mm."""
    from graphkiln.kernels.fp8_linear import BLOCK, quantize_rows, scaled_mm

    q, scale_a = quantize_rows(x, BLOCK)
    return scaled_mm(q, weight.t(), scale_a, scale.t(), x.dtype)


def sweep_tilings(fmt: str, rows: int) -> list[tuple]:
    """Every tiling the sweep tries for this format at this row count, in the form its kernel's `tiles` takes."""
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    if fmt == "int4" and rows > 64:
        return [(m, n, k, swap, split, warps, stages) for m, n, k, swap, warps, stages in SWEEP_MM for split in SPLITS]
    if fmt == "int4" and rows == 1:
        return [(n, k, split, warps, stages) for n, k, warps, stages in SWEEP_DP4A for split in SPLITS]
    if fmt == "int4":
        return [(block_m, n, 128, split, warps, stages) for n, warps, stages in SWEEP_WORD_DOT for split in SPLITS]
    if rows > 1:
        return [(block_m, n, k, split, warps, stages) for n, k, warps, stages in SWEEP_MMA for split in SPLITS]
    return [(n, k, split, warps, stages) for n, k, warps, stages in SWEEP_GEMV for split in SPLITS]


def swept(fmt: str, x, weights: list) -> bool:
    """Whether --sweep tries tilings of this format's kernel at x's row count (bf16: the TMA-fed candidate)."""
    rows = x.shape[0]
    if fmt == "bf16":
        return takes_tma(fmt, x, weights)
    if fmt == "int4":
        return rows <= 256
    return rows <= 64


def tiled(fmt: str, x, rows: int, tiles: tuple | None):
    """The few-row kernel of this format at this row count with `tiles` (None: its rule's), as fn(weight args)."""
    if fmt == "int4" and rows > 64:
        from graphkiln.kernels.int4_linear import int4_mm

        return lambda q, s, z: int4_mm(x, q, s, z, GROUP, tiles=tiles)
    if fmt == "int4":
        from graphkiln.kernels import int4_words as words
        from graphkiln.kernels.int4_dp4a import int4_dp4a_gemv

        if rows == 1:
            return lambda q, s, z: int4_dp4a_gemv(x, words.words(q), s, z, GROUP, tiles=tiles)
        return lambda q, s, z: words.int4_dot(x, words.words(q), s, z, GROUP, tiles=tiles)
    from graphkiln.kernels.fp8_linear import FEW_ROWS, fp8_gemv
    from graphkiln.kernels.fp8_mma import fp8_mma

    if fmt == "int8" and rows > FEW_ROWS:
        return lambda w, s: int8_quantized_mma(x, w, s, tiles)
    if fmt.startswith("int8"):  # scale_rows 1: int8's group scales (per-channel ones ignore it)
        if rows == 1:
            return lambda w, s: fp8_gemv(x, w, s, tiles=tiles, scale_rows=1)
        return lambda w, s: fp8_mma(x, w, s, tiles=tiles, weight_to_x=fmt != "int8", scale_rows=1)
    if rows > FEW_ROWS:
        return lambda w, s: quantized_mma(x, w, s, tiles)
    kernel = fp8_gemv if rows == 1 else fp8_mma
    return lambda w, s: kernel(x, w, s, tiles=tiles)


def rule_tiles(fmt: str, rows: int, n: int, k: int, device) -> tuple:
    """The tiles the kernels' rule picks for this shape."""
    from graphkiln.kernels import fp8_linear as f
    from graphkiln.kernels import int4_linear as i4
    from graphkiln.kernels import int4_words as w4
    from graphkiln.kernels.fp8_mma import mma_tiling
    from graphkiln.kernels.int4_dp4a import dp4a_tiling
    from graphkiln.kernels.split_k import multiprocessors

    sms = multiprocessors(device)
    if fmt == "int4" and rows > 64:
        return i4.mm_tiling(rows, n, k, GROUP, sms)
    if fmt == "int4" and rows == 1:
        return dp4a_tiling(n, k, GROUP, sms)
    if fmt == "int4":
        return w4.dot_tiling(rows, n, k, sms)
    if rows == 1:
        return f.gemv_tiling(n, k, sms)
    quantized_first = rows > f.FEW_ROWS and not fmt.startswith("int8-w8a16")
    return mma_tiling(rows, n, k, sms, x_quantized=quantized_first, block_scales=fmt == "fp8-block")


def sweep(fmt: str, x, rows: int, weights: list, calls: int) -> dict:
    """The rule's tiles and time, the five fastest tilings of the few-row kernel at this row count, and those
    that did not compile or fit: {"rule": [us, tiles], "top5": [[us, tiles], ...], "failed": [[tiles, why]]}."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from graphkiln.errors import ConfigError

    n, k = weights[0][0].shape[0], x.shape[1]
    tma = takes_tma(fmt, x, weights)
    if tma:
        from graphkiln.kernels.tma_products import shared_bytes, tma_product, tma_tiling
        from graphkiln.kernels.split_k import multiprocessors

        itemsize = x.element_size() if fmt == "bf16" else 1  # SWEEP_TMA's steps in bytes: as many for 16-bit
        rule = tma_tiling(rows, n, k, shared_bytes(x.device), multiprocessors(x.device), itemsize)
        tilings = [(rule[0], n_, k_ // itemsize, *rest) for n_, k_, *rest in SWEEP_TMA]
    else:
        rule, tilings = rule_tiles(fmt, rows, n, k, x.device), sweep_tilings(fmt, rows)
    timed, failed = [], []
    for tiles in dict.fromkeys([rule, *tilings]):  # ConfigError: steps that do not divide K
        fn = ((lambda w, t=tiles: tma_product(x, w, t)) if fmt == "bf16" else
              (lambda w, s, t=tiles: quantized_tma(x, w, s, t)) if tma else tiled(fmt, x, rows, tiles))
        try:
            timed.append((per_call_us(lambda w, fn=fn: fn(*w), weights, calls, "cuda"), tiles))
        except (OutOfResources, CompilationError, RuntimeError, ConfigError) as e:  # RuntimeError: a failed pass
            failed.append((tiles, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
    rule_us = next((us for us, tiles in timed if tiles == rule), None)
    return {"rule": [rule_us, rule], "top5": sorted(timed)[:5], "failed": failed}


def sweep_summary(shapes: list[dict]) -> str:
    """One line per swept shape and row count: the floor, the rule's time and tiles, the best time and tiles."""
    lines = []
    for r in shapes:
        if "sweep" not in r:
            continue
        rule_us, rule = r["sweep"]["rule"]
        best_us, best = r["sweep"]["top5"][0] if r["sweep"]["top5"] else (float("inf"), ())
        rule_text = f"{rule_us:6.1f} us ({r['floor_us'] / rule_us:4.0%})" if rule_us else "   did not fit"
        lines.append(f"{r['format']:9} {r['name']:8} m={r['m']:<3} floor {r['floor_us']:6.1f} | rule {rule_text} "
                     f"{tuple(rule)} | best {best_us:6.1f} us ({r['floor_us'] / best_us:4.0%}) {tuple(best)}")
    return "\n".join(lines)
