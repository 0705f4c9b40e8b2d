"""The int8 weight products (int8_linear: the one-row GEMV, fp8_mma on int8 tensor cores with x rounded per 1 x 128
group in registers up to FEW_ROWS, then on x quantized per token by a kernel before it, and past MMA_ROWS
torch._int_mm on those rows; for W8A16 fp8_mma on the weight converted to x's dtype, then the dequantized weight in
torch.mm) against float32 products of the dequantized weight and of x rounded
as each path rounds it, at decode and prefill row counts, with scales per channel or (W8A16) per 128 inputs, with
every split of K, and replayed in a CUDA graph."""

import pytest
import torch

pytest.importorskip("triton")

from graphkiln.kernels import fp8_mma as mma_kernels  # noqa: E402
from graphkiln.kernels.fp8_linear import FEW_ROWS, quantize_rows  # noqa: E402
from graphkiln.kernels.int8_linear import int8_linear, int_mm_fits  # noqa: E402
from graphkiln.kernels.split_k import multiprocessors  # noqa: E402
from graphkiln.models.int8_linear import quantize_activations_int8  # noqa: E402
from kernel_weights import (  # noqa: E402
    MODEL_SHAPES, ROWS, SPLITS, activation, captured, int8_weight, relative_error, with_splits,
)

INT8_SHAPES = {**MODEL_SHAPES, "ragged": (1000, 3072), "tiny": (40, 128), "k-not-8": (200, 1156)}
# float32 sums of the same rounded products in another order, then bf16 output rounding
ROUNDING = 0.005


def _rounded(x: torch.Tensor, static: torch.Tensor | None) -> torch.Tensor:
    """x as int8_linear rounds it for W8A8 at its row count (the CPU reference rounds per token throughout)."""
    rows, k = x.shape
    if rows == 1:
        return x.float()
    if rows <= FEW_ROWS:
        width = -(-k // 128) * 128
        padded = torch.nn.functional.pad(x.float(), (0, width - k))
        return quantize_activations_int8(padded.unflatten(-1, (-1, 128)), None).flatten(-2)[:, :k]
    return quantize_activations_int8(x, static)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a8-static", "w8a16", "w8a16-groups"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", INT8_SHAPES.values(), ids=INT8_SHAPES.keys())
def test_int8_linear_matches_float32_of_x_as_rounded(shape, rows, scheme):
    n, k = shape
    weight, scale, reference_weight = int8_weight(n, k, groups=scheme == "w8a16-groups")
    x = activation(rows, k)
    static = (x.float().abs().amax() / 127).reshape(1) if scheme == "w8a8-static" else None
    w8a8 = scheme.startswith("w8a8")
    y = int8_linear(x, weight, scale, static, quantize_input=w8a8)
    expected = (_rounded(x, static) if w8a8 else x.float()) @ reference_weight.t()
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, expected) < ROUNDING
    if w8a8 and rows > 1:  # the rounding is there: x as it is lies further off
        assert relative_error(y, x.float() @ reference_weight.t()) > relative_error(y, expected)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("rows", [2, 16])
@pytest.mark.parametrize("scheme", ["w8a8", "w8a16", "w8a16-groups"])
def test_int8_mma_matches_float32_with_every_split_of_k(scheme, rows, splits):
    n, k = 4096, 14336
    weight, scale, reference_weight = int8_weight(n, k, groups=scheme == "w8a16-groups")
    weight_to_x = scheme != "w8a8"
    x = activation(rows, k)
    tiles = with_splits(mma_kernels.mma_tiling(rows, n, k, multiprocessors(x.device)), splits, False)
    y = mma_kernels.fp8_mma(x, weight, scale, tiles=tiles, weight_to_x=weight_to_x, scale_rows=1)
    expected = (x.float() if weight_to_x else _rounded(x, None)) @ reference_weight.t()
    assert relative_error(y, expected) < ROUNDING


def test_int8_row_quantization_is_within_half_a_step():
    x = activation(64, 4096) * 5
    q, scales = quantize_rows(x, dtype=torch.int8)
    amax = x.float().abs().amax(dim=1, keepdim=True)
    assert q.dtype == torch.int8 and scales.shape == (64, 1) and q.abs().max() <= 127
    torch.testing.assert_close(scales, amax / 127, rtol=1e-6, atol=0)
    assert ((q.float() * scales - x.float()).abs() <= scales * 0.5 * (1 + 1e-5)).all()


@pytest.mark.parametrize("rows", [1, 8, 33, 256])
def test_int8_linear_replays_in_a_cuda_graph(rows):
    """Every path captured and replayed on new values of its input: the eager call's result, bit for bit."""
    n, k = 6144, 4096
    weight, scale, _ = int8_weight(n, k)
    assert int_mm_fits(activation(max(rows, 17), k), weight)
    static_x, static_y, replay = captured(lambda x: int8_linear(x, weight, scale, activated=True), activation(rows, k))
    fresh = activation(rows, k) * 2
    static_x.copy_(fresh)
    replay()
    torch.testing.assert_close(static_y, int8_linear(fresh, weight, scale, activated=True), rtol=0, atol=0)
