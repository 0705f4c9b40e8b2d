"""Quantized weights: the ops and quantizers against float32, pre-quantized fp8 checkpoints against transformers on
their dequantized weights, and compile-time fp8/int4 artifacts of the trained tiny model."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors import safe_open

import graphkiln
from artifact_helpers import ENGINE, RESULT_PREFIX, SMALL_ENGINE, run_python_json
from bench import quality
from graphkiln import CompileConfig, cli
from graphkiln.compiler.artifacts import QUANTIZED_FILE
from graphkiln.compiler.compile import CompileReport
from graphkiln.compiler.counters import torch_compile_events
from graphkiln.errors import ArtifactError, ConfigError, UnsupportedModelError
from graphkiln.models.loader import load_model
from graphkiln.models.quantized_layers import projections_quantized
from graphkiln.models.quantized_linear import (
    dequantize_fp8,
    dequantize_int4,
    fp8_linear,
    int4_group_size,
    int4_linear,
    tinygemm_params,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    unpack_int4,
)
from graphkiln.models.tiny import tiny_model_dir
from quant_helpers import BLOCK_FP8_CONFIG, FP8, compressed_tensors_config, write_fp8_checkpoint

if TYPE_CHECKING:
    from conftest import Checkpoint, CheckpointFactory

QWEN3_BLOCKS = dict(hidden_size=192, intermediate_size=384, num_attention_heads=2, num_key_value_heads=2, head_dim=64)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def top1_agreement(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()


# ---- packing, quantizers and the ops' CPU bodies


def test_int4_packing_round_trips_and_puts_even_k_in_the_low_nibble() -> None:
    q = torch.randint(0, 16, (5, 12), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert pack_int4(torch.tensor([[3, 10]])).item() == 3 + (10 << 4)


def test_int4_quantizer_keeps_every_weight_within_half_a_step() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    w[0, :128] = 0.0  # an all-zero group
    w[1, :128] = w[1, :128].abs()  # a group of one sign
    qweight, scales, zeros = quantize_int4(w, 128)
    assert qweight.shape == (64, 128) and scales.shape == zeros.shape == (64, 2)
    back = dequantize_int4(qweight, scales, zeros, 128)
    step = scales.repeat_interleave(128, 1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(back[0, :128], torch.zeros(128))
    assert zeros.eq(zeros.round()).all() and zeros.min() >= 0 and zeros.max() <= 15


def test_tinygemm_params_give_the_same_weight_within_a_bf16_rounding() -> None:
    """tinygemm dequantizes (q - 8) * scale + zero (its zero point in the float domain); from our scales and
    integer zero points that is each weight within one bfloat16 rounding of the weight's group magnitude."""
    torch.manual_seed(0)
    w = torch.randn(16, 256).to(torch.bfloat16)
    qweight, scales, zeros = quantize_int4(w, 128)
    params = tinygemm_params(scales, zeros)
    assert params.shape == (2, 16, 2) and params.dtype == torch.bfloat16
    q = unpack_int4(qweight).float()
    scale, zero = (params[..., i].t().float().repeat_interleave(128, 1) for i in (0, 1))
    theirs = (q - 8) * scale + zero
    ours = dequantize_int4(qweight, scales, zeros, 128)
    assert ((theirs - ours).abs() <= 8 * scale * 2**-8).all()
    assert not torch.equal(theirs, (q - 8) * scale)  # the zero points moved the weights


def test_int4_group_size_is_128_or_the_largest_power_of_two_dividing_k() -> None:
    assert [int4_group_size(k) for k in (4096, 14336, 688, 200)] == [128, 128, 16, None]  # 200: 8, too small


def test_fp8_quantizer_rounds_each_weight_to_three_mantissa_bits() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 1, 32)[:, None]
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale.shape == (32,)
    back = dequantize_fp8(q, scale)
    normal = w.abs() >= scale[:, None] * 2**-6  # e4m3's smallest normal, in the row's scale
    assert ((back - w).abs()[normal] <= w.abs()[normal] * 2**-4).all()
    torch.testing.assert_close(back.abs().amax(-1), w.abs().amax(-1))  # each row's largest maps to 448 exactly


