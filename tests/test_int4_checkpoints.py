"""Pre-quantized int4 checkpoints (compressed-tensors pack-quantized, GPTQ, AWQ) against transformers and the
float32 model of their dequantized weights; what graphkiln does not read, refused by name (on two
tensor-parallel ranks: test_tensor_parallel_quantized.py)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import LlamaForCausalLM

import graphkiln
from graphkiln import cli
from artifact_helpers import COMPILED, ENGINE, RESULT_PREFIX, SMALL_ENGINE, run_python_json
from graphkiln.compiler.artifacts import QUANTIZED_FILE
from graphkiln.errors import UnsupportedModelError, WeightMismatchError
from graphkiln.models import kernel_loads
from graphkiln.models.loader import empty_model, fill_model, load_model
from graphkiln.models.quantized_linear import Int4Linear
from int4_checkpoint_helpers import awq_words, int4_config, write_int4_checkpoint
from quant_helpers import relative_error, rewrite_checkpoint, top1_agreement, with_quantization_config

if TYPE_CHECKING:
    from conftest import Checkpoint, CheckpointFactory

GROUP = 32  # the test model's inputs are 64 (q/k/v, gate/up, o) and 128 (down) wide
CASES = [("compressed-tensors", True, False), ("compressed-tensors", False, False), ("gptq", True, False),
         ("gptq_v2", False, False), ("awq", False, False), ("gptq", True, True), ("compressed-tensors", False, True)]


@pytest.fixture(scope="module")
def int4_checkpoints(llama: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """(format, symmetric, act_order) -> (checkpoint directory, float32 transformers model of its dequantized
    weights)."""
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for fmt, symmetric, act_order in CASES:
        path = root / f"{fmt}-{symmetric}-{act_order}"
        reference = write_int4_checkpoint(llama.path, llama.model, path, fmt, GROUP, symmetric, act_order)
        out[(fmt, symmetric, act_order)] = (path, reference)
    return out


def _reference_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("fmt,symmetric,act_order", CASES,
                         ids=[f"{f}-{'sym' if s else 'asym'}{'-act-order' if a else ''}" for f, s, a in CASES])
def test_int4_checkpoint_matches_its_dequantized_reference(
    int4_checkpoints: dict, llama: Checkpoint, random_ids: Callable[..., list[int]], fmt: str, symmetric: bool,
    act_order: bool,
) -> None:
    """Act-order: each input's group is numbered (shuffled), so the weight's columns are stored sorted by group
    and the input gathered in that order."""
    path, reference = int4_checkpoints[(fmt, symmetric, act_order)]
    qkv = load_model(path).model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.group_size == GROUP and qkv.source == fmt
    assert (qkv.input_order is not None) == act_order
    kind = "symmetric" if symmetric else "asymmetric"
    assert qkv.describe() == f"int4, {kind}, groups of {GROUP}{' in act-order' if act_order else ''}, weight-only"
    ids = random_ids(48)
    ours = graphkiln.LLM.eager(path, **ENGINE).score(ids)
    ref = _reference_logits(reference, ids)
    assert relative_error(ours, ref) < 1e-4 and top1_agreement(ours, ref) == 1.0
    assert relative_error(llama.reference_logits(ids), ref) > 0.05  # the bound above tells int4 from the original


def test_act_order_kernels_launch_beside_the_weights_with_an_input_order_in_range(
    int4_checkpoints: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager forwards a load launches before the weights are read (CUDA only; turned on for the CPU here)
    gather an act-order projection's input with its order as it stands then: the identity, not uninitialised
    memory, whose indices out of range were a device-side assert on the GPU. The checkpoint's order replaces it."""
    monkeypatch.setattr(kernel_loads, "LAUNCH_ON", ("cuda", "cpu"))
    path, _ = int4_checkpoints[("gptq", True, True)]
    model = empty_model(path)
    orders = [m.input_order for m in model.modules() if isinstance(m, Int4Linear)]
    assert orders and all(torch.equal(order, torch.arange(order.numel())) for order in orders)
    before = kernel_loads.forwards_launched()
    kernel_loads.launch_eager_kernels(model, (1, 3))
    assert kernel_loads.forwards_launched() == before + 2
    fill_model(model, path)
    assert all(torch.equal(order.sort().values, torch.arange(order.numel())) for order in orders)
    assert not any(torch.equal(order, torch.arange(order.numel())) for order in orders)


