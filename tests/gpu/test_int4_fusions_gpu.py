"""The int4 products whose input words come from the kernel before them (models/int4_fused.py): the words kernel
applying the SiLU-and-mul, and the residual add + RMSNorm writing its output's words, against the unfused kernels,
bit for bit, eagerly and replayed in a CUDA graph, at one row (where the dp4a GEMV takes the words) and more."""

import pytest
import torch

pytest.importorskip("triton")

from graphkiln.kernels.gemv import silu_mul  # noqa: E402
from graphkiln.kernels.int4_dp4a import x_words  # noqa: E402
from graphkiln.kernels.int4_linear import int4_linear  # noqa: E402
from graphkiln.kernels.rms_norm import add_rms_norm  # noqa: E402
from graphkiln.models.int4_fused import add_rms_norm_int4, int4_linear_words, int4_silu_mul_linear  # noqa: E402
from kernel_weights import activation, captured, int4_weight, tinygemm  # noqa: E402

DOWN_SHAPES = {"8b-down": (4096, 14336), "1b-down": (2048, 8192), "narrow": (200, 1152)}  # narrow: no dp4a


def _norm_inputs(width: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, residual = activation(rows, width), activation(rows, width).flip(1).contiguous()
    return x, residual, (1 + 0.1 * activation(1, width)[0]).contiguous()


def _same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", DOWN_SHAPES.values(), ids=DOWN_SHAPES.keys())
def test_gated_int4_product_is_the_silu_mul_kernel_then_the_product(shape, rows):
    n, k = shape
    qweight, scales, zeros, _ = int4_weight(n, k)
    gate_up = activation(rows, 2 * k)
    want = int4_linear(silu_mul(gate_up), qweight, scales, zeros, 128)
    assert torch.equal(int4_linear(gate_up, qweight, scales, zeros, 128, gated=True), want)
    layout = tinygemm(qweight, scales, zeros, 128)
    assert torch.equal(int4_silu_mul_linear(gate_up, qweight, scales, zeros, 128, *layout),
                       int4_linear(silu_mul(gate_up), qweight, scales, zeros, 128, *layout))


@pytest.mark.parametrize("width,group", [(4096, 128), (2048, 128), (2048, 32), (1408, 128)])
def test_norm_words_are_the_words_kernels_of_its_output(width, group):
    """1408: 11 groups in a row padded to 16, the last five not stored."""
    x, residual, weight = _norm_inputs(width)
    total, out, *words = add_rms_norm(x, residual, weight, 1e-5, words_group=group)
    assert _same((total, out), add_rms_norm(x, residual, weight, 1e-5))
    assert _same(words, x_words(out, group))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n", [6144, 1000])  # 1000: one row past the dp4a GEMV's side, the words unread
def test_norm_int4_ops_compute_what_the_unfused_ops_do(n, rows):
    x, residual, weight = _norm_inputs(4096, rows)
    qweight, scales, zeros, _ = int4_weight(n, 4096)
    total, out, *words = add_rms_norm_int4(x, residual, weight, 1e-5, 128)
    assert _same((total, out), add_rms_norm(x, residual, weight, 1e-5))
    assert torch.equal(int4_linear_words(out, *words, qweight, scales, zeros, 128),
                       int4_linear(out, qweight, scales, zeros, 128))


def test_norm_words_and_gated_products_replay_in_a_cuda_graph():
    """A layer's MLP tail at one row captured once (norm writing words, gate/up product on them, down product of
    the SiLU-and-mul) and replayed on new inputs: equal to the unfused kernels, eagerly, bit for bit."""
    hidden, inner = 4096, 14336
    gate_up_w, down_w = int4_weight(2 * inner, hidden), int4_weight(hidden, inner)
    x, residual, weight = _norm_inputs(hidden)

    def fused(x):
        total, out, *words = add_rms_norm(x, residual, weight, 1e-5, words_group=128)
        gate_up = int4_linear(out, *gate_up_w[:3], 128, words=words)
        return total + int4_linear(gate_up, *down_w[:3], 128, gated=True)

    def unfused(x):
        total, out = add_rms_norm(x, residual, weight, 1e-5)
        return total + int4_linear(silu_mul(int4_linear(out, *gate_up_w[:3], 128)), *down_w[:3], 128)

    static_x, static_y, replay = captured(fused, x)
    for seed in (1, 2):
        new = torch.randn(1, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        static_x.copy_(new.bfloat16())
        replay()
        assert torch.equal(static_y, unfused(static_x))
