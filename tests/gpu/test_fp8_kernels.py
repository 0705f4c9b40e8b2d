"""The fp8 weight kernels (the one-row GEMV, the tensor-core kernels on activations quantized in registers or
before them, fp8_linear's choice among them and torch._scaled_mm) against float32 products of the dequantized
weight, at decode and prefill row counts, on the bench models' projections and ragged shapes, with every split
of K; with the activation of the gate and up projections (`activated`) against the SiLU-and-mul kernel on the
plain product."""

import pytest
import torch

pytest.importorskip("triton")

from graphkiln.kernels import fp8_linear as fp8_kernels  # noqa: E402
from graphkiln.kernels import fp8_mma as mma_kernels  # noqa: E402
from graphkiln.kernels import tma_products as tma_kernels  # noqa: E402
from graphkiln.kernels.fp8_linear import (  # noqa: E402
    FEW_ROWS, FP8, MMA_ROWS, fp8_linear, quantize_rows, quantize_static, scaled_mm_fits,
)
from graphkiln.kernels.gemv import silu_mul  # noqa: E402
from graphkiln.kernels.split_k import multiprocessors  # noqa: E402
from graphkiln.kernels.tma_products import tma_fits  # noqa: E402
from kernel_weights import (  # noqa: E402
    MODEL_SHAPES, ROWS, SPLITS, activation, fp8_weight, relative_error, with_splits,
)

FP8_SHAPES = {**MODEL_SHAPES, "ragged": (1000, 3000), "tiny": (37, 100), "odd-blocks": (200, 1160)}
SPLIT_SHAPES = {"ragged": (1000, 3000), "odd-blocks": (200, 1160), "8b-down": (4096, 14336)}