@pytest.mark.parametrize("fmt,symmetric", [("gptq", True), ("gptq_v2", False), ("compressed-tensors", False)])
def test_int4_checkpoint_with_a_scale_per_channel_matches_its_dequantized_reference(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path, fmt: str, symmetric: bool
) -> None:
    """GPTQ's group_size -1 and compressed-tensors' channel strategy: each row's one scale and zero point repeated
    over groups the kernels take (the largest power of two up to 128 dividing the input size)."""
    reference = write_int4_checkpoint(llama.path, llama.model, tmp_path / fmt, fmt, -1, symmetric)
    down = load_model(tmp_path / fmt).model.layers[0].mlp.down_proj
    kind = "symmetric" if symmetric else "asymmetric"
    assert down.describe() == f"int4, {kind}, per-channel scales (as groups of 128), weight-only"
    ids = random_ids(48)
    ours = graphkiln.LLM.eager(tmp_path / fmt, **ENGINE).score(ids)
    ref = _reference_logits(reference, ids)
    assert relative_error(ours, ref) < 1e-4 and top1_agreement(ours, ref) == 1.0


def test_awq_checkpoint_with_biases_matches_its_dequantized_reference(
    hf_checkpoint: CheckpointFactory, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """Qwen2's q, k and v biases beside the int4 weights (Qwen publishes its AWQ checkpoints so)."""
    ckpt = hf_checkpoint("qwen2")
    reference = write_int4_checkpoint(ckpt.path, ckpt.model, tmp_path / "awq", "awq", GROUP, False)
    assert load_model(tmp_path / "awq").model.layers[0].self_attn.qkv_proj.bias is not None
    ids = random_ids(48)
    ours = graphkiln.LLM.eager(tmp_path / "awq", **ENGINE).score(ids)
    assert relative_error(ours, _reference_logits(reference, ids)) < 1e-4


@pytest.mark.parametrize("fmt,side_file", [("gptq", "quantize_config.json"), ("awq", "quant_config.json")])
def test_int4_config_in_the_side_file_older_exports_write(
    int4_checkpoints: dict, random_ids: Callable[..., list[int]], tmp_path: Path, fmt: str, side_file: str
) -> None:
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json (its own keys) beside a config.json
    without quantization_config."""
    source, reference = int4_checkpoints[(fmt, fmt == "gptq", False)]
    dest = Path(shutil.copytree(source, tmp_path / fmt))
    config = json.loads((dest / "config.json").read_text())
    qc = config.pop("quantization_config")
    if fmt == "awq":
        qc = {"zero_point": True, "q_group_size": qc["group_size"], "w_bit": 4, "version": "GEMM"}
    else:
        del qc["quant_method"], qc["checkpoint_format"]
    (dest / side_file).write_text(json.dumps(qc))
    (dest / "config.json").write_text(json.dumps(config))
    assert load_model(dest).model.layers[0].mlp.down_proj.describe().startswith("int4")
    ids = random_ids(48)
    assert relative_error(graphkiln.LLM.eager(dest, **ENGINE).score(ids), _reference_logits(reference, ids)) < 1e-4


def test_gptq_layout_named_format_as_some_autogptq_versions_write_it(
    int4_checkpoints: dict, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """`format: gptq_v2` instead of `checkpoint_format`: read as v2 (zero points as stored), not as v1's minus one."""
    source, reference = int4_checkpoints[("gptq_v2", False, False)]
    dest = Path(shutil.copytree(source, tmp_path / "format"))
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"]["format"] = config["quantization_config"].pop("checkpoint_format")
    (dest / "config.json").write_text(json.dumps(config))
    ids = random_ids(48)
    assert relative_error(graphkiln.LLM.eager(dest, **ENGINE).score(ids), _reference_logits(reference, ids)) < 1e-4


def test_a_side_file_beside_weights_that_are_not_quantized_is_not_read(llama: Checkpoint, tmp_path: Path) -> None:
    """A quantize_config.json left beside plain weights (a model dequantized, or converted back) is no config."""
    dest = Path(shutil.copytree(llama.path, tmp_path / "plain"))
    (dest / "quantize_config.json").write_text(json.dumps(int4_config("gptq", 32, True)))
    assert not any(isinstance(m, Int4Linear) for m in load_model(dest).modules())


def test_compressed_tensors_int4_checkpoint_matches_transformers_reading_it(
    int4_checkpoints: dict, random_ids: Callable[..., list[int]]
) -> None:
    """transformers reads the same checkpoint through compressed-tensors (decompressed to float32)."""
    path, _ = int4_checkpoints[("compressed-tensors", True, False)]
    ids = random_ids(48)
    theirs = _reference_logits(LlamaForCausalLM.from_pretrained(path).eval(), ids)
    assert relative_error(graphkiln.LLM.eager(path, **ENGINE).score(ids), theirs) < 1e-4


def test_awq_test_layout_is_the_one_compressed_tensors_reads() -> None:
    autoawq = pytest.importorskip("compressed_tensors.entrypoints.convert.converters.autoawq")
    values = torch.randint(0, 16, (64, 48))
    words = awq_words(values)
    unpacked, _ = autoawq.AutoAWQConverter.unpack_awq(words, None, 4)
    ordered, _ = autoawq.AutoAWQConverter.reverse_awq_order(unpacked, None, 4)
    assert torch.equal(ordered.to(torch.int64) & 15, values)


def _with_config(llama: Checkpoint, tmp_path: Path, name: str, qc: dict) -> Path:
    return with_quantization_config(llama.path, tmp_path / name, qc)


def test_unsupported_int4_schemes_are_named(llama: Checkpoint, tmp_path: Path) -> None:
    ct = int4_config("compressed-tensors", 128, True)
    per_tensor = {**ct, "config_groups": {"g": {**ct["config_groups"]["group_0"], "weights": {
        **ct["config_groups"]["group_0"]["weights"], "strategy": "tensor", "group_size": None}}}}
    cases = {
        "gptq-3bit": ({**int4_config("gptq", 128, True), "bits": 3}, r"GPTQ with bits 3 \(graphkiln reads 4-bit and "
                                                                     r"8-bit GPTQ\)"),
        "marlin": ({**int4_config("gptq", 128, True), "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        "is-marlin": ({**int4_config("gptq", 128, True), "is_marlin_format": True}, "checkpoint_format 'marlin'"),
        "int16-words": ({**int4_config("gptq", 128, True), "pack_dtype": "int16"}, "GPTQ pack_dtype 'int16'"),
        "group-24": ({**int4_config("gptq", 24, True)}, r"GPTQ group_size 24 \(int4 groups must be a power of two"),
        "awq-channel": ({**int4_config("awq", -1, False)}, r"AWQ group_size -1 "),
        "group-48": ({**int4_config("awq", 48, False)}, r"AWQ group_size 48 "),
        "gemv": ({**int4_config("awq", 128, False), "version": "gemv"}, "AWQ version 'gemv'"),
        "no-zeros": ({**int4_config("awq", 128, False), "zero_point": False}, "AWQ without zero points"),
        "ct-tensor": (per_tensor, "int4 weights with strategy 'tensor'"),
        "ct-float-format": ({**ct, "format": "float-quantized"},
                            r"int4, symmetric groups of 128, weight-only \(compressed-tensors checkpoint\) in "
                            "compressed-tensors format 'float-quantized'"),
    }
    for name, (qc, message) in cases.items():
        with pytest.raises(UnsupportedModelError, match=message):
            load_model(_with_config(llama, tmp_path, name, qc))
    wide = _with_config(llama, tmp_path, "group-128", int4_config("gptq", 128, True))
    with pytest.raises(UnsupportedModelError, match="gptq int4 groups of 128 inputs do not divide a projection's input "
                                                    "size 64"):
        load_model(wide)
    with pytest.raises(UnsupportedModelError, match="quant_method 'bitsandbytes' is not supported; graphkiln loads .*GPTQ"):
        load_model(_with_config(llama, tmp_path, "bnb", {"quant_method": "bitsandbytes", "load_in_4bit": True}))


def test_damaged_int4_tensors_are_named(int4_checkpoints: dict, tmp_path: Path) -> None:
    gptq, _ = int4_checkpoints[("gptq", True, False)]
    ct, _ = int4_checkpoints[("compressed-tensors", False, False)]
    awq, _ = int4_checkpoints[("awq", False, False)]
    prefix = "model.layers.0.mlp.down_proj"

    def permute_groups(t):
        t[f"{prefix}.g_idx"] = t[f"{prefix}.g_idx"].flip(0)

    with pytest.raises(WeightMismatchError, match=rf"model.safetensors: tensor '{prefix}.g_idx': group indices that are "
                                                  r"not runs of 32 inputs \(act-order\), but quantization_config "
                                                  "declares none"):
        load_model(rewrite_checkpoint(gptq, tmp_path / "g_idx", permute_groups))
    with pytest.raises(WeightMismatchError, match=r"weight_shape \[64, 100\] but config.json implies \[64, 128\]"):
        load_model(rewrite_checkpoint(ct, tmp_path / "shape", lambda t: t.update({f"{prefix}.weight_shape": torch.tensor([64, 100])})))
    with pytest.raises(WeightMismatchError, match=rf"checkpoint lacks tensors for \['{prefix}.qzeros'\]"):
        load_model(rewrite_checkpoint(gptq, tmp_path / "no-zeros", lambda t: t.pop(f"{prefix}.qzeros")))
    with pytest.raises(WeightMismatchError, match=r"'model.layers.0.self_attn.k_proj.qweight': dtype torch.float32, "
                                                  r"the format stores torch.int32"):
        load_model(rewrite_checkpoint(awq, tmp_path / "float", lambda t: t.update({
            "model.layers.0.self_attn.k_proj.qweight": t["model.layers.0.self_attn.k_proj.qweight"].float()})))
    with pytest.raises(WeightMismatchError, match=r"weight_zero_point': shape \(2, 4\) but config.json and "
                                                  r"quantization_config imply \(8, 4\)"):
        load_model(rewrite_checkpoint(ct, tmp_path / "zeros", lambda t: t.update({
            f"{prefix}.weight_zero_point": t[f"{prefix}.weight_zero_point"][:2]})))


def test_damaged_act_order_indices_are_named(int4_checkpoints: dict, tmp_path: Path) -> None:
    gptq, _ = int4_checkpoints[("gptq", True, True)]
    attention = "model.layers.1.self_attn"

    def uneven(t):
        t["model.layers.0.mlp.down_proj.g_idx"][:3] = 0

    with pytest.raises(WeightMismatchError, match=r"down_proj.g_idx': group indices that do not give each of the 4 "
                                                  "groups 32 inputs"):
        load_model(rewrite_checkpoint(gptq, tmp_path / "uneven", uneven))
    with pytest.raises(UnsupportedModelError, match=rf"'{attention}.(k|q)_proj.g_idx': an input order \(act-order\) "
                                                    "that differs from that of the projection fused with it"):
        load_model(rewrite_checkpoint(gptq, tmp_path / "apart", lambda t: t.update({
            f"{attention}.k_proj.g_idx": t[f"{attention}.k_proj.g_idx"].roll(1)})))
    with pytest.raises(WeightMismatchError, match=rf"checkpoint lacks tensors for \['{attention}.v_proj.g_idx'\]"):
        load_model(rewrite_checkpoint(gptq, tmp_path / "missing", lambda t: t.pop(f"{attention}.v_proj.g_idx")))


@pytest.mark.slow
def test_int4_checkpoint_compiles_into_an_artifact_that_reads_it_as_it_is(
    int4_checkpoints: dict, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """Act-order (the input gathered in the compiled graph); no copy of the weights in the artifact; a fresh process
    loads it without compressed-tensors or transformers."""
    path, _ = int4_checkpoints[("compressed-tensors", False, True)]
    ids = random_ids(48)
    manifest, _ = graphkiln.compile_model(path, tmp_path / "art", engine=SMALL_ENGINE)
    quant = manifest["model"]["quantization"]
    assert quant["description"] == "int4, asymmetric groups of 32 in act-order, weight-only (compressed-tensors checkpoint)"
    assert quant["file"] is None and QUANTIZED_FILE not in manifest["files"]
    assert quant["layers"]["model.layers.1.mlp.down_proj"] == "int4, asymmetric, groups of 32 in act-order, weight-only"
    compiled = graphkiln.load(tmp_path / "art", **COMPILED).score(ids)
    assert relative_error(compiled, graphkiln.LLM.eager(path, **ENGINE).score(ids)) < 1e-4
    code = f"""import json, sys, graphkiln
logits = graphkiln.load({str(tmp_path / "art")!r}, **{COMPILED!r}).score({ids!r})
print("{RESULT_PREFIX}" + json.dumps({{"logits": logits.tolist(), "imported": [m for m in ("compressed_tensors", "transformers") if m in sys.modules]}}))
"""
    fresh = run_python_json(code)
    assert fresh["imported"] == [] and torch.equal(torch.tensor(fresh["logits"]), compiled)


def test_inspect_shows_how_a_checkpoint_is_read(int4_checkpoints: dict, llama: Checkpoint, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`graphkiln inspect MODEL_DIR`, before any compile: the scheme and each layer's format, or compile-model's
    error for a checkpoint it cannot read."""
    path, _ = int4_checkpoints[("gptq", True, True)]
    assert cli.main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "quantization  int4, symmetric groups of 32 in act-order, weight-only (gptq checkpoint)" in text
    assert re.search(r"layers 0-1 mlp.down_proj +int4, symmetric, groups of 32 in act-order, weight-only", text)
    assert "LlamaForCausalLM: 2 layers, hidden 64, 4 heads of 16, 2 KV heads" in text
    hqq = with_quantization_config(llama.path, tmp_path / "hqq", {"quant_method": "hqq"})
    assert cli.main(["inspect", str(hqq)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quant_method 'hqq' is not supported" in err[0]