def _fp8_reference(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """x rounded through fp8 with the given (broadcast) scale, times the dequantized weight, in float32."""
    xq = (x / x_scale).clamp(-448, 448).to(FP8).float() * x_scale
    return xq @ dequantize_fp8(weight, w_scale).t()


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_fp8_linear_per_channel_matches_float32_with_per_token_activations(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    weight, w_scale = quantize_fp8(torch.randn(48, 200, generator=gen))
    y = fp8_linear(x.to(torch.bfloat16), weight, w_scale, None)
    assert y.shape == (rows, 48) and y.dtype == torch.bfloat16
    xb = x.to(torch.bfloat16).float()
    want = _fp8_reference(xb, weight, w_scale, xb.abs().amax(-1, keepdim=True) / 448)
    torch.testing.assert_close(y.float(), want, rtol=2**-7, atol=1e-5 * want.abs().max().item())
    exact = xb @ dequantize_fp8(weight, w_scale).t()
    assert 0 < relative_error(y.float(), exact) < 0.05  # the activations were rounded, not much


def test_fp8_linear_static_scale_and_block_scales_match_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 300, generator=gen)
    weight = torch.randn(200, 300, generator=gen).to(FP8)
    blocks = torch.rand(2, 3, generator=gen) + 0.5  # ceil(200 / 128) x ceil(300 / 128)
    static = torch.tensor([0.01])
    channel = torch.rand(200, generator=gen)
    torch.testing.assert_close(fp8_linear(x, weight, channel, static), _fp8_reference(x, weight, channel, static))
    groups = torch.nn.functional.pad(x, (0, 84)).unflatten(-1, (3, 128))
    group_scale = (groups.abs().amax(-1, keepdim=True) / 448).expand(-1, -1, 128).flatten(-2)[:, :300]
    torch.testing.assert_close(fp8_linear(x, weight, blocks, None), _fp8_reference(x, weight, blocks, group_scale))


def test_int4_linear_matches_float32() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 256, generator=gen)
    qweight, scales, zeros = quantize_int4(w, 64)
    x = torch.randn(3, 256, generator=gen)
    want = x @ dequantize_int4(qweight, scales, zeros, 64).t()
    torch.testing.assert_close(int4_linear(x, qweight, scales, zeros, 64), want)
    assert relative_error(want, x @ w.t()) < 0.1


# ---- pre-quantized checkpoints


CT_CASES = [("channel", "dynamic"), ("tensor", "static"), ("channel", "static"), ("tensor", "dynamic")]


@pytest.mark.parametrize("weights,activations", CT_CASES, ids=[f"{w}-{a}" for w, a in CT_CASES])
def test_compressed_tensors_fp8_checkpoint_matches_its_dequantized_reference(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path, weights: str, activations: str
) -> None:
    ids = random_ids(48)
    out = tmp_path / "fp8"
    reference = write_fp8_checkpoint(llama.path, llama.model, out, "compressed-tensors", weights, activations, ids)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == FP8
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == ((1,) if weights == "tensor" else (64, 1))
    llm = graphkiln.LLM.eager(out, **ENGINE)
    ours = llm.score(ids)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    assert relative_error(ours, ref) < 0.05 and top1_agreement(ours, ref) >= 0.95
    assert relative_error(llama.reference_logits(ids), ref) > 0.05  # the bound above tells fp8 from the original


