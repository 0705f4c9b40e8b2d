"""The fusion passes on Dynamo graphs: silu_mul_linear, silu_mul_epilogue, fp8_mlp, add_rms_norm and fp8_norm_quant
take the patterns they are for and leave the ones they are not, compute on the CPU what the graph did, and hand each
other what they leave."""

from __future__ import annotations

import pytest
import torch
from test_compiler import TOY
import test_passes
from test_passes import dynamo_graph, eager_and_compiled_agree, run_manager

from graphkiln import CompileConfig
from graphkiln.compiler.compile import compile_module
from graphkiln.passes.add_rms_norm import AddRmsNorm
from graphkiln.passes.fp8_mlp import Fp8Mlp
from graphkiln.passes.silu_mul_epilogue import SiluMulEpilogue
from graphkiln.passes.silu_mul_linear import SiluMulLinear

toy, toy_graph = test_passes.toy, test_passes.toy_graph  # the toy model and its Dynamo graph (module fixtures)


def _mlp_variants():
    """(name, fn(x, gate_up_w, down_w, bias), matches): MLP tails the pass must take and must leave."""
    F = torch.nn.functional

    def gated(x, w, d, b):
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, d)

    def swapped_with_bias(x, w, d, b):
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.linear(up * F.silu(gate), d, b)

    def silu_of_up(x, w, d, b):
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.linear(F.silu(up) * gate, d)

    def gelu(x, w, d, b):
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.linear(F.gelu(gate) * up, d)

    def two_chunks(x, w, d, b):
        return F.linear(F.silu(F.linear(x, w).chunk(2, dim=-1)[0]) * F.linear(x, 2 * w).chunk(2, dim=-1)[1], d)

    return [("silu(gate) * up", gated, 1), ("up * silu(gate), bias", swapped_with_bias, 1),
            ("silu of the second half", silu_of_up, 0), ("gelu", gelu, 0), ("halves of two chunks", two_chunks, 0)]


@pytest.mark.parametrize("name,fn,matches", _mlp_variants(), ids=[v[0] for v in _mlp_variants()])
def test_silu_mul_linear_takes_the_gated_down_projection_only(name, fn, matches):
    x, w, d, b = torch.randn(5, 8), torch.randn(12, 8), torch.randn(4, 6), torch.randn(4)
    gm = dynamo_graph(fn, x, w, d, b)
    assert SiluMulLinear()(gm) == matches
    assert ("graphkiln.silu_mul_linear" in gm.code) == bool(matches)
    args = [{"L_x_": x, "L_w_": w, "L_d_": d, "L_b_": b}.get(n.target, 5) for n in gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(gm(*args)[0], fn(x, w, d, b))


def _activation_variants():
    """(name, fn(x, w, q, s, b), matches): MLP heads whose activation silu_mul_epilogue must take or leave."""
    F = torch.nn.functional
    fp8_linear = torch.ops.graphkiln.fp8_linear

    def bf16(x, w, q, s, b):
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate) * up

    def fp8_swapped(x, w, q, s, b):
        gate, up = fp8_linear(x, q, s, None).chunk(2, dim=-1)
        return up * F.silu(gate)

    def with_bias(x, w, q, s, b):
        gate, up = F.linear(x, w, b).chunk(2, dim=-1)
        return F.silu(gate) * up

    def product_used_twice(x, w, q, s, b):
        y = F.linear(x, w)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up + y[:, :6]

    def gelu(x, w, q, s, b):
        gate, up = fp8_linear(x, q, s, None).chunk(2, dim=-1)
        return F.gelu(gate) * up

    return [("linear", bf16, 1), ("fp8_linear, up * silu(gate)", fp8_swapped, 1), ("bias", with_bias, 0),
            ("product used twice", product_used_twice, 0), ("gelu", gelu, 0)]


