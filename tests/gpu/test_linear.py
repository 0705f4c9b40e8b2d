"""graphkiln::linear on CUDA: the Triton GEMV for one-row inputs against float32, and what falls back to cuBLAS."""

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


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("shape", [(2048, 8192), (4096, 14336), (37, 100)], ids=lambda s: f"n{s[0]}-i{s[1]}")
def test_silu_mul_linear_matches_float32(shape, rows):
    """One row: the gated GEMV; more: the Triton SiLU-and-mul kernel, then cuBLAS."""
    n, inner = shape
    gen = torch.Generator(device="cuda").manual_seed(n + inner + rows)
    gate_up = torch.randn(rows, 2 * inner, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(n, inner, device="cuda", dtype=torch.bfloat16, generator=gen) * inner**-0.5
    y = silu_mul_linear(gate_up, weight)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ weight.float().t()
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("shape", [(16384, 2048), (28672, 4096), (74, 100)], ids=lambda s: f"n{s[0]}-k{s[1]}")
def test_linear_silu_mul_is_the_activation_of_the_product(shape, rows):
    """One row: the GEMV pairs gate row j with up row I + j in a program and applies the activation to its own
    outputs, so it equals, bit for bit, the SiLU-and-mul kernel on the product of the GEMV at the same tiling
    (the same K steps, so the same float32 sums); more rows: cuBLAS, then that kernel."""
    from graphkiln.kernels.gemv import gemv, silu_mul, tiling
    from graphkiln.models.linear import linear_silu_mul

    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
    y = linear_silu_mul(x, weight)
    assert y.shape == (rows, n // 2) and y.dtype == torch.bfloat16
    product = gemv(x, weight, tiles=tiling(n, k, activated=True)) if rows == 1 else torch.mm(x, weight.t())
    assert torch.equal(y, silu_mul(product))
    gate, up = (x.float() @ weight.float().t()).chunk(2, dim=-1)
    torch.testing.assert_close(y.float(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)
