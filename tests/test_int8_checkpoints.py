"""Pre-quantized int8 checkpoints (compressed-tensors int-quantized W8A8, pack-quantized W8A16 per channel or in
groups of 128, 8-bit GPTQ) against the float32 model of their dequantized weights and, for W8A16, transformers
reading the same files; what graphkiln does not read of int8, refused by name (on two tensor-parallel ranks:
test_tensor_parallel_quantized.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import LlamaForCausalLM

import graphkiln
from artifact_helpers import ENGINE
from graphkiln import cli
from graphkiln.errors import UnsupportedModelError, WeightMismatchError
from graphkiln.models.int8_linear import Int8Linear
from graphkiln.models.loader import load_model
from int8_checkpoint_helpers import int8_config, write_int8_checkpoint
from quant_helpers import relative_error, rewrite_checkpoint, top1_agreement, with_quantization_config

if TYPE_CHECKING:
    from conftest import Checkpoint, CheckpointFactory

CASES = [("dynamic", "channel"), ("static", "channel"), ("dynamic", "tensor"), ("none", "channel")]
GROUPED = [("none", "group"), ("gptq", "group"), ("gptq_v2", "channel")]
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # inputs of 256 and 512: whole groups of 128
DESCRIBED = {"dynamic": "dynamic per-token int8 activations", "static": "static per-tensor int8 activations",
             "none": "weight-only"}


@pytest.fixture(scope="module")
def int8_checkpoints(llama: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """(activations, weights) -> (checkpoint directory, float32 transformers model of its dequantized weights whose
    projections round their inputs as graphkiln does)."""
    root = tmp_path_factory.mktemp("int8")
    calibration = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    return {(a, w): (root / f"{a}-{w}", write_int8_checkpoint(llama.path, llama.model, root / f"{a}-{w}", a, w,
                                                              calibration)) for a, w in CASES}


def _reference_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("activations,weights", CASES, ids=[f"{a}-{w}" for a, w in CASES])
def test_int8_checkpoint_matches_its_dequantized_reference(
    int8_checkpoints: dict, llama: Checkpoint, random_ids: Callable[..., list[int]], activations: str, weights: str
) -> None:
    """W8A8 rounds each projection's input to int8 (per token, or by the static scale of q, k and v, or gate and up,
    combined); W8A16 (pack-quantized words) keeps it."""
    path, reference = int8_checkpoints[(activations, weights)]
    qkv = load_model(path).model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and qkv.weight.dtype == torch.int8 and qkv.packed == (activations == "none")
    assert qkv.describe() == f"int8, symmetric, per-channel weight scales, {DESCRIBED[activations]}"
    ids = random_ids(48)
    ours = graphkiln.LLM.eager(path, **ENGINE).score(ids)
    ref = _reference_logits(reference, ids)
    assert relative_error(ours, ref) < 1e-4 and top1_agreement(ours, ref) == 1.0
    assert relative_error(llama.reference_logits(ids), ref) > 1e-3  # the bound above tells int8 from the original


@pytest.mark.parametrize("fmt,weights", GROUPED, ids=[f"{f}-{w}" for f, w in GROUPED])
def test_grouped_and_gptq_int8_checkpoints_match_their_dequantized_reference(
    hf_checkpoint: CheckpointFactory, random_ids: Callable[..., list[int]], tmp_path: Path, fmt: str, weights: str
) -> None:
    """Weight-only int8 with a scale per 128 inputs (compressed-tensors' group strategy, GPTQ's group_size 128) or
    per channel (GPTQ's group_size -1); GPTQ's zero points of 128, stored minus one in checkpoint_format gptq."""
    ckpt = hf_checkpoint("llama", **WIDE)
    reference = write_int8_checkpoint(ckpt.path, ckpt.model, tmp_path / fmt, fmt, weights)
    down = load_model(tmp_path / fmt).model.layers[1].mlp.down_proj
    scales = "groups of 128" if weights == "group" else "per-channel weight scales"
    assert down.describe() == f"int8, symmetric, {scales}, weight-only" and down.source == fmt.replace("none", "compressed-tensors")
    ids = random_ids(48)
    ours = graphkiln.LLM.eager(tmp_path / fmt, **ENGINE).score(ids)
    ref = _reference_logits(reference, ids)
    assert relative_error(ours, ref) < 1e-4 and top1_agreement(ours, ref) == 1.0
    assert relative_error(ckpt.reference_logits(ids), ref) > 1e-3


def test_w8a16_checkpoint_matches_transformers_reading_it(
    int8_checkpoints: dict, random_ids: Callable[..., list[int]]
) -> None:
    """transformers reads the same pack-quantized files through compressed-tensors (decompressed to float32)."""
    path, _ = int8_checkpoints[("none", "channel")]
    ids = random_ids(48)
    theirs = _reference_logits(LlamaForCausalLM.from_pretrained(path).eval(), ids)
    assert relative_error(graphkiln.LLM.eager(path, **ENGINE).score(ids), theirs) < 1e-4


def test_symmetric_zero_points_are_read_past_and_others_refused(
    int8_checkpoints: dict, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """Older compressed-tensors versions stored zero points for symmetric int8 too: all zero, they change nothing."""
    path, _ = int8_checkpoints[("static", "channel")]
    prefix = "model.layers.1.mlp.down_proj"

    def zeros(t, value=0):
        t[f"{prefix}.weight_zero_point"] = torch.full((t[f"{prefix}.weight"].shape[0], 1), value, dtype=torch.int8)
        t[f"{prefix}.input_zero_point"] = torch.zeros(1, dtype=torch.int8)

    ids = random_ids(48)
    with_zeros = graphkiln.LLM.eager(rewrite_checkpoint(path, tmp_path / "zeros", zeros), **ENGINE).score(ids)
    assert torch.equal(with_zeros, graphkiln.LLM.eager(path, **ENGINE).score(ids))
    with pytest.raises(UnsupportedModelError, match=rf"tensor '{prefix}.weight_zero_point': non-zero weight_zero_point "
                                                    r"\(asymmetric int8\)"):
        load_model(rewrite_checkpoint(path, tmp_path / "ones", lambda t: zeros(t, 1)))


def test_damaged_int8_tensors_are_named(int8_checkpoints: dict, tmp_path: Path) -> None:
    dynamic, _ = int8_checkpoints[("dynamic", "channel")]
    packed, _ = int8_checkpoints[("none", "channel")]
    prefix = "model.layers.0.mlp.up_proj"
    with pytest.raises(WeightMismatchError, match=rf"'{prefix}.weight': dtype torch.float32, the checkpoint's "
                                                  r"quantization_config needs torch.int8"):
        load_model(rewrite_checkpoint(dynamic, tmp_path / "float", lambda t: t.update({f"{prefix}.weight": t[f"{prefix}.weight"].float()})))
    with pytest.raises(WeightMismatchError, match=rf"'{prefix}.weight_packed': shape \(128, 8\) but config.json and "
                                                  r"quantization_config imply \(128, 16\)"):
        load_model(rewrite_checkpoint(packed, tmp_path / "short", lambda t: t.update({
            f"{prefix}.weight_packed": t[f"{prefix}.weight_packed"][:, :8].contiguous()})))
    with pytest.raises(WeightMismatchError, match=r"weight_shape \[128, 60\] but config.json implies \[128, 64\]"):
        load_model(rewrite_checkpoint(packed, tmp_path / "shape", lambda t: t.update({f"{prefix}.weight_shape": torch.tensor([128, 60])})))
    with pytest.raises(WeightMismatchError, match=rf"checkpoint lacks tensors for \['{prefix}.weight_shape'\]"):
        load_model(rewrite_checkpoint(packed, tmp_path / "no-shape", lambda t: t.pop(f"{prefix}.weight_shape")))


def test_gptq_int8_zero_points_and_group_indices_are_checked(
    hf_checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    """Zero points other than 128 are asymmetric int8; group indices other than runs of 128 are act-order."""
    ckpt = hf_checkpoint("llama", **WIDE)
    write_int8_checkpoint(ckpt.path, ckpt.model, tmp_path / "gptq", "gptq", "group")
    prefix = "model.layers.0.self_attn.o_proj"
    with pytest.raises(UnsupportedModelError, match=rf"'{prefix}.qzeros': zero points other than 128 \(asymmetric"):
        load_model(rewrite_checkpoint(tmp_path / "gptq", tmp_path / "zeros", lambda t: t[f"{prefix}.qzeros"].add_(1)))
    with pytest.raises(UnsupportedModelError, match=rf"'{prefix}.g_idx': group indices that are not runs of 128 "
                                                    r"inputs \(act-order int8\)"):
        load_model(rewrite_checkpoint(tmp_path / "gptq", tmp_path / "g_idx", lambda t: t.update({
            f"{prefix}.g_idx": t[f"{prefix}.g_idx"].flip(0)})))


def test_unsupported_int8_schemes_are_named(llama: Checkpoint, tmp_path: Path) -> None:
    def changed(activations: str, weights: dict | None = None, inputs: dict | None = None) -> dict:
        qc = int8_config(activations)
        group = qc["config_groups"]["group_0"]
        group["weights"].update(weights or {})
        if inputs:
            group["input_activations"].update(inputs)
        return qc

    cases = {
        "asymmetric": (changed("dynamic", {"symmetric": False}), r"int8 weights .*symmetric=False"),
        "groups-of-64": (changed("none", {"strategy": "group", "group_size": 64}), r"int8 weights .*group_size=64"),
        "w8a8-groups": (changed("dynamic", {"strategy": "group", "group_size": 128}), r"int8 weights .*strategy='group'"),
        "gptq-asymmetric": ({**int8_config("gptq", "group"), "sym": False}, "asymmetric 8-bit GPTQ"),
        "gptq-act-order": ({**int8_config("gptq", "group"), "desc_act": True}, r"8-bit GPTQ with desc_act"),
        "gptq-groups-of-32": ({**int8_config("gptq", "group"), "group_size": 32}, "8-bit GPTQ group_size 32"),
        "asymmetric-inputs": (changed("static", inputs={"symmetric": False}), r"input_activations .*symmetric=False"),
        "dynamic-per-tensor": (changed("static", inputs={"dynamic": True, "observer": None}),
                               r"int8 input_activations strategy 'tensor' with dynamic=True"),
        "float-format": ({**int8_config("dynamic"), "format": "float-quantized"},
                         r"int8, channel weight scales, dynamic activations \(compressed-tensors checkpoint\) in "
                         "compressed-tensors format 'float-quantized'"),
    }
    for name, (qc, message) in cases.items():
        with pytest.raises(UnsupportedModelError, match=message):
            load_model(with_quantization_config(llama.path, tmp_path / name, qc))


def test_inspect_shows_int8_layers(int8_checkpoints: dict, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = int8_checkpoints[("dynamic", "channel")]
    assert cli.main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "quantization  int8, channel weight scales, dynamic activations (compressed-tensors checkpoint)" in text
    assert re.search(r"layers 0-1 self_attn.qkv_proj +int8, symmetric, per-channel weight scales, dynamic per-token "
                     "int8 activations", text)
