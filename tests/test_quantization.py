"""Quantized weights: the ops and quantizers against float32, and pre-quantized fp8 checkpoints against
transformers on their dequantized weights (compile-time fp8/int4 artifacts: test_quantized_artifacts.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import graphkiln
from artifact_helpers import ENGINE
from graphkiln import CompileConfig
from graphkiln.errors import ConfigError, ModelFileError, UnsupportedModelError, WeightMismatchError
from graphkiln.models.loader import load_model
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
from quant_helpers import (
    BLOCK_FP8_CONFIG, FP8, autofp8_config, compressed_tensors_config, modelopt_config, relative_error,
    top1_agreement, with_quantization_config, write_fp8_checkpoint,
)

if TYPE_CHECKING:
    from conftest import Checkpoint, CheckpointFactory

QWEN3_BLOCKS = dict(hidden_size=192, intermediate_size=384, num_attention_heads=2, num_key_value_heads=2, head_dim=64)


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
    groups = w.unflatten(-1, (2, 128))
    span = groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)  # each group's range, widened to hold 0
    assert torch.allclose(scales[span > 0], span[span > 0] / 15)  # the range spans all 16 levels
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


def _scaled_weight(weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The fp8 weight in float32 times its scales, expanded here rather than by dequantize_fp8 (under test): one
    per output row [N], or one per 128 x 128 block [ceil(N/128), ceil(K/128)]."""
    n, k = weight.shape
    if w_scale.dim() == 2:
        return weight.float() * w_scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return weight.float() * w_scale.reshape(-1, 1)