@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", FP8_SHAPES.values(), ids=FP8_SHAPES.keys())
def test_fp8_linear_matches_float32(shape, rows, blocks):
    """The activation is quantized to fp8 (per token, or per 1 x 128 group where fp8_mma rounds it in registers):
    within fp8's step of the float32 product. One row, and block weights beyond what _scaled_mm takes, are
    multiplied unquantized (bf16 output rounding only)."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(rows, k)
    y = fp8_linear(x, weight, scale)
    expected = x.float() @ reference_weight.t()
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    unquantized = rows == 1 or (blocks and rows > MMA_ROWS and not scaled_mm_fits(x, weight, blocks))
    assert relative_error(y, expected) < (0.005 if unquantized else 0.05)


@pytest.mark.parametrize("rows", [1, 8, 33, 128])
def test_fp8_linear_float16_and_static_input_scale(rows):
    n, k = 4096, 4096
    weight, scale, reference_weight = fp8_weight(n, k, False)
    x = activation(rows, k, torch.float16)
    input_scale = (x.float().abs().amax() / 448).reshape(1)
    y = fp8_linear(x, weight, scale, input_scale)
    assert y.dtype == torch.float16  # fp8_mma's groups in registers at 8 rows before sm90, the static scale else
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.06


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_is_within_half_an_fp8_step(group):
    x = activation(64, 4096) * 5
    q, scales = quantize_rows(x, group)
    per_element = scales if group is None else scales.repeat_interleave(group, 1)
    assert q.dtype == FP8 and scales.shape == ((64, 1) if group is None else (64, 32))
    amax = x.float().abs().amax(dim=1, keepdim=True) if group is None else x.float().abs().view(64, 32, 128).amax(2)
    torch.testing.assert_close(scales, amax / 448, rtol=1e-6, atol=0)
    error = (q.float() * per_element - x.float()).abs()
    assert (error <= x.float().abs() * 2**-4 + per_element * 2**-9).all()


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("shape", SPLIT_SHAPES.values(), ids=SPLIT_SHAPES.keys())
def test_fp8_gemv_matches_float32_with_every_split_of_k(shape, blocks, splits):
    """Each split's partial product, summed in the second kernel: the float32 product up to the output rounding."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(1, k)
    tiles = with_splits(fp8_kernels.gemv_tiling(n, k, multiprocessors(x.device)), splits, False)
    y = fp8_kernels.fp8_gemv(x, weight, scale, tiles=tiles)
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.005


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64, 100])
@pytest.mark.parametrize("shape", SPLIT_SHAPES.values(), ids=SPLIT_SHAPES.keys())
def test_fp8_mma_matches_float32_with_every_split_of_k(shape, rows, blocks, splits):
    """The fp8 tensor-core kernel, its activation rounded to fp8 per 1 x 128 group in registers: within fp8's
    step of the float32 product for every split of K and for rows beyond one row tile (100)."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(rows, k)
    tiles = mma_kernels.mma_tiling(rows, n, k, multiprocessors(x.device))
    y = mma_kernels.fp8_mma(x, weight, scale, tiles=(*tiles[:3], splits, *tiles[4:]))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.05


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_fp8_mma_rounds_the_activation_per_group(rows):
    """Against the float32 product of the weight and the activation rounded to fp8 per 1 x 128 group (as
    torch rounds): only accumulation order and the output rounding differ, so a kernel that quantized per
    token, or not at all, would fail this bound."""
    n, k = 4096, 4096
    weight, scale, reference_weight = fp8_weight(n, k, False)
    x = activation(rows, k) * torch.linspace(0.01, 4, k, device="cuda")  # groups of very different ranges
    groups = x.float().view(rows, k // 128, 128)
    group_scale = groups.abs().amax(-1, keepdim=True) / 448
    rounded = ((groups / group_scale).to(FP8).float() * group_scale).view(rows, k)
    y = mma_kernels.fp8_mma(x, weight, scale)
    assert relative_error(y, rounded @ reference_weight.t()) < 0.006


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", [17, 33, 64, 100])
@pytest.mark.parametrize("shape", SPLIT_SHAPES.values(), ids=SPLIT_SHAPES.keys())
def test_fp8_mma_on_quantized_rows_is_the_float32_product_of_what_it_reads(shape, rows, blocks, static, splits):
    """fp8_mma on x already in fp8 (scaled per token, per 1 x 128 group for block weights, or by one static
    scale, as fp8_linear hands it over above FEW_ROWS rows) against the float32 product of those fp8 rows
    times their scales and the dequantized weight: only accumulation order and the output rounding differ,
    so a scale read from the wrong row, group or split fails the bound."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(rows, k) * torch.linspace(0.01, 4, k, device="cuda")  # groups of very different ranges
    if static:
        input_scale = (x.float().abs().amax() / 448).reshape(1)
        xq, x_scale = quantize_static(x, input_scale), input_scale.reshape(1, 1).expand(rows, 1)
        per_element = x_scale
    else:
        xq, x_scale = quantize_rows(x, 128 if blocks else None)
        per_element = x_scale.repeat_interleave(128, 1)[:, :k] if blocks else x_scale
    tiles = mma_kernels.mma_tiling(rows, n, k, multiprocessors(x.device), x_quantized=True, block_scales=blocks)
    y = mma_kernels.fp8_mma(xq, weight, scale, tiles=(*tiles[:3], splits, *tiles[4:]), x_scale=x_scale,
                            out_dtype=torch.bfloat16)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, (xq.float() * per_element) @ reference_weight.t()) < 0.006


