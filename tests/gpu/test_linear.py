"""graphkiln::linear on CUDA: the Triton GEMV for one-row inputs against float32, the TMA-fed kernel from 2 to 64
rows of wide weights on sm90+, and what falls back to cuBLAS."""

import pytest
import torch

from graphkiln.models.linear import linear, silu_mul_linear, uses_gemv

SHAPES = [  # (N, K): the bench models' projections, then ragged sizes that leave partial slabs and K steps
    (3072, 2048), (2048, 8192), (16384, 2048), (128256, 2048), (6144, 4096), (4096, 14336),
    (1, 16), (37, 100), (8193, 520), (1000, 3000), (100, 9000),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[0]}-k{s[1]}")
def test_one_row_runs_the_gemv_and_matches_float32(shape, dtype):
    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
    weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k**-0.5
    assert uses_gemv(x, weight)
    y = linear(x, weight)
    expected = x.float() @ weight.float().t()
    assert y.shape == (1, n) and y.dtype == dtype
    # float32 accumulation, one rounding to the output dtype
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)
    assert ((y.float() - expected).abs().max() <= expected.abs().max() * 2**-7 + 1e-3)


def test_other_inputs_go_to_torch_mm():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    cases = [(x, weight), (x[:1].float(), weight.float()), (x[:, ::2][:1], weight[:, ::2])]
    for a, w in cases:
        assert not uses_gemv(a, w)
        assert torch.equal(linear(a, w), torch.mm(a, w.t()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_few_rows_of_wide_weights_take_the_tma_product(dtype):
    """From 2 to 64 rows, weights of at least 2048 rows whose rows are 16-byte multiples go to tma_product (equal to
    it, bit for bit, and within one rounding of the float32 product); one row, 65 rows, narrower weights, a K that
    is not a multiple of 8 elements and x at an odd offset go elsewhere."""
    tma = pytest.importorskip("graphkiln.kernels.tma_products")
    if not tma.has_tma(torch.device("cuda")):
        pytest.skip("the TMA-fed kernel needs sm90+")
    product_fits, tma_product = tma.product_fits, tma.tma_product
    gen = torch.Generator(device="cuda").manual_seed(7)
    for n, k, rows, taken in [(3072, 2048, 2, True), (2048, 8192, 16, True), (28672, 4096, 64, True),
                              (128256, 2048, 8, True), (3072, 2048, 1, False), (3072, 2048, 65, False),
                              (1024, 2048, 8, False), (2048, 2052, 8, False)]:
        x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
        weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * k**-0.5
        assert product_fits(x, weight) == taken, (n, k, rows)
        y = linear(x, weight)
        if taken:
            assert torch.equal(y, tma_product(x, weight))
        expected = x.float() @ weight.float().t()
        assert ((y.float() - expected).abs().max() <= expected.abs().max() * 2**-7 + 1e-3), (n, k, rows)
    x = torch.randn(8, 2049, device="cuda", dtype=dtype, generator=gen)[:, 1:]  # rows 2 bytes past alignment
    assert not product_fits(x, torch.randn(2048, 2048, device="cuda", dtype=dtype, generator=gen))


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("shape", [(2048, 8192), (4096, 14336), (37, 100)], ids=lambda s: f"n{s[0]}-i{s[1]}")
def test_silu_mul_linear_matches_float32(shape, rows):
    """One row: the gated GEMV; more: the Triton SiLU-and-mul kernel, then the product `product` picks."""
    n, inner = shape
    gen = torch.Generator(device="cuda").manual_seed(n + inner + rows)
    gate_up = torch.randn(rows, 2 * inner, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(n, inner, device="cuda", dtype=torch.bfloat16, generator=gen) * inner**-0.5
    y = silu_mul_linear(gate_up, weight)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ weight.float().t()
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)


GATE_UP_SHAPES = [(16384, 2048), (28672, 4096), (74, 100)]


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("shape", GATE_UP_SHAPES, ids=lambda s: f"n{s[0]}-k{s[1]}")
def test_linear_silu_mul_matches_float32(shape, rows):
    """The gate and up projections with their activation, at one row (the GEMV's epilogue) and more (the product
    `product` picks, then the SiLU-and-mul kernel), against silu(gate) * up of the float32 product."""
    from graphkiln.models.linear import linear_silu_mul

    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
    y = linear_silu_mul(x, weight)
    assert y.shape == (rows, n // 2) and y.dtype == torch.bfloat16
    gate, up = (x.float() @ weight.float().t()).chunk(2, dim=-1)
    torch.testing.assert_close(y.float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", GATE_UP_SHAPES, ids=lambda s: f"n{s[0]}-k{s[1]}")
def test_one_row_linear_silu_mul_is_the_activation_of_the_gemv(shape):
    """One row: the GEMV pairs gate row j with up row I + j in a program and applies the activation to its own
    outputs, so it equals, bit for bit, the SiLU-and-mul kernel on the product of the GEMV at the same tiling
    (the same K steps, so the same float32 sums)."""
    from graphkiln.kernels.gemv import gemv, silu_mul, tiling
    from graphkiln.models.linear import linear_silu_mul

    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
    assert torch.equal(linear_silu_mul(x, weight), silu_mul(gemv(x, weight, tiles=tiling(n, k, activated=True))))
