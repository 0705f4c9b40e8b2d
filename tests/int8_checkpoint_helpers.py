"""Pre-quantized int8 checkpoints as llm-compressor writes them (compressed-tensors' int-quantized W8A8 and
pack-quantized W8A16), compressed by the compressed-tensors library's own compressors from a float32
transformers model, and the float32 model of the dequantized weights they are checked against, its
inputs rounded to int8 as graphkiln's reference path rounds them (per token, or by the static scale)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import PreTrainedModel

from graphkiln.models.int8_linear import quantize_activations_int8
from quant_helpers import input_amax, model_tensors, projections, save_checkpoint, shared_scale, start_checkpoint

INT8_MAX = 127.0


def _int_args(strategy: str, dynamic: bool = False) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


def int8_config(activations: str, weights: str = "channel") -> dict:
    """quantization_config as llm-compressor writes it: `activations` 'dynamic' (per token), 'static' (per tensor)
    or 'none' (W8A16, pack-quantized); `weights` 'channel' or 'tensor'."""
    inputs = {"dynamic": _int_args("token", dynamic=True), "static": _int_args("tensor"), "none": None}[activations]
    fmt = "pack-quantized" if activations == "none" else "int-quantized"
    return {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _int_args(weights),
                                      "input_activations": inputs, "output_activations": None, "format": fmt}},
        "format": fmt, "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def _compressed(weight: torch.Tensor, qc: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the tensors compressed-tensors' compressor for `qc`'s format writes for one projection, the float32 weight
    they stand for), the scale stored in bfloat16 as llm-compressor stores it."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"],
                                input_activations=group["input_activations"])
    per_channel = group["weights"]["strategy"] == "channel"
    amax = weight.abs().amax(-1, keepdim=True) if per_channel else weight.abs().amax().reshape(1)
    scale = (amax / INT8_MAX).to(torch.bfloat16)
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    tensors = compressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    q = (weight / scale.float()).round().clamp(-128, 127)
    return tensors, q * scale.float()


def write_int8_checkpoint(source: Path, model: PreTrainedModel, out: Path, activations: str = "dynamic",
                          weights: str = "channel", calibration: list[int] | None = None) -> PreTrainedModel:
    """Write `model` to `out` as an int8 checkpoint (int8_config) beside the tokenizer-less files of `source`;
    return the float32 model of its dequantized weights whose projections round their inputs as graphkiln's
    reference path does. Static scales come from `calibration` (q, k and v, and gate and up, apart)."""
    qc = int8_config(activations, weights)
    start_checkpoint(source, out, qc)
    amax = input_amax(model, calibration) if activations == "static" else {}
    input_scales = {name: torch.tensor([a / INT8_MAX * (1 + 0.25 * (i % 3))]) for i, (name, a) in enumerate(amax.items())}
    reference, tensors = copy.deepcopy(model), model_tensors(model)
    with torch.no_grad():
        for name, module in projections(reference):
            compressed, dequantized = _compressed(module.weight.float(), qc)
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{kind}": t.contiguous() for kind, t in compressed.items()})
            static = None
            if activations == "static":
                tensors[f"{name}.input_scale"] = input_scales[name]
                static = shared_scale(input_scales, name)
            if activations != "none":
                module.register_forward_pre_hook(
                    lambda m, args, static=static: (quantize_activations_int8(args[0], static).to(args[0].dtype),))
            module.weight.copy_(dequantized)
    save_checkpoint(model, tensors, out)
    return reference
