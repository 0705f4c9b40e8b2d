"""Pre-quantized int8 checkpoints as llm-compressor writes them (compressed-tensors' int-quantized W8A8 and
pack-quantized W8A16, per channel or in groups of 128), compressed by the compressed-tensors library's own
compressors, and as AutoGPTQ / GPTQModel write 8-bit GPTQ (packed here with shifts, as their packers do),
from a float32 transformers model; and the float32 model of the dequantized weights they are checked
against, its inputs rounded to int8 (per token, or by the static scale) here, apart from graphkiln's own rounding."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import PreTrainedModel

from quant_helpers import input_amax, model_tensors, projections, save_checkpoint, shared_scale, start_checkpoint

INT8_MAX = 127.0
GROUP = 128


def rounded_to_int8(x: torch.Tensor, static: torch.Tensor | None) -> torch.Tensor:
    """x through symmetric int8 and back, as W8A8 kernels round a projection's input: by the checkpoint's static
    scale, or per token by amax / 127; to the nearest level, clamped to +-127."""
    x32 = x.float()
    scale = static.float() if static is not None else x32.abs().amax(-1, keepdim=True) / INT8_MAX
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    return ((x32 / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale).to(x.dtype)


def _int_args(strategy: str, dynamic: bool = False) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


def int8_config(activations: str, weights: str = "channel") -> dict:
    """quantization_config as llm-compressor writes it: `activations` 'dynamic' (per token), 'static' (per tensor)
    or 'none' (W8A16, pack-quantized); `weights` 'channel', 'tensor' or 'group' (of GROUP inputs); GPTQ's 8-bit
    config for `activations` 'gptq' or 'gptq_v2' (the checkpoint_format; `weights` 'channel' or 'group')."""
    if activations.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 8, "group_size": GROUP if weights == "group" else -1,
                "desc_act": False, "sym": True, "checkpoint_format": activations, "static_groups": False}
    inputs = {"dynamic": _int_args("token", dynamic=True), "static": _int_args("tensor"), "none": None}[activations]
    fmt = "pack-quantized" if activations == "none" else "int-quantized"
    weight_args = {**_int_args(weights), "group_size": GROUP if weights == "group" else None}
    return {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weight_args,
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
    strategy = group["weights"]["strategy"]
    amax = {"channel": lambda: weight.abs().amax(-1, keepdim=True), "tensor": lambda: weight.abs().amax().reshape(1),
            "group": lambda: weight.unflatten(-1, (-1, GROUP)).abs().amax(-1)}[strategy]()
    scale = (amax / INT8_MAX).to(torch.bfloat16)
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    tensors = compressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    full = scale.float().repeat_interleave(GROUP, -1) if strategy == "group" else scale.float()
    return tensors, (weight / full).round().clamp(-128, 127) * full


def _bytes_in_words(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..255 -> int32 [R, C / 4]: column 4i + j in bits 8j of word i."""
    parts = values.to(torch.int64).unflatten(1, (-1, 4))
    words = sum(parts[:, :, j] << (8 * j) for j in range(4))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq(weight: torch.Tensor, qc: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(8-bit GPTQ tensors of one projection, the float32 weight they stand for): q + 128 in bytes of words along K,
    zero points of 128 (stored minus one in checkpoint_format gptq), float16 scales."""
    n, k = weight.shape
    group = qc["group_size"] if qc["group_size"] > 0 else k
    scale = (weight.unflatten(-1, (-1, group)).abs().amax(-1) / INT8_MAX).to(torch.float16)  # [N, K / G]
    full = scale.float().repeat_interleave(group, -1)
    q = (weight / full).round().clamp(-127, 127)
    stored_zero = 128 - (qc["checkpoint_format"] == "gptq")
    tensors = {"qweight": _bytes_in_words(q + 128).t().contiguous(),
               "qzeros": _bytes_in_words(torch.full((k // group, n), stored_zero)),
               "scales": scale.t().contiguous(), "g_idx": (torch.arange(k) // group).to(torch.int32)}
    return tensors, q * full


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
            write = _gptq if activations.startswith("gptq") else _compressed
            compressed, dequantized = write(module.weight.float(), qc)
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{kind}": t.contiguous() for kind, t in compressed.items()})
            static = None
            if activations == "static":
                tensors[f"{name}.input_scale"] = input_scales[name]
                static = shared_scale(input_scales, name)
            if activations in ("dynamic", "static"):
                module.register_forward_pre_hook(
                    lambda m, args, static=static: (rounded_to_int8(args[0], static),))
            module.weight.copy_(dequantized)
    save_checkpoint(model, tensors, out)
    return reference