def test_block_fp8_checkpoint_matches_its_dequantized_reference(
    hf_checkpoint: CheckpointFactory, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """Qwen3's layout: 128 x 128 blocks, partial ones at the edges (192 = 128 + 64), q/k/v and gate/up fused."""
    ckpt = hf_checkpoint("qwen3", **QWEN3_BLOCKS)
    ids = random_ids(48)
    reference = write_fp8_checkpoint(ckpt.path, ckpt.model, tmp_path / "fp8", "block")
    net = load_model(tmp_path / "fp8")
    assert net.model.layers[0].self_attn.qkv_proj.weight_scale_inv.shape == (3, 2)
    assert net.model.layers[0].self_attn.o_proj.weight_scale_inv.shape == (2, 1)
    ours = graphkiln.LLM.eager(tmp_path / "fp8", **ENGINE).score(ids)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    assert relative_error(ours, ref) < 0.05 and top1_agreement(ours, ref) >= 0.95


def _with_quantization_config(source: Path, dest: Path, qc: dict) -> Path:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return dest


def test_unsupported_schemes_are_named_with_what_is_supported(llama: Checkpoint, tmp_path: Path) -> None:
    gptq = _with_quantization_config(llama.path, tmp_path / "gptq", {"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedModelError, match=r"quant_method 'gptq' is not supported; graphkiln loads compressed-tensors fp8"):
        load_model(gptq)
    w4 = compressed_tensors_config("channel", "dynamic")
    w4["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int", strategy="group", group_size=128)
    w4["config_groups"]["group_0"]["input_activations"] = None
    with pytest.raises(UnsupportedModelError, match=r"config.json: quantization_config: weights .*num_bits=4"):
        load_model(_with_quantization_config(llama.path, tmp_path / "w4", w4))
    blocks = {**BLOCK_FP8_CONFIG, "weight_block_size": [64, 64]}
    with pytest.raises(UnsupportedModelError, match=r"weight_block_size \[64, 64\] is not supported"):
        load_model(_with_quantization_config(llama.path, tmp_path / "b64", blocks))
    with pytest.raises(ConfigError, match="quantization='fp8', but .* is already quantized"):
        load_model(_with_quantization_config(llama.path, tmp_path / "fp8", compressed_tensors_config("channel", "dynamic")),
                   quantization="fp8")
    with pytest.raises(ConfigError, match=r"CompileConfig.quantization='int8'; use one of \('fp8', 'int4'\)"):
        CompileConfig(quantization="int8")


def test_block_fp8_refuses_fused_projections_that_split_a_block(
    hf_checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    ckpt = hf_checkpoint("qwen3", **{**QWEN3_BLOCKS, "num_key_value_heads": 1})  # k, v: 64 outputs each
    write_fp8_checkpoint(ckpt.path, ckpt.model, tmp_path / "fp8", "block")
    with pytest.raises(UnsupportedModelError, match=r"fused projections of sizes \(128, 64, 64\)"):
        load_model(tmp_path / "fp8")


# ---- compile-time quantization of the trained tiny model


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tiny model directory, whose weights a test may overwrite."""
    return Path(shutil.copytree(tiny_model_dir(), tmp_path_factory.mktemp("tiny") / "tiny"))


@pytest.fixture(scope="module")
def compiled_quantized(tiny_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, CompileReport]]:
    """The tiny model compiled with each scheme: (artifact, compile report), its dumps in <artifact>-dumps."""
    root = tmp_path_factory.mktemp("quantized")
    outs = {}
    for scheme in ("fp8", "int4"):
        config = CompileConfig(quantization=scheme, dump_dir=root / f"{scheme}-dumps")
        _, report = graphkiln.compile_model(tiny_copy, root / scheme, config, engine=SMALL_ENGINE)
        report.counters.expect(graphs_traced=1, inductor_compiles=3)
        outs[scheme] = (root / scheme, report)
    return outs


@pytest.fixture(scope="module")
def quantized(compiled_quantized: dict[str, tuple[Path, CompileReport]]) -> dict[str, Path]:
    return {scheme: out for scheme, (out, _) in compiled_quantized.items()}


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_quantized_graph_calls_the_quantized_ops_and_the_linear_passes_leave_them(
    compiled_quantized: dict[str, tuple[Path, CompileReport]], scheme: str
) -> None:
    out, report = compiled_quantized[scheme]
    pieces = "".join(p.read_text() for p in out.parent.joinpath(f"{scheme}-dumps").glob("*-split.submod_*.py"))
    assert pieces.count(f"graphkiln.{scheme}_linear") >= 16  # 4 projections x 4 layers
    assert "graphkiln.silu_mul_linear" not in pieces
    records = {r.name: r for r in report.passes}
    assert records["linear_op"].runs > 0 and records["linear_op"].matches == 0
    assert records["silu_mul_linear"].runs == 1 and records["silu_mul_linear"].matches == 0


@pytest.mark.slow
def test_silu_mul_epilogue_compiles_the_fp8_mlp_activation_into_its_product_with_the_same_scores(
    quantized: dict[str, Path], tmp_path: Path
) -> None:
    """Enabled, silu_mul_epilogue turns each layer's fp8 gate/up product and its activation into one
    graphkiln::fp8_linear_silu_mul; the artifact scores a prompt as the default one does (on the CPU the op is
    the product, then the activation rounded once, as Inductor's fused kernel rounds it)."""
    config = CompileConfig(quantization="fp8", enabled_passes=("silu_mul_epilogue",), dump_dir=tmp_path / "dumps")
    _, report = graphkiln.compile_model(tiny_model_dir(), tmp_path / "fp8", config, engine=SMALL_ENGINE)
    records = {r.name: r for r in report.passes}
    assert records["silu_mul_epilogue"].matches == 4 and records["silu_mul_linear"].matches == 0  # 4 layers
    pieces = "".join(p.read_text() for p in (tmp_path / "dumps").glob("*-split.submod_*.py"))
    assert pieces.count("graphkiln.fp8_linear_silu_mul") >= 4
    ids = list(range(5, 133))
    ours = graphkiln.load(tmp_path / "fp8", **ENGINE).score(ids)
    default = graphkiln.load(quantized["fp8"], **ENGINE).score(ids)
    torch.testing.assert_close(ours, default, rtol=2e-2, atol=2e-2)
    assert top1_agreement(ours, default) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("scheme,max_error,min_top1", [("fp8", 0.1, 0.9), ("int4", 0.2, 0.8)])
def test_quantized_tiny_logits_stay_close_to_bf16(
    quantized: dict[str, Path], scheme: str, max_error: float, min_top1: float
) -> None:
    ids = list(range(5, 133))
    ref = graphkiln.LLM.eager("tiny", **ENGINE).score(ids)
    before = torch_compile_events()
    llm = graphkiln.load(quantized[scheme], **ENGINE)
    ours = llm.score(ids)
    after = torch_compile_events()
    for event in ("dynamo_graphs", "inductor_compiles"):  # nothing traced or compiled by the load or the call
        assert after[event] == before[event], event
    error, top1 = relative_error(ours, ref), top1_agreement(ours, ref)
    print(f"{scheme}: logits vs bf16 relative error {error:.4f}, top-1 agreement {top1:.3f}")
    assert 0 < error < max_error and top1 >= min_top1


@pytest.mark.slow
def test_quantized_tiny_held_out_perplexity_within_target(
    quantized: dict[str, Path], held_out_windows: list[list[int]]
) -> None:
    """fp8 within 1% of bf16, int4 within 5% (the quality goals of quantized weights)."""
    base = quality.perplexity(graphkiln.LLM.eager("tiny", **ENGINE), held_out_windows)
    fp8 = quality.perplexity(graphkiln.load(quantized["fp8"], **ENGINE), held_out_windows)
    int4 = quality.perplexity(graphkiln.load(quantized["int4"], **ENGINE), held_out_windows)
    print(f"held-out perplexity: bf16 {base:.3f}, fp8 {fp8:.3f} ({fp8 / base - 1:+.2%}), int4 {int4:.3f} ({int4 / base - 1:+.2%})")
    assert base < fp8 < base * 1.01 and base < int4 < base * 1.05


@pytest.mark.slow
def test_quantized_weights_are_stored_once_and_a_warm_load_neither_quantizes_nor_reads_the_linears(
    quantized: dict[str, Path], tiny_copy: Path
) -> None:
    out = quantized["fp8"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert QUANTIZED_FILE in manifest["files"] and manifest["config"]["quantization"] == "fp8"
    with safe_open(str(out / QUANTIZED_FILE), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.qkv_proj.weight").dtype == FP8
    assert "model.layers.0.mlp.down_proj.weight_scale" in names and not any("embed" in n or "norm" in n for n in names)
    ids = list(range(5, 40))
    quantized_before = projections_quantized()
    assert quantized_before > 0  # the fixture's compiles quantized in this process, so the counter counts
    before = graphkiln.load(out, **ENGINE).score(ids)
    _zero_projection_weights(tiny_copy / "model.safetensors")  # same header, so the artifact still matches
    after = graphkiln.load(out, **ENGINE).score(ids)
    assert torch.equal(before, after)
    assert projections_quantized() == quantized_before  # the two loads quantized nothing
    assert not torch.equal(graphkiln.LLM.eager(tiny_copy, **ENGINE).score(ids), graphkiln.LLM.eager("tiny", **ENGINE).score(ids))


def _zero_projection_weights(path: Path) -> None:
    """Overwrite the bytes of every q/k/v/o/gate/up/down weight in a safetensors file, keeping its header."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    for name, info in header.items():
        if name != "__metadata__" and name.endswith("_proj.weight"):
            start, end = info["data_offsets"]
            data[8 + length + start : 8 + length + end] = bytes(end - start)
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_tampered_or_missing_quantized_weights_are_artifact_errors(quantized: dict[str, Path], tmp_path: Path) -> None:
    art = Path(shutil.copytree(quantized["int4"], tmp_path / "art"))
    data = bytearray((art / QUANTIZED_FILE).read_bytes())
    data[-1] ^= 1
    (art / QUANTIZED_FILE).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=rf"{QUANTIZED_FILE}: sha256 differs from manifest.json"):
        graphkiln.load(art, **ENGINE)
    (art / QUANTIZED_FILE).unlink()
    with pytest.raises(ArtifactError, match=rf"{QUANTIZED_FILE}: listed in manifest.json but missing"):
        graphkiln.load(art, **ENGINE)


@pytest.mark.slow
def test_inspect_shows_each_layers_format(quantized: dict[str, Path], capsys) -> None:
    assert cli.main(["inspect", str(quantized["int4"])]) == 0
    text = capsys.readouterr().out
    assert f"quantization  int4, group weight scales, weight-only (quantized by compile-model), weights in {QUANTIZED_FILE}" in text
    assert "layers 0-3 self_attn.qkv_proj        int4, asymmetric, groups of 128, weight-only" in text
    assert "layers 0-3 mlp.down_proj             int4, asymmetric, groups of 16, weight-only" in text  # K = 688
    assert "lm_head                              float32 (not quantized)" in text


@pytest.mark.slow
def test_prequantized_checkpoint_compiles_into_an_artifact_that_reads_it_as_it_is(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    ids = random_ids(48)
    write_fp8_checkpoint(llama.path, llama.model, tmp_path / "fp8", "compressed-tensors", "tensor", "static", ids)
    manifest, _ = graphkiln.compile_model(tmp_path / "fp8", tmp_path / "art", engine=SMALL_ENGINE)
    quant = manifest["model"]["quantization"]
    assert quant["description"] == "fp8, tensor weight scales, static activations (compressed-tensors checkpoint)"
    assert quant["file"] is None and QUANTIZED_FILE not in manifest["files"]
    assert quant["layers"]["model.layers.1.self_attn.qkv_proj"] == "fp8 e4m3, per-channel weight scales, static per-tensor activations"
    compiled = graphkiln.load(tmp_path / "art", **ENGINE).score(ids)
    eager = graphkiln.LLM.eager(tmp_path / "fp8", **ENGINE).score(ids)
    assert relative_error(compiled, eager) < 1e-4
    code = f"""import json, sys, graphkiln
logits = graphkiln.load({str(tmp_path / "art")!r}, kv_cache_tokens=2048).score({ids!r})
print("{RESULT_PREFIX}" + json.dumps({{"logits": logits.tolist(), "imported": [m for m in ("compressed_tensors", "transformers") if m in sys.modules]}}))
"""
    fresh = run_python_json(code)  # the recorded scheme: config.json is not parsed again, so neither library loads
    assert fresh["imported"] == [] and torch.equal(torch.tensor(fresh["logits"]), compiled)


def test_compile_model_refuses_an_unsupported_scheme_before_writing_anything(llama: Checkpoint, tmp_path: Path) -> None:
    gptq = _with_quantization_config(llama.path, tmp_path / "gptq", {"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedModelError, match="quant_method 'gptq'"):
        graphkiln.compile_model(gptq, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gptq"]
