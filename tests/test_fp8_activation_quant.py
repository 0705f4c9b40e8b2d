"""fp8_activation_quant: off unless named, rewrites only the compiles specialized above FEW_ROWS tokens, Inductor
fuses the quantization into the RMSNorm and SiLU-mul kernels, and the rewritten engine's logits stay within fp8
rounding of the unrewritten one's; graphkiln::fp8_scaled_mm's CPU reference against fp8_linear's."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, EngineConfig
from graphkiln.compiler.compile import compile_module
from graphkiln.errors import ConfigError
from graphkiln.kernels.few_rows import FEW_ROWS
from graphkiln.models import load_model
from graphkiln.models.fp8_scaled_mm import fp8_scaled_mm, quantize_per_token
from graphkiln.models.quantized_linear import fp8_linear, quantize_fp8
from graphkiln.models.tiny import tiny_model_dir
from graphkiln.passes.dump import kernel_counts
from graphkiln.passes.manager import PassManager
from graphkiln.passes.pipeline import default_passes
from graphkiln.runtime.builder import build_engine

PASS = "fp8_activation_quant"
TOKENS = 80  # a prefill size above FEW_ROWS, compiled specialized
INDUCTOR = f"{len(default_passes()) + 1:02d}-inductor"  # the dumps' Inductor code comes after every pass


def test_the_pass_is_off_unless_named_and_names_are_checked() -> None:
    assert PASS in PassManager(default_passes()).disabled
    assert PASS not in PassManager(default_passes(), enabled=[PASS]).disabled
    assert PASS in PassManager(default_passes(), disabled=[PASS], enabled=[]).disabled
    with pytest.raises(ConfigError, match="enabled_passes: unknown pass no_such_pass"):
        PassManager(default_passes(), enabled=["no_such_pass"])
    with pytest.raises(ConfigError, match="both in disabled_passes and enabled_passes"):
        CompileConfig(disabled_passes=(PASS,), enabled_passes=(PASS,))


@pytest.mark.parametrize("rows", [FEW_ROWS + 1, 128])
def test_fp8_scaled_mm_of_per_token_quantized_rows_is_fp8_linear(rows: int) -> None:
    """The op on the pass's quantization equals fp8_linear, which quantizes x the same way above FEW_ROWS rows,
    and both stay within fp8 rounding of the float32 product."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).to(torch.bfloat16)
    weight, scale = quantize_fp8(torch.randn(80, 96, generator=gen))
    xq, x_scale = quantize_per_token(x)
    assert xq.dtype == torch.float8_e4m3fn and x_scale.shape == (rows, 1)
    y = fp8_scaled_mm(xq, x_scale, weight, scale, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 80)
    torch.testing.assert_close(y, fp8_linear(x, weight, scale, None), rtol=0, atol=0)
    exact = x.float() @ (weight.float() * scale[:, None]).t()
    assert ((y.float() - exact).abs().amax(-1) < 0.08 * exact.abs().amax(-1)).all()


def _compiled_tiny(enabled: tuple[str, ...], dump_dir: Path | None = None):
    """The tiny model quantized to fp8, compiled with one specialized size, in an engine without CUDA graphs."""
    net = load_model(tiny_model_dir(), "cpu", "float32", quantization="fp8")
    config = CompileConfig(quantization="fp8", specialize_sizes=(TOKENS,), enabled_passes=enabled,
                           dump_dir=str(dump_dir) if dump_dir else None)
    compiled, report = compile_module(net, config)
    engine = EngineConfig(kv_cache_tokens=1024, decode_batch_sizes=(1,), prefill_token_buckets=(TOKENS,))
    return graphkiln.LLM(build_engine(net, compiled, engine), None), {r.name: r for r in report.passes}


def _op_calls(llm: graphkiln.LLM, ids: list[int]) -> tuple[torch.Tensor, dict[str, int]]:
    """The logits of `ids` and how many times each quantized product ran for them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = llm.score(ids)
    calls = [e.name for e in prof.events()  # a call from a compiled piece (not the dispatcher's nested records)
             if e.name.startswith("graphkiln::fp8_") and "CompiledFxGraph" in getattr(e.cpu_parent, "name", "")]
    return logits, dict(Counter(calls))


@pytest.mark.slow
def test_rewritten_prefill_fuses_the_quantization_and_matches_the_unrewritten_logits(tmp_path: Path) -> None:
    pytest.importorskip("depyf", reason="the dumps need depyf")
    off, off_records = _compiled_tiny(())
    with torch._inductor.config.patch(fx_graph_cache=False):  # post-grad passes (and their dumps) run on a miss
        on, on_records = _compiled_tiny((PASS,), tmp_path / "dump")
    assert off_records[PASS].runs == 0 and not off_records[PASS].enabled
    # 3 unique pieces, each compiled dynamic and at TOKENS: only the TOKENS compiles are rewritten, every
    # projection fed by a norm or SiLU-mul: q/k/v of layer 0 | gate_up, down, next q/k/v | gate_up, down
    assert on_records[PASS].runs == 6 and on_records[PASS].matches == 6

    dumps = {p.name: p.read_text() for p in (tmp_path / "dump").glob("*.py")}
    after = {name: text for name, text in dumps.items() if name.startswith(f"05-{PASS}.after.")}
    for name, text in after.items():
        rewritten = len(re.findall(r"graphkiln\.fp8_scaled_mm\.default\(", text))
        assert rewritten == ({"submod_0": 1, "submod_2": 3, "submod_8": 2}[name.split(".")[2]]
                             if name.endswith(f".{TOKENS}.py") else 0), name
    for piece in ("submod_0", "submod_2", "submod_8"):  # the quantization joined existing kernels: none added
        fused = kernel_counts(dumps[f"{INDUCTOR}.{piece}.{TOKENS}.py"])
        assert fused["kernels"] == kernel_counts(dumps[f"{INDUCTOR}.{piece}.dynamic.py"])["kernels"], piece
    assert "Float8_e4m3fn" in dumps[f"{INDUCTOR}.submod_2.{TOKENS}.py"]  # Inductor's kernels write fp8

    ids = list(range(7, 7 + TOKENS))
    want, off_calls = _op_calls(off, ids)
    got, on_calls = _op_calls(on, ids)
    assert off_calls == {"graphkiln::fp8_linear": 16}  # 4 layers x (q/k/v, o, gate_up, down)
    assert on_calls == {"graphkiln::fp8_linear": 4, "graphkiln::fp8_scaled_mm": 12}  # only o_proj left
    # float32: x is quantized from the same float32 values either way, so the rewrite changes where the rounding
    # happens (inside Inductor's norm and SiLU-mul kernels), not its result
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    longer = list(range(7, 8 + TOKENS))  # past the specialized bucket: the dynamic compile, which the pass left alone
    assert _op_calls(on, longer)[1] == {"graphkiln::fp8_linear": 16}
    torch.testing.assert_close(on.score(longer), off.score(longer), rtol=0, atol=0)