GATE_UP_SHAPES = {"8b-gate_up": (28672, 4096), "1b-gate_up": (16384, 2048), "tiny": (200, 1160)}


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("shape", GATE_UP_SHAPES.values(), ids=GATE_UP_SHAPES.keys())
def test_activated_fp8_linear_matches_float32(shape, rows, blocks, splits):
    """The gate and up projections with their activation (at one row with every split of K) within fp8's step
    of silu(gate) * up of the float32 products."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(rows, k)
    if rows == 1:
        tiles = with_splits(fp8_kernels.gemv_tiling(n, k, multiprocessors(x.device)), splits, False)
        y = fp8_kernels.fp8_gemv(x, weight, scale, tiles=tiles, activated=True)
    else:
        y = fp8_linear(x, weight, scale, activated=True)
    assert y.shape == (rows, n // 2) and y.dtype == torch.bfloat16
    gate, up = (x.float() @ reference_weight.t()).chunk(2, dim=-1)
    assert relative_error(y, torch.nn.functional.silu(gate) * up) < (0.005 if rows == 1 else 0.05)


@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("shape", GATE_UP_SHAPES.values(), ids=GATE_UP_SHAPES.keys())
def test_one_row_activation_epilogue_is_the_silu_mul_kernel_on_its_product(shape, blocks):
    """Unsplit, the one-row GEMV applies the activation in its epilogue (not the SiLU-and-mul kernel after it):
    bit for bit what that kernel makes of the ungated product at the same tiles."""
    n, k = shape
    weight, scale, _ = fp8_weight(n, k, blocks)
    x = activation(1, k)
    tiles = with_splits(fp8_kernels.gemv_tiling(n, k, multiprocessors(x.device)), 1, False)
    product = fp8_kernels.fp8_gemv(x, weight, scale, tiles=tiles)
    launched = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8_kernels, "silu_mul", lambda y: launched.append(y) or silu_mul(y))
        y = fp8_kernels.fp8_gemv(x, weight, scale, tiles=tiles, activated=True)
    assert not launched and torch.equal(y, silu_mul(product))


@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", [16, 17, 33, 64, 65, 300])
@pytest.mark.parametrize("shape", {"8b": (4096, 14336), "1b": (2048, 8192), "tiny": (200, 1160)}.values(),
                         ids=["8b", "1b", "tiny"])
def test_fp8_mlp_is_its_two_products_bit_for_bit(shape, rows, blocks, monkeypatch):
    """The MLP op, where its down product's quantization applies the SiLU-and-mul as it loads (past FEW_ROWS
    rows, or from 2 where both products take fp8_tma), equals the activated gate/up product and the down product
    launched apart bit for bit, and the float32 MLP within fp8's steps. Elsewhere the op launches them apart."""
    hidden, inner = shape
    gate_up, gate_up_scale, gate_up_reference = fp8_weight(2 * inner, hidden, blocks)
    down, down_scale, down_reference = fp8_weight(hidden, inner, blocks)
    x = activation(rows, hidden)
    if rows <= FEW_ROWS and not (tma_fits(x, gate_up, gate_up_scale) and tma_fits(x, down, down_scale)):
        pytest.skip("up to FEW_ROWS rows, off fp8_tma, the op launches the two products apart")
    if rows > MMA_ROWS and not scaled_mm_fits(x, down, blocks):
        pytest.skip("this torch's _scaled_mm takes no block scales: the op launches the two products apart")
    activated = []

    def quantize_rows_recorded(*args, **kwargs):
        activated.append(kwargs.get("activated", False))
        return quantize_rows(*args, **kwargs)

    monkeypatch.setattr(fp8_kernels, "quantize_rows", quantize_rows_recorded)
    y = fp8_kernels.fp8_mlp(x, gate_up, gate_up_scale, None, down, down_scale)
    assert activated.count(True) == 1
    monkeypatch.undo()
    apart = fp8_linear(fp8_linear(x, gate_up, gate_up_scale, activated=True), down, down_scale)
    assert y.shape == (rows, hidden) and torch.equal(y, apart)
    gate, up = (x.float() @ gate_up_reference.t()).chunk(2, dim=-1)
    assert relative_error(y, (torch.nn.functional.silu(gate) * up) @ down_reference.t()) < 0.08


@pytest.mark.parametrize("group", [None, 128])
def test_activated_quantize_rows_is_silu_mul_then_quantize_rows(group):
    y = activation(70, 2 * 14336)
    assert all(torch.equal(a, b) for a, b in zip(quantize_rows(y, group, activated=True),
                                                    quantize_rows(silu_mul(y), group)))


TMA_SHAPES = {"8b-qkv": (6144, 4096), "8b-down": (4096, 14336), "1b-o": (2048, 2048), "partial-tiles": (200, 1168)}
needs_tma = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                               reason="TMA copies need sm90 or later")