@pytest.mark.parametrize("name,fn,matches", _activation_variants(), ids=[v[0] for v in _activation_variants()])
def test_silu_mul_epilogue_takes_the_activation_of_an_unbiased_fused_product(name, fn, matches):
    """linear or fp8_linear of [gate | up], chunked, silu(gate) * up: one graphkiln::linear_silu_mul or
    fp8_linear_silu_mul call on the product's arguments, which on float32 rows computes what the graph did."""
    from graphkiln.models.quantized_linear import quantize_fp8

    x, w, b = torch.randn(5, 8), torch.randn(12, 8), torch.randn(12)
    q, s = quantize_fp8(torch.randn(12, 8))
    gm = dynamo_graph(fn, x, w, q, s, b)
    assert SiluMulEpilogue()(gm) == matches
    assert ("_silu_mul.default" in gm.code) == bool(matches)
    feeds = {"L_x_": x, "L_w_": w, "L_q_": q, "L_s_": s, "L_b_": b}
    args = [feeds.get(n.target, 5) for n in gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(gm(*args)[0], fn(x, w, q, s, b), rtol=1e-6, atol=1e-6)


def test_silu_mul_epilogue_takes_an_int8_product_called_with_keywords():
    """graphkiln::int8_linear's arguments given by name reach int8_linear_silu_mul in their places."""
    F = torch.nn.functional
    x, q, s = torch.randn(5, 8), torch.randint(-127, 128, (12, 8), dtype=torch.int8), torch.rand(12) / 100

    def fn(x, q, s):
        y = torch.ops.graphkiln.int8_linear(x, q, weight_scale=s, input_scale=None, quantize_input=True)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up

    gm = dynamo_graph(fn, x, q, s)
    assert SiluMulEpilogue()(gm) == 1 and "int8_linear_silu_mul.default" in gm.code
    feeds = {"L_x_": x, "L_q_": q, "L_s_": s}
    args = [feeds.get(n.target, 5) for n in gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(gm(*args)[0], fn(x, q, s), rtol=1e-6, atol=1e-6)


def test_silu_mul_epilogue_leaves_silu_mul_linear_nothing_and_disabled_leaves_it_every_layer(toy_graph):
    """On by default, it takes every layer's activation before silu_mul_linear looks for it; disabled, each
    layer's activation goes into its down projection's graphkiln::silu_mul_linear instead."""
    on, off = toy_graph(), toy_graph()
    records = run_manager(on).records
    assert records["silu_mul_epilogue"].matches == TOY.num_layers and records["silu_mul_linear"].matches == 0
    records = run_manager(off, disabled=("silu_mul_epilogue",)).records
    # per layer: chunk, two getitems, silu, mul and the down linear become one silu_mul_linear
    silu_mul = records["silu_mul_linear"]
    assert (silu_mul.matches, silu_mul.nodes_removed, silu_mul.nodes_added) == (TOY.num_layers, 12, 2)
    code = ["".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule)) for gm in (on, off)]
    assert code[0].count("graphkiln.linear_silu_mul") == TOY.num_layers and "graphkiln.silu_mul_linear" not in code[0]
    assert code[1].count("graphkiln.silu_mul_linear") == TOY.num_layers and "graphkiln.linear_silu_mul" not in code[1]



def _fp8_mlp_variants():
    """(name, fn(x, q1, s1, q2, s2, t), matches): fp8 MLP tails fp8_mlp must take or leave."""
    fp8_linear, activated = torch.ops.graphkiln.fp8_linear, torch.ops.graphkiln.fp8_linear_silu_mul

    def mlp(x, q1, s1, q2, s2, t):
        return fp8_linear(activated(x, q1, s1, None), q2, s2, None)

    def static_down_scale(x, q1, s1, q2, s2, t):
        return fp8_linear(activated(x, q1, s1, None), q2, s2, t)

    def activation_used_twice(x, q1, s1, q2, s2, t):
        h = activated(x, q1, s1, None)
        return fp8_linear(h, q2, s2, None) + h[:, :4]

    def plain_product_before(x, q1, s1, q2, s2, t):
        return fp8_linear(fp8_linear(x, q1, s1, None)[:, :6], q2, s2, None)

    return [("activated, then down", mlp, 1), ("static down scale", static_down_scale, 0),
            ("activation used twice", activation_used_twice, 0), ("no activation", plain_product_before, 0)]


