"""Pre-quantized checkpoints in the layouts their publishers use, written from a float32 transformers model,
and the float32 model of the dequantized weights they are checked against.

The fp8 values are made here with plain torch, apart from graphkiln's quantizers: the layouts are
compressed-tensors' float-quantized format (Llama 3.x fp8: `weight_scale` per tensor [1] or per
channel [N, 1], `input_scale` [1] when static), block-wise fp8 (Qwen3 fp8: `weight_scale_inv`
[ceil(N/128), ceil(K/128)], the factor to multiply by) and AutoFP8's (`quant_method: fp8` without
blocks: `weight_scale` and, when static, `input_scale` as 0-dimensional float32 tensors).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_args(strategy: str) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def compressed_tensors_config(weights: str, activations: str) -> dict:
    """quantization_config as llm-compressor writes it: weights 'tensor'|'channel', activations 'static'|'dynamic';
    weights 'block' (its FP8_BLOCK: 128 x 128 blocks, dynamic 1 x 128 group activations)."""
    inputs = _fp8_args("tensor") if activations == "static" else {**_fp8_args("token"), "dynamic": True,
                                                                  "observer": None}
    weight_args = _fp8_args(weights)
    if weights == "block":
        weight_args["block_structure"] = [BLOCK, BLOCK]
        inputs = {**_fp8_args("group"), "group_size": BLOCK, "dynamic": True, "observer": None}
    return {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weight_args,
                                      "input_activations": inputs, "output_activations": None}},
        "format": "float-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
    }


BLOCK_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def autofp8_config(activations: str) -> dict:
    return {"quant_method": "fp8", "activation_scheme": activations, "ignored_layers": ["lm_head"]}


def modelopt_config(weights: str) -> dict:
    """config.json's quantization_config as ModelOpt exports write it: 'tensor' weights with static activations
    (quant_algo FP8) or 'channel' ones with dynamic per-token activations; an fp8 KV cache with its scales."""
    algo = "FP8" if weights == "tensor" else "FP8_PER_CHANNEL_PER_TOKEN"
    return {"quant_method": "modelopt", "quant_algo": algo, "kv_cache_quant_algo": "FP8", "ignore": ["lm_head"]}


def projections(model: PreTrainedModel):
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            yield name, module


def _to_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _channel_or_tensor(w: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, stored scale, dequantized weight)."""
    amax = w.abs().amax(-1, keepdim=True) if weights == "channel" else w.abs().amax().reshape(1)
    scale = amax / FP8_MAX
    q = _to_fp8(w, scale)
    return q, scale, q.float() * scale


def _blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % BLOCK, 0, -n % BLOCK))
    tiles = padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))  # [N/128, 128, K/128, 128]
    scale = tiles.abs().amax((1, 3)) / FP8_MAX
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    q = _to_fp8(w, full)
    return q, scale, q.float() * full


def input_amax(model: PreTrainedModel, ids: list[int]) -> dict[str, float]:
    """Each projection's largest input magnitude on `ids`: the calibration a static activation scale comes from."""
    seen: dict[str, float] = {}
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, args[0].abs().max().item()))
             for name, module in projections(model)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return seen