@needs_tma
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("rows", [2, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("shape", TMA_SHAPES.values(), ids=TMA_SHAPES.keys())
def test_fp8_tma_is_the_float32_product_of_what_it_reads(shape, rows, static, splits):
    """The TMA-fed product on x in fp8 (per token, or one static scale whose rows share an element) against the
    float32 product of those fp8 rows times their scales and the dequantized weight, K unsplit (the rule's) or in
    up to three splits (the sweep's): only accumulation order and the output rounding differ. 200 x 1168 ends in a
    partial slab and a partial K step, which read zeros."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, False)
    x = activation(rows, k) * torch.linspace(0.01, 4, k, device="cuda")
    if static:
        input_scale = (x.float().abs().amax() / 448).reshape(1)
        xq, x_scale = quantize_static(x, input_scale), input_scale.reshape(1, 1).expand(rows, 1)
    else:
        xq, x_scale = quantize_rows(x)
    assert tma_kernels.tma_fits(xq, weight, scale) == (n >= tma_kernels.TMA_MIN_N)
    tiles = tma_kernels.tma_tiling(rows, n, k)
    y = tma_kernels.fp8_tma(xq, x_scale, weight, scale, torch.bfloat16, (*tiles[:3], splits, *tiles[4:]))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, (xq.float() * x_scale) @ reference_weight.t()) < 0.006


@needs_tma
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [2, 8, 17, 64])
@pytest.mark.parametrize("shape", TMA_SHAPES.values(), ids=TMA_SHAPES.keys())
def test_tma_product_of_16_bit_weights_is_their_float32_product(shape, rows, dtype):
    """The same kernel without scales (tma_product, a benchmark candidate) on 16-bit x and weight: only
    accumulation order and the output rounding differ from the float32 product."""
    n, k = shape
    x = activation(rows, k, dtype)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(dtype)
    y = tma_kernels.tma_product(x, weight)
    assert y.shape == (rows, n) and y.dtype == dtype
    assert relative_error(y, x.float() @ weight.float().t()) < 0.006


@needs_tma
@pytest.mark.parametrize("rows", [2, 17, 64])
@pytest.mark.parametrize("shape", [(16384, 2048), (28672, 4096), (200, 1168)], ids=lambda s: f"n{s[0]}-k{s[1]}")
def test_tma_product_activated_is_the_activation_kernel_after_the_product(shape, rows):
    """The MLP's SiLU-and-mul in the 16-bit product's epilogue (a slab's gate rows with their up rows) equals, bit
    for bit, the activation kernel on the plain product: both round the products to bfloat16 first. 200 x 1168
    ends in a partial slab, whose gate tile reaches into the up rows and is masked."""
    n, k = shape
    x = activation(rows, k)
    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    y = tma_kernels.tma_product(x, weight, activated=True)
    assert y.shape == (rows, n // 2)
    assert torch.equal(y, silu_mul(tma_kernels.tma_product(x, weight)))


@needs_tma
def test_fp8_linear_takes_the_tma_product_where_it_fits(monkeypatch):
    """From 2 to MMA_ROWS rows, per-channel weights of at least TMA_MIN_N rows whose rows are 16-byte multiples go
    to fp8_tma; block weights, narrower weights, a K that is not a multiple of 16, one row and more than MMA_ROWS
    rows do not."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return tma_kernels.fp8_tma(*args, **kwargs)

    monkeypatch.setattr(fp8_kernels, "fp8_tma", counted)
    for n, k, blocks, rows, taken in [(4096, 4096, False, 2, True), (4096, 4096, False, 16, True),
                                      (4096, 4096, False, 64, True), (4096, 4096, False, 1, False),
                                      (4096, 4096, False, 65, False), (4096, 4096, True, 8, False),
                                      (2048, 2048, False, 8, True), (1024, 2048, False, 8, False),
                                      (4104, 3000, False, 8, False)]:
        weight, scale, _ = fp8_weight(n, k, blocks)
        calls.clear()
        fp8_linear(activation(rows, k), weight, scale)
        assert calls == ([rows] if taken else []), (n, k, blocks, rows)