def _fp8_reference(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """x rounded through fp8 with the given (broadcast) scale, times the scaled weight, in float32."""
    xq = (x / x_scale).clamp(-448, 448).to(FP8).float() * x_scale
    return xq @ _scaled_weight(weight, w_scale).t()


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
    exact = xb @ _scaled_weight(weight, w_scale).t()
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
    levels = torch.stack((qweight & 15, qweight >> 4), dim=-1).flatten(-2).float()  # two 4-bit levels a byte
    per_input = lambda t: t.float().repeat_interleave(64, dim=-1)  # noqa: E731  (a group's value at each input)
    want = x @ ((levels - per_input(zeros)) * per_input(scales)).t()
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
    _check_against_dequantized(out, reference, llama, ids)


def _check_against_dequantized(checkpoint: Path, reference, llama: Checkpoint, ids: list[int]) -> None:
    """graphkiln's logits on `checkpoint` within 5% of those of `reference`, the float32 model of its dequantized
    weights, with top-1 agreement of 95%: a bound that tells fp8 from the original model."""
    ours = graphkiln.LLM.eager(checkpoint, **ENGINE).score(ids)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    assert relative_error(ours, ref) < 0.05 and top1_agreement(ours, ref) >= 0.95
    assert relative_error(llama.reference_logits(ids), ref) > 0.05


@pytest.mark.parametrize("activations", ["static", "dynamic"])
def test_autofp8_checkpoint_matches_its_dequantized_reference(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path, activations: str
) -> None:
    """AutoFP8: one scale a weight and, when static, a calibrated input scale, both as 0-dimensional tensors."""
    ids = random_ids(48)
    reference = write_fp8_checkpoint(llama.path, llama.model, tmp_path / "fp8", "autofp8", activations=activations,
                                     calibration=ids)
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").shape == ()
    qkv = load_model(tmp_path / "fp8").model.layers[0].self_attn.qkv_proj
    assert (qkv.input_scale is not None) == (activations == "static")
    _check_against_dequantized(tmp_path / "fp8", reference, llama, ids)


@pytest.mark.parametrize("layout,weights", [("modelopt", "tensor"), ("modelopt-file", "channel")])
def test_modelopt_fp8_checkpoint_matches_its_dequantized_reference(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path, layout: str, weights: str
) -> None:
    """ModelOpt's FP8 (0-dimensional scales, static activations; its config in config.json) and
    FP8_PER_CHANNEL_PER_TOKEN (its config in an hf_quant_config.json), each with an fp8 KV cache's scales, which
    the loader reads past."""
    ids = random_ids(48)
    reference = write_fp8_checkpoint(llama.path, llama.model, tmp_path / "fp8", layout, weights, calibration=ids)
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.k_proj.k_scale" in f.keys()
    assert (tmp_path / "fp8" / "hf_quant_config.json").is_file() == (layout == "modelopt-file")
    qkv = load_model(tmp_path / "fp8").model.layers[0].self_attn.qkv_proj
    assert (qkv.input_scale is not None) == (weights == "tensor")
    _check_against_dequantized(tmp_path / "fp8", reference, llama, ids)


def test_compressed_tensors_kv_cache_scales_are_read_past(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """A kv_cache_scheme's k_scale / v_scale tensors: the cache keeps the model dtype, the weights load as ever."""
    ids = random_ids(48)
    write_fp8_checkpoint(llama.path, llama.model, tmp_path / "plain", "compressed-tensors")
    with_kv = Path(shutil.copytree(tmp_path / "plain", tmp_path / "kv"))
    config = json.loads((with_kv / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True,
                                                        "strategy": "tensor", "dynamic": False}
    (with_kv / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(with_kv / "model.safetensors"))
    for layer in range(2):
        tensors.update({f"model.layers.{layer}.self_attn.{kv}_scale": torch.tensor(0.05) for kv in "kv"})
    save_file(tensors, str(with_kv / "model.safetensors"), metadata={"format": "pt"})
    plain = graphkiln.LLM.eager(tmp_path / "plain", **ENGINE).score(ids)
    assert torch.equal(graphkiln.LLM.eager(with_kv, **ENGINE).score(ids), plain)
    with pytest.raises(WeightMismatchError, match="'model.layers.0.self_attn.k_scale' has no place"):
        load_model(_unquantized_with_kv_scales(llama, tmp_path))


def _unquantized_with_kv_scales(llama: Checkpoint, tmp_path: Path) -> Path:
    """KV cache scales in a checkpoint that declares no quantization are not read past."""
    dest = Path(shutil.copytree(llama.path, tmp_path / "unquantized"))
    tensors = load_file(str(dest / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("layout,scale", [("block", "weight_scale_inv"), ("compressed-tensors", "weight_scale")])
def test_block_fp8_checkpoint_matches_its_dequantized_reference(
    hf_checkpoint: CheckpointFactory, random_ids: Callable[..., list[int]], tmp_path: Path, layout: str, scale: str
) -> None:
    """Qwen3's layout (`weight_scale_inv`) and llm-compressor's FP8_BLOCK (compressed-tensors, `weight_scale`):
    128 x 128 blocks, partial ones at the edges (192 = 128 + 64), q/k/v and gate/up fused."""
    ckpt = hf_checkpoint("qwen3", **QWEN3_BLOCKS)
    ids = random_ids(48)
    reference = write_fp8_checkpoint(ckpt.path, ckpt.model, tmp_path / "fp8", layout, weights="block")
    net = load_model(tmp_path / "fp8")
    qkv = net.model.layers[0].self_attn.qkv_proj
    assert qkv.describe() == "fp8 e4m3, 128x128 block weight scales, dynamic per-1x128-group activations"
    assert getattr(qkv, scale).shape == (3, 2)
    assert getattr(net.model.layers[0].self_attn.o_proj, scale).shape == (2, 1)
    ours = graphkiln.LLM.eager(tmp_path / "fp8", **ENGINE).score(ids)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    assert relative_error(ours, ref) < 0.05 and top1_agreement(ours, ref) >= 0.95


def test_unsupported_schemes_are_named_with_what_is_supported(llama: Checkpoint, tmp_path: Path) -> None:
    hqq = with_quantization_config(llama.path, tmp_path / "hqq", {"quant_method": "hqq", "nbits": 4})
    with pytest.raises(UnsupportedModelError, match=r"quant_method 'hqq' is not supported; graphkiln loads compressed-tensors fp8"):
        load_model(hqq)
    int_fp8 = compressed_tensors_config("channel", "dynamic")
    int_fp8["config_groups"]["group_0"]["weights"].update(type="int")
    with pytest.raises(UnsupportedModelError, match=r"config.json: quantization_config: int8 weights with "
                                                    r"input_activations .*type='float'"):
        load_model(with_quantization_config(llama.path, tmp_path / "int-fp8", int_fp8))
    blocks = {**BLOCK_FP8_CONFIG, "weight_block_size": [64, 64]}
    with pytest.raises(UnsupportedModelError, match=r"weight_block_size \[64, 64\] is not supported"):
        load_model(with_quantization_config(llama.path, tmp_path / "b64", blocks))
    for algo in ("NVFP4", "FP8_PB_WO"):
        modelopt = {**modelopt_config("tensor"), "quant_algo": algo}
        with pytest.raises(UnsupportedModelError, match=f"ModelOpt quant_algo '{algo}' is not supported"):
            load_model(with_quantization_config(llama.path, tmp_path / algo, modelopt))
    excluded = {**modelopt_config("tensor"), "ignore": ["lm_head", "model.layers.*.mlp.down_proj"]}
    with pytest.raises(UnsupportedModelError, match=r"excluded \['model.layers.\*.mlp.down_proj'\]"):
        load_model(with_quantization_config(llama.path, tmp_path / "excluded", excluded))
    write_fp8_checkpoint(llama.path, llama.model, tmp_path / "broken", "modelopt-file", "channel")
    (tmp_path / "broken" / "hf_quant_config.json").write_text('{"producer": {}}')
    with pytest.raises(ModelFileError, match=r"hf_quant_config.json: unreadable \(KeyError\('quantization'\)\)"):
        load_model(tmp_path / "broken")
    kept = {**autofp8_config("dynamic"), "ignored_layers": ["lm_head", "model.layers.1.mlp.down_proj"]}
    with pytest.raises(UnsupportedModelError, match=r"ignored_layers \['model.layers.1.mlp.down_proj'\]"):
        load_model(with_quantization_config(llama.path, tmp_path / "kept", kept))
    with pytest.raises(ConfigError, match="quantization='fp8', but .* is already quantized"):
        load_model(with_quantization_config(llama.path, tmp_path / "fp8", compressed_tensors_config("channel", "dynamic")),
                   quantization="fp8")
    with pytest.raises(ConfigError, match=r"CompileConfig.quantization='nf4'; use one of \('fp8', 'int8', 'int4'\)"):
        CompileConfig(quantization="nf4")


def test_block_fp8_refuses_fused_projections_that_split_a_block(
    hf_checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    ckpt = hf_checkpoint("qwen3", **{**QWEN3_BLOCKS, "num_key_value_heads": 1})  # k, v: 64 outputs each
    write_fp8_checkpoint(ckpt.path, ckpt.model, tmp_path / "fp8", "block")
    with pytest.raises(UnsupportedModelError, match=r"fused projections of sizes \(128, 64, 64\)"):
        load_model(tmp_path / "fp8")


Q_PROJ = "model.layers.0.self_attn.q_proj"
CORRUPT_FP8 = {  # (layout, activations, tensor, how it is corrupted, what the error says)
    "input-scale-of-dynamic": ("compressed-tensors", "dynamic", "input_scale", lambda t: torch.tensor([0.01]),
                               "no place for a 'input_scale' tensor"),
    "e5m2-weight": ("compressed-tensors", "dynamic", "weight", lambda t: t.float().to(torch.float8_e5m2),
                    "dtype torch.float8_e5m2, the checkpoint's quantization_config needs torch.float8_e4m3fn"),
    "integer-scales": ("compressed-tensors", "dynamic", "weight_scale", lambda t: t.to(torch.int32),
                       "dtype torch.int32, but the format stores floating-point scales"),
    "integer-block-scales": ("block", "dynamic", "weight_scale_inv", lambda t: t.to(torch.int32),
                             "dtype torch.int32, but the format stores floating-point scales"),
    "negative-scale": ("compressed-tensors", "dynamic", "weight_scale", lambda t: -t, r"scales are >= 0"),
    "zero-input-scale": ("compressed-tensors", "static", "input_scale", lambda t: t * 0, r"scales are > 0"),
}


@pytest.mark.parametrize("case", CORRUPT_FP8)
def test_a_corrupt_fp8_tensor_is_named(llama: Checkpoint, hf_checkpoint: CheckpointFactory,
                                       random_ids: Callable[..., list[int]], tmp_path: Path, case: str) -> None:
    """One tensor of a pre-quantized checkpoint changed as no writer of its format would: an error naming the
    tensor, never a crash in torch or logits from scales the format cannot hold."""
    layout, activations, kind, corrupt, says = CORRUPT_FP8[case]
    ckpt = hf_checkpoint("qwen3", **QWEN3_BLOCKS) if layout == "block" else llama
    write_fp8_checkpoint(ckpt.path, ckpt.model, tmp_path / "fp8", layout, "block" if layout == "block" else "channel",
                         activations, random_ids(48))
    path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(path))
    name = f"{Q_PROJ}.{kind}"
    tensors[name] = corrupt(tensors.get(name, tensors[f"{Q_PROJ}.weight"]))
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(WeightMismatchError, match=rf"{path}: tensor '{name}'.*{says}"):
        load_model(tmp_path / "fp8")


MALFORMED_QC = {
    "a-list": ([1], r"config.json: field 'quantization_config' is \[1\]; it must be an object"),
    "groups-a-list": ({**compressed_tensors_config("channel", "dynamic"), "config_groups": [1]},
                      r"config_groups \[1\] \(an object of named groups\) is not supported"),
    "ignored-numbers": ({**autofp8_config("dynamic"), "ignored_layers": [1]},
                        r"ignored_layers \[1\] \(a list of module names\) is not supported"),
    "ignore-a-string": ({**modelopt_config("tensor"), "ignore": "lm_head"},
                        r"ignore 'lm_head' \(a list of module names\) is not supported"),
    "blocks-flat": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "modules_in_block_to_quantize": ["q_proj"]},
                    r"modules_in_block_to_quantize \['q_proj'\] \(a list of lists of module names\)"),
    "not-convert-numbers": ({"quant_method": "awq", "bits": 4, "group_size": 128, "modules_to_not_convert": [1]},
                            r"modules_to_not_convert \[1\] \(a list of module names\)"),
}


@pytest.mark.parametrize("case", MALFORMED_QC)
def test_quantization_config_fields_of_the_wrong_type_are_named(llama: Checkpoint, tmp_path: Path, case: str) -> None:
    qc, says = MALFORMED_QC[case]
    with pytest.raises(UnsupportedModelError, match=says):
        load_model(with_quantization_config(llama.path, tmp_path / case, qc))
