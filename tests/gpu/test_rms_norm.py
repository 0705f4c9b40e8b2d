"""graphkiln::add_rms_norm on CUDA: the Triton kernel against the model's own ops, inside a CUDA graph, and the
add_rms_norm pass in a compiled tiny engine; the kernel's fp8 output (add_rms_norm_fp8) against quantize_rows, and
the fp8 products taking it against those quantizing their input themselves (whole engines with and without the
fusion: test_fusion_engines_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from graphkiln import CompileConfig
from graphkiln.compiler.compile import compile_module
from graphkiln.llm import resolve_model_dir
from graphkiln.models import load_model
from graphkiln.models.norm import add_rms_norm, add_rms_norm_reference
from graphkiln.models.tokenizer import Tokenizer
from tiny_engines import assert_compiled_agrees, engines


def _inputs(rows: int, width: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, residual = (torch.randn(rows, width, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(width, device="cuda", dtype=dtype, generator=gen)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width", [(1, 2048), (1, 4096), (7, 4096), (300, 8192), (3, 1000)])
def test_kernel_matches_the_models_ops(rows, width, dtype):
    """The sum as the model's add rounds it, bit for bit; the norm within float32's rsqrt and sum order."""
    x, residual, weight = _inputs(rows, width, dtype, rows + width)
    total, out = add_rms_norm(x, residual, weight, 1e-5)
    want_total, want = add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    assert (out == want).float().mean() > 0.95


def test_kernel_replays_inside_a_cuda_graph_with_new_inputs():
    from graphkiln.kernels.rms_norm import add_rms_norm as kernel

    x, residual, weight = _inputs(4, 4096, torch.bfloat16, 0)
    kernel(x, residual, weight, 1e-5)  # built outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total, out = kernel(x, residual, weight, 1e-5)
    fresh = _inputs(4, 4096, torch.bfloat16, 1)
    x.copy_(fresh[0])
    residual.copy_(fresh[1])
    graph.replay()
    want_total, want = kernel(x, residual, weight, 1e-5)
    assert torch.equal(total, want_total) and torch.equal(out, want)


def test_pass_in_a_compiled_bf16_engine_scores_and_decodes_as_the_eager_model():
    """The tiny model compiled with add_rms_norm: logits close to the eager engine's, greedy tokens as the eager
    engine's (up to near-ties), and the same tokens with CUDA graphs as without."""
    model_dir = resolve_model_dir("tiny")
    net, tok = load_model(model_dir, "cuda", "bfloat16"), Tokenizer.from_dir(model_dir)
    compiled, report = compile_module(net, CompileConfig(device="cuda", dtype="bfloat16",
                                                         enabled_passes=("add_rms_norm",)))
    assert {r.name: r for r in report.passes}["add_rms_norm"].matches == 2 * net.cfg.num_layers
    assert_compiled_agrees(*engines((net, compiled, tok)), max_error=2e-2, max_tokens=16)


@pytest.mark.parametrize("rows,width", [(1, 2048), (8, 4096), (64, 4096), (300, 8192), (3, 1000)])
def test_quantizing_kernel_writes_what_quantize_rows_makes_of_its_output(rows, width):
    """add_rms_norm_fp8 on CUDA: the sum and norm of add_rms_norm, and from two rows the norm's fp8 rows and scales
    equal, bit for bit, to fp8_linear.quantize_rows of it (the launch the fp8 product after it no longer makes)."""
    from graphkiln.kernels.fp8_linear import quantize_rows
    from graphkiln.models.norm_fp8 import add_rms_norm_fp8

    x, residual, weight = _inputs(rows, width, torch.bfloat16, rows * width)
    total, out, q, scale = add_rms_norm_fp8(x, residual, weight, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip((total, out), add_rms_norm(x, residual, weight, 1e-5)))
    assert q.shape == (rows, width) and scale.shape == (rows, 1)
    if rows == 1:  # one row goes unquantized into every product: the kernel does not write q
        return
    want_q, want_scale = quantize_rows(out)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("rows", [1, 2, 8, 16, 33, 64, 300])
def test_fp8_products_given_the_quantized_rows_equal_those_quantizing_them(rows):
    """fp8_linear_quantized and fp8_mlp_quantized with quantize_rows' fp8 rows of x equal fp8_linear and fp8_mlp on
    x, bit for bit, at every row count's path (the GEMV at one row, fp8_tma or fp8_mma, torch._scaled_mm)."""
    from graphkiln.kernels.fp8_linear import quantize_rows
    from graphkiln.models.norm_fp8 import fp8_linear_quantized, fp8_mlp_quantized
    from graphkiln.models.quantized_linear import fp8_linear, fp8_mlp, quantize_fp8

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    (w, s), (gate_up, gate_up_s), (down, down_s) = (
        quantize_fp8(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
        for n, k in ((6144, 4096), (2 * 14336, 4096), (4096, 14336)))
    q, scale = quantize_rows(x)
    assert torch.equal(fp8_linear_quantized(x, q, scale, w, s), fp8_linear(x, w, s, None))
    assert torch.equal(fp8_mlp_quantized(x, q, scale, gate_up, gate_up_s, down, down_s),
                       fp8_mlp(x, gate_up, gate_up_s, None, down, down_s))
