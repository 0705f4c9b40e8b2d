"""The int4 fusions on Dynamo graphs: silu_mul_linear takes an int4 down product of the SiLU-and-mul, and
int4_norm_words a residual add and RMSNorm feeding only int4 products of one group size; on the CPU the graphs
they leave compute what the graph did, bit for bit (the kernels' words are checked under Triton's interpreter,
tests/test_kernels_interpreted.py, and on the GPU, tests/gpu/test_int4_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from test_passes import dynamo_graph

from graphkiln.models.int4_fused import add_rms_norm_int4
from graphkiln.models.quantized_linear import quantize_int4
from graphkiln.passes.int4_norm_words import Int4NormWords
from graphkiln.passes.silu_mul_linear import SiluMulLinear

F = torch.nn.functional
WIDTH = 256


def _weights(group_b: int) -> dict[str, torch.Tensor]:
    """Packed int4 weights of a q/k/v [384, W], gate/up [256, W] (groups of `group_b`) and down [W, 128] product,
    as the graph's inputs."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"qkv": (384, WIDTH, 64), "gate_up": (256, WIDTH, group_b), "down": (WIDTH, 128, 64)}
    feeds = {}
    for name, (n, k, group) in shapes.items():
        q, s, z = quantize_int4(torch.randn(n, k, generator=gen), group)
        feeds |= {f"L_{name}_q_": q, f"L_{name}_s_": s, f"L_{name}_z_": z}
    return feeds


def _layer(x, r, w, qkv_q, qkv_s, qkv_z, gate_up_q, gate_up_s, gate_up_z, down_q, down_s, down_z, group_b=64):
    """Two residual adds and norms, each before int4 products, and the MLP's SiLU-and-mul before its down product."""
    ops = torch.ops.graphkiln
    total, out = ops.add_rms_norm(x, r, w, 1e-5)
    h = ops.int4_linear(out, qkv_q, qkv_s, qkv_z, 64)[:, :WIDTH]
    total2, out2 = ops.add_rms_norm(total, h, w, 1e-5)
    gate, up = ops.int4_linear(out2, gate_up_q, gate_up_s, gate_up_z, group_b).chunk(2, dim=-1)
    return total2 + ops.int4_linear(F.silu(gate) * up, down_q, down_s, down_z, 64)


def _also_read_as_is(x, r, w, qkv_q, qkv_s, qkv_z, *rest):
    total, out = torch.ops.graphkiln.add_rms_norm(x, r, w, 1e-5)
    return total + torch.ops.graphkiln.int4_linear(out, qkv_q, qkv_s, qkv_z, 64)[:, :WIDTH] + out


def _two_group_sizes(x, r, w, qkv_q, qkv_s, qkv_z, gate_up_q, gate_up_s, gate_up_z, *rest):
    ops = torch.ops.graphkiln
    total, out = ops.add_rms_norm(x, r, w, 1e-5)
    a = ops.int4_linear(out, qkv_q, qkv_s, qkv_z, 64)[:, :WIDTH]
    return total + a + ops.int4_linear(out, gate_up_q, gate_up_s, gate_up_z, 32)[:, :WIDTH]


VARIANTS = [("a layer", _layer, 1, 2, 64), ("a norm's output also read as it is", _also_read_as_is, 0, 0, 64),
            ("one norm before products of two group sizes", _two_group_sizes, 0, 0, 32)]


@pytest.mark.parametrize("name,fn,gated,norms,group_b", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_int4_fusions_take_their_patterns_and_compute_what_the_graph_did(name, fn, gated, norms, group_b):
    x, r = torch.randn(5, WIDTH), torch.randn(5, WIDTH)
    w = torch.rand(WIDTH) + 0.5
    feeds = {"L_x_": x, "L_r_": r, "L_w_": w} | _weights(group_b=group_b)
    order = ["L_x_", "L_r_", "L_w_", *(f"L_{n}_{p}_" for n in ("qkv", "gate_up", "down") for p in "qsz")]
    args = [feeds[k] for k in order]
    gm = dynamo_graph(fn, *args)
    assert SiluMulLinear()(gm) == gated
    assert Int4NormWords()(gm) == norms
    gm.graph.lint()
    assert gm.code.count("int4_silu_mul_linear.default") == gated
    assert gm.code.count("add_rms_norm_int4.default") == norms
    for call in (n for n in gm.graph.nodes if n.target is torch.ops.graphkiln.int4_linear_words.default):
        normed, *words = call.args[:4]  # x, then the words of the same norm's output
        assert [(a.args[0], a.args[1]) for a in (normed, *words)] == [(normed.args[0], i) for i in (1, 2, 3, 4)]
    placeholders = [feeds.get(n.target, 5) for n in gm.graph.nodes if n.op == "placeholder"]
    assert torch.equal(gm(*placeholders)[0], fn(*args))


def test_add_rms_norm_int4_on_the_cpu_is_the_norm_with_words_unwritten():
    """Off CUDA (and past one row) no product reads the words: the op's first two outputs are add_rms_norm's, the
    words shaped as the fake kernel says ([4, K/8] int32, [K/G] float32 twice)."""
    x, r = torch.randn(1, WIDTH, dtype=torch.bfloat16), torch.randn(1, WIDTH, dtype=torch.bfloat16)
    w = torch.rand(WIDTH, dtype=torch.bfloat16) + 0.5
    total, out, words, scales, sums = add_rms_norm_int4(x, r, w, 1e-5, 64)
    assert all(torch.equal(a, b) for a, b in zip((total, out), torch.ops.graphkiln.add_rms_norm(x, r, w, 1e-5)))
    assert (words.shape, words.dtype, scales.shape, sums.shape) == ((4, WIDTH // 8), torch.int32, (4,), (4,))