def _round_inputs(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return ((x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(x.dtype)


def fp8_inputs(x: torch.Tensor, layout: str, static_scale: torch.Tensor | None) -> torch.Tensor:
    """x as the fp8 products see it: one static scale, else a scale per token (per 1 x 128 group for blocks)."""
    if static_scale is not None:
        return _round_inputs(x, static_scale)
    if layout != "block":
        return _round_inputs(x, x.abs().amax(-1, keepdim=True) / FP8_MAX)
    k = x.shape[-1]
    groups = torch.nn.functional.pad(x, (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK))
    return _round_inputs(groups, groups.abs().amax(-1, keepdim=True) / FP8_MAX).flatten(-2)[..., :k]


def shared_scale(scales: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The one static scale of the projections that read the same input (q, k, v; gate, up): their largest,
    which every part's activations fit."""
    prefix, projection = name.rsplit(".", 1)
    siblings = ("q_proj", "k_proj", "v_proj") if projection in ("q_proj", "k_proj", "v_proj") else (
        ("gate_proj", "up_proj") if projection in ("gate_proj", "up_proj") else (projection,))
    return torch.stack([scales[f"{prefix}.{s}"] for s in siblings]).amax(0)


def write_fp8_checkpoint(source: Path, model: PreTrainedModel, out: Path, layout: str, weights: str = "channel",
                         activations: str = "dynamic", calibration: list[int] | None = None) -> PreTrainedModel:
    """Write `model` to `out` as a pre-quantized checkpoint beside the tokenizer-less files of `source`; return the
    float32 model of the dequantized weights. Layouts: 'compressed-tensors' (`weights` 'block': its 128 x 128 blocks,
    scales named `weight_scale`), 'block', 'autofp8' (per-tensor weight
    scales, 0-dimensional), 'modelopt' (`weights` 'tensor': 0-dimensional scales, static activations; 'channel':
    [N] scales, dynamic; KV cache scales beside) and 'modelopt-file' (the same config in hf_quant_config.json)."""
    modelopt = layout.startswith("modelopt")
    if modelopt:
        activations = "static" if weights == "tensor" else "dynamic"
    configs = {"block": BLOCK_FP8_CONFIG, "autofp8": autofp8_config(activations), "modelopt": modelopt_config(weights)}
    in_config = layout != "modelopt-file"
    start_checkpoint(source, out, (configs.get(layout) or compressed_tensors_config(weights, activations)) if in_config
                     else None)
    if not in_config:
        qc = modelopt_config(weights)
        quantization = {"quant_algo": qc["quant_algo"], "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
        (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                              "quantization": quantization}))
    scalar = layout == "autofp8" or (modelopt and weights == "tensor")
    weights = "tensor" if layout == "autofp8" else weights
    amax = input_amax(model, calibration) if activations == "static" else {}
    # q, k and v (and gate, up) get different scales, as calibrated checkpoints have
    input_scales = {name: torch.tensor([a / FP8_MAX * (1 + 0.25 * (i % 3))]) for i, (name, a) in enumerate(amax.items())}
    reference, tensors = copy.deepcopy(model), model_tensors(model)
    with torch.no_grad():
        for name, module in projections(reference):
            w = module.weight.float()
            if layout == "block" or weights == "block":
                q, scale, dequantized = _blocks(w)
                tensors[f"{name}.weight_scale{'_inv' * (layout == 'block')}"] = scale.contiguous()
            else:
                q, scale, dequantized = _channel_or_tensor(w, weights)
                shape = () if scalar else ((-1,) if modelopt else scale.shape)
                tensors[f"{name}.weight_scale"] = scale.reshape(shape).contiguous()
            if modelopt and name.endswith(("k_proj", "v_proj")):
                tensors[f"{name}.{name[-6]}_scale"] = torch.tensor(0.05)
            static = None
            if activations == "static":
                tensors[f"{name}.input_scale"] = input_scales[name].reshape(()) if scalar else input_scales[name]
                static = shared_scale(input_scales, name)
            rounding = "block" if weights == "block" else layout
            module.register_forward_pre_hook(lambda m, args, static=static: (fp8_inputs(args[0], rounding, static),))
            tensors[f"{name}.weight"] = q.contiguous()
            module.weight.copy_(dequantized)
    save_checkpoint(model, tensors, out)
    return reference


def start_checkpoint(source: Path, out: Path, qc: dict | None) -> None:
    """`out` with `source`'s config.json, declaring `qc` as its quantization_config (None: none), and its
    generation_config.json: the tokenizer-less files of a checkpoint whose tensors save_checkpoint writes."""
    out.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    if qc is not None:
        config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for extra in source.glob("generation_config.json"):
        shutil.copy(extra, out)


def model_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """A copy of `model`'s tensors by name, to replace the projections' weights with a format's tensors."""
    return {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}


def save_checkpoint(model: PreTrainedModel, tensors: dict[str, torch.Tensor], out: Path) -> None:
    """`tensors` as `out`'s model.safetensors, without a tied LM head (as transformers saves it)."""
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def rewrite_checkpoint(source: Path, dest: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the checkpoint `source` (config.json, model.safetensors) whose tensors `change` edited in place."""
    dest.mkdir()
    (dest / "config.json").write_text((source / "config.json").read_text())
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    change(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute difference, relative to the reference's largest magnitude."""
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def top1_agreement(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The share of positions whose most likely token is the same."""
    return (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()


def with_quantization_config(source: Path, dest: Path, qc: dict) -> Path:
    """A copy of the checkpoint at `source` in `dest` whose config.json declares `qc` as its quantization_config."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return dest
