"""The weight products' launches `python -m bench resources` compiles (resources.py), as graphkiln's wrappers make
them on CPU tensors under a stand-in driver: each returns its (label, tiles of the product kernel[, weights a
thread takes a loop step]) for the row it adds.
"""

from __future__ import annotations


def product_launches(name: str, n: int, k: int, rows: int, block_scales: bool, arch: int) -> tuple[str, str]:
    """fp8_linear's launches for `rows` rows of x and an N x K weight with per-channel or 128 x 128 block scales,
    as it dispatches them on sm_<arch> (the GEMV, fp8_tma on x quantized before it from sm90, fp8_mma on x
    quantized in registers or by a kernel before it, split-K sums; above MMA_ROWS the CPU takes the fp8_mma
    fallback, not torch._scaled_mm); its (label, tiles of the product kernel)."""
    import torch

    from graphkiln.kernels.fp8_linear import FEW_ROWS, FP8, fp8_linear, quantize_rows
    from graphkiln.kernels.tma_products import fp8_tma, tma_takes, tma_tiling

    scale = torch.ones(-(-n // 128), -(-k // 128)) if block_scales else torch.ones(n)
    x, weight = torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=FP8)
    label = f"{name} fp8 {'per block' if block_scales else 'per channel'} m={rows}"
    if arch >= 90 and not block_scales and tma_takes(rows, n, k):  # what tma_fits takes on CUDA
        fp8_tma(*quantize_rows(x), weight, scale, torch.bfloat16)
        block_m, block_n, block_k, splits, _, stages = tma_tiling(rows, n, k)
        return f"{label} tma", f"block_m={block_m} block_n={block_n} block_k={block_k} splits={splits} stages={stages}"
    fp8_linear(x, weight, scale)
    return _gemv_or_mma(label, n, k, rows, rows > FEW_ROWS, block_scales)


def int8_launches(name: str, n: int, k: int, rows: int, scheme: str) -> tuple[str, str]:
    """int8_linear's launches for `rows` rows of x and an N x K int8 weight: `scheme` "w8a8" (per-channel scales, x
    quantized), "w8a16" or "w8a16-groups" (scales per 128 inputs); its (label, tiles of the product kernel).
    Above MMA_ROWS W8A8's product is torch._int_mm (cuBLAS): only the kernels around it are Triton's."""
    import torch

    from graphkiln.kernels.fp8_linear import FEW_ROWS
    from graphkiln.kernels.int8_linear import int8_linear

    scale = torch.ones(n, -(-k // 128)) if scheme.endswith("groups") else torch.ones(n)
    int8_linear(torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.int8), scale,
                quantize_input=scheme == "w8a8")
    return _gemv_or_mma(f"{name} int8 {scheme} m={rows}", n, k, rows, scheme == "w8a8" and rows > FEW_ROWS)


def _gemv_or_mma(label: str, n: int, k: int, rows: int, x_quantized: bool,
                 block_scales: bool = False) -> tuple[str, str] | tuple[str, str, float]:
    """The row for fp8_linear's and int8_linear's own kernels at `rows` rows of x and an N x K 8-bit weight: the
    one-row GEMV's (label, tiles, weights a thread takes a loop step), or fp8_mma's (label, tiles) at more rows,
    on x quantized before it where `x_quantized`."""
    from graphkiln.kernels.fp8_linear import gemv_tiling
    from graphkiln.kernels.fp8_mma import mma_tiling

    if rows == 1:
        block_n, block_k, splits, warps, stages = gemv_tiling(n, k)
        return (label, f"block_n={block_n} block_k={block_k} splits={splits} stages={stages}",
                block_n * block_k / (32 * warps))
    block_m, block_n, block_k, splits, _, stages = mma_tiling(rows, n, k, 132, x_quantized=x_quantized,
                                                              block_scales=block_scales)
    return label, f"block_m={block_m} block_n={block_n} block_k={block_k} splits={splits} stages={stages}"


def bf16_launch(name: str, n: int, k: int, rows: int, arch: int) -> tuple | None:
    """What graphkiln::linear runs on `rows` rows of x and a bf16 N x K weight, where it is ours: the GEMV at one
    row, from sm90 the TMA-fed product where `tma_takes` the shapes (None for cuBLAS); its (label, tiles[, weights
    a thread takes a loop step])."""
    import torch

    from graphkiln.kernels.gemv import gemv, tiling
    from graphkiln.kernels.tma_products import tma_product, tma_takes, tma_tiling

    x, weight = torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16)
    if rows == 1:
        gemv(x, weight)
        block_n, block_k, warps, stages = tiling(n, k)
        tiles = f"block_n={block_n} block_k={block_k} stages={stages}"
        return f"{name} bf16 m=1", tiles, block_n * block_k / (32 * warps)
    if arch < 90 or not tma_takes(rows, n, k, itemsize=2):
        return None
    tma_product(x, weight)
    block_m, block_n, block_k, _, _, stages = tma_tiling(rows, n, k, itemsize=2)
    return f"{name} bf16 m={rows} tma", f"block_m={block_m} block_n={block_n} block_k={block_k} stages={stages}"


def int4_gemv_launch(name: str, n: int, k: int, dp4a: bool) -> tuple[str, str, float]:
    """The int4 one-row product of an N x K weight (groups of 128, or of K where shorter): the byte GEMV, or the
    dp4a GEMV after its x-words kernel; its (label, tiles, weights a thread takes a loop step)."""
    import torch

    from graphkiln.kernels.int4_dp4a import dp4a_tiling, int4_dp4a_gemv
    from graphkiln.kernels.int4_linear import gemv_tiling, int4_gemv
    from graphkiln.kernels.int4_words import words

    group = min(128, k)
    x, qweight = torch.zeros(1, k, dtype=torch.bfloat16), torch.zeros(n, k // 2, dtype=torch.uint8)
    scales = torch.ones(n, k // group, dtype=torch.bfloat16)
    if dp4a:
        int4_dp4a_gemv(x, words(qweight), scales, scales, group)
        block_n, block_k, splits, warps, stages = dp4a_tiling(n, k, group)
    else:
        int4_gemv(x, qweight, scales, scales, group)
        block_n, block_k, splits, warps, stages = gemv_tiling(n, k)
    return (f"{name} int4 {'dp4a' if dp4a else 'byte'} m=1",
            f"block_n={block_n} block_k={block_k} splits={splits} stages={stages}", block_n * block_k / (32 * warps))