@pytest.mark.parametrize("name,fn,matches", _fp8_mlp_variants(), ids=[v[0] for v in _fp8_mlp_variants()])
def test_fp8_mlp_takes_the_down_projection_of_an_activated_product_only(name, fn, matches):
    """One graphkiln::fp8_mlp call on both products' arguments, which on the CPU computes what the graph did."""
    from graphkiln.models.quantized_linear import quantize_fp8

    x, t = torch.randn(5, 8), torch.tensor([0.01])
    (q1, s1), (q2, s2) = quantize_fp8(torch.randn(12, 8)), quantize_fp8(torch.randn(4, 6))
    gm = dynamo_graph(fn, x, q1, s1, q2, s2, t)
    assert Fp8Mlp()(gm) == matches
    gm.graph.lint()
    assert ("fp8_mlp.default" in gm.code) == bool(matches)
    feeds = {"L_x_": x, "L_q1_": q1, "L_s1_": s1, "L_q2_": q2, "L_s2_": s2, "L_t_": t}
    args = [feeds.get(n.target, 5) for n in gm.graph.nodes if n.op == "placeholder"]
    assert torch.equal(gm(*args)[0], fn(x, q1, s1, q2, s2, t))

def _norm_variants():
    """(name, fn(x, r, w), matches): residual adds and RMSNorms, as transformer.RMSNorm writes them, that
    add_rms_norm must take or leave."""

    def rms_norm(s, w):
        s32 = s.float()
        return w * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(s.dtype)

    def residual_and_norm(x, r, w):
        s = x + r
        return rms_norm(s, w), s * 2

    def norm_alone(x, r, w):
        return rms_norm(x, w)

    def other_eps_form(x, r, w):  # eps added before the mean: not an RMSNorm
        s = x + r
        s32 = s.float()
        return w * (s32 * torch.rsqrt((s32.pow(2) + 1e-5).mean(-1, keepdim=True))).to(s.dtype)

    def float32_weight(x, r, w):
        return rms_norm(x + r, w.float())

    def kept_in_float32(x, r, w):  # cast to float32, not back to the input's dtype
        s = x + r
        s32 = s.float()
        return w * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.float32)

    def heads(x, r, w):  # 3-D: a per-head norm
        return rms_norm((x + r).view(x.shape[0], 2, -1), w[: w.shape[0] // 2])

    return [("add, then the norm", residual_and_norm, 1), ("no add", norm_alone, 0), ("another form", other_eps_form, 0),
            ("weight of another dtype", float32_weight, 0), ("kept in float32", kept_in_float32, 0), ("3-D", heads, 0)]


@pytest.mark.parametrize("name,fn,matches", _norm_variants(), ids=[v[0] for v in _norm_variants()])
def test_add_rms_norm_takes_a_residual_add_and_its_norm_only(name, fn, matches):
    """The sum's other users take the op's first output, the norm's users its second; on the CPU the op runs
    the model's own ops, so the graph computes what it did, bit for bit."""
    x, r, w = (torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16),
               torch.randn(16, dtype=torch.bfloat16))
    torch._dynamo.mark_dynamic(r, 0)  # as x's: the sum's rows are the tokens
    gm = dynamo_graph(fn, x, r, w)
    assert AddRmsNorm()(gm) == matches
    gm.graph.lint()
    assert ("add_rms_norm.default" in gm.code) == bool(matches) and ("torch.rsqrt" in gm.code) != bool(matches)
    args = [{"L_x_": x, "L_r_": r, "L_w_": w}.get(n.target, 5) for n in gm.graph.nodes if n.op == "placeholder"]
    for ours, theirs in zip(gm(*args), torch.utils._pytree.tree_leaves(fn(x, r, w))):
        assert torch.equal(ours, theirs)


def test_add_rms_norm_takes_every_norm_after_a_residual_add_and_compiles_to_the_same_model(toy):
    """Enabled, each layer's post-attention norm, the next layer's input norm and the final norm become the
    op (the embedding's norm has no add before it); Inductor compiles the graph to what the eager model
    computes."""
    compiled, report = compile_module(toy, CompileConfig(enabled_passes=("add_rms_norm",)))
    records = {r.name: r for r in report.passes}
    assert records["add_rms_norm"].matches == 2 * TOY.num_layers
    eager_and_compiled_agree(toy, compiled)


def _norm_quant_variants():
    """(name, fn(x, r, w, q1, s1, q2, s2, qb, sb, t), matches): norms before fp8 products that fp8_norm_quant must
    take or leave, as add_rms_norm leaves them."""
    ops = torch.ops.graphkiln
    norm, linear, mlp = ops.add_rms_norm, ops.fp8_linear, ops.fp8_mlp

    def qkv_and_mlp(x, r, w, q1, s1, q2, s2, qb, sb, t):
        total, out = norm(x, r, w, 1e-5)
        h = linear(out, q1, s1, None)
        total2, out2 = norm(total, h, w, 1e-5)
        return total2 + mlp(out2, q1, s1, None, q2, s2)

    def also_read_as_is(x, r, w, q1, s1, q2, s2, qb, sb, t):
        total, out = norm(x, r, w, 1e-5)
        return linear(out, q1, s1, None) + out

    def static_scale(x, r, w, q1, s1, q2, s2, qb, sb, t):
        return linear(norm(x, r, w, 1e-5)[1], q1, s1, t)

    def block_scales(x, r, w, q1, s1, q2, s2, qb, sb, t):
        return linear(norm(x, r, w, 1e-5)[1], qb, sb, None)

    return [("q/k/v and MLP products", qkv_and_mlp, 2), ("output also read as it is", also_read_as_is, 0),
            ("static activation scale", static_scale, 0), ("block weight scales", block_scales, 0)]


@pytest.mark.parametrize("name,fn,matches", _norm_quant_variants(), ids=[v[0] for v in _norm_quant_variants()])
def test_fp8_norm_quant_takes_norms_feeding_only_per_token_fp8_products(name, fn, matches):
    """The norm becomes add_rms_norm_fp8 and its products the quantized ops, which on the CPU compute what the
    graph did, bit for bit."""
    from graphkiln.models.quantized_linear import quantize_fp8
    from graphkiln.passes.fp8_norm_quant import Fp8NormQuant

    x, r = torch.randn(5, 128, dtype=torch.bfloat16), torch.randn(5, 128, dtype=torch.bfloat16)
    w = torch.rand(128, dtype=torch.bfloat16) + 0.5
    (q1, s1), (q2, s2) = quantize_fp8(torch.randn(128, 128)), quantize_fp8(torch.randn(128, 64))
    qb, sb = q1, torch.rand(1, 1)
    s1, s2 = s1.reshape(-1), s2.reshape(-1)
    t = torch.tensor([0.01])
    feeds = {"L_x_": x, "L_r_": r, "L_w_": w, "L_q1_": q1, "L_s1_": s1, "L_q2_": q2, "L_s2_": s2, "L_qb_": qb,
             "L_sb_": sb, "L_t_": t}
    gm = dynamo_graph(fn, x, r, w, q1, s1, q2, s2, qb, sb, t)
    assert Fp8NormQuant()(gm) == matches
    gm.graph.lint()
    assert ("add_rms_norm_fp8.default" in gm.code) == bool(matches)
    quantized = [n for n in gm.graph.nodes if str(n.target).endswith("_quantized.default")]
    assert len(quantized) == matches
    for call in quantized:  # x, then the fp8 rows and their scales of the same norm (the CPU ops ignore them)
        normed, q, scale = call.args[:3]
        assert [(a.args[0], a.args[1]) for a in (normed, q, scale)] == [(normed.args[0], i) for i in (1, 2, 3)]
    args = [feeds.get(n.target, 5) for n in gm.graph.nodes if n.op == "placeholder"]
    assert torch.equal(gm(*args)[0], fn(x, r, w, q1, s1, q2, s2, qb, sb, t))


def test_fp8_norm_quant_norms_quantize_as_the_products_would():
    """add_rms_norm_fp8's q and scale are the per-token quantization the fp8 products make of the norm's output
    (quantize_activations_fp8 rounds through them), and its first two outputs add_rms_norm's."""
    from graphkiln.models.norm_fp8 import add_rms_norm_fp8
    from graphkiln.models.quantized_linear import quantize_activations_fp8

    x, r = torch.randn(6, 96, dtype=torch.bfloat16), torch.randn(6, 96, dtype=torch.bfloat16)
    w = torch.rand(96, dtype=torch.bfloat16) + 0.5
    x[2] = 0  # an all-zero row: the smallest scale, zeros out
    r[2] = 0
    total, out, q, scale = add_rms_norm_fp8(x, r, w, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip((total, out), torch.ops.graphkiln.add_rms_norm(x, r, w, 1e-5)))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float() * scale, quantize_activations_fp8(out, False, None))
    assert torch.equal(q[2].float(), torch.zeros(96))
