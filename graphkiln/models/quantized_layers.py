"""The quantized linear layers of a model: built empty, filled from a checkpoint, quantized, saved and loaded.

Whatever the scheme (`quant_scheme.py`), the decoder's projections (q/k/v, o, gate/up, down)
become the modules of `quantized_linear.py`; embeddings, norms and the LM head stay in the model
dtype. A checkpoint's separate q, k, v (gate, up) tensors fill slices of one fused module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from graphkiln.errors import ArtifactError, UnsupportedModelError, WeightMismatchError

from . import int4_checkpoints, int8_checkpoints
from .config import ModelConfig
from .int4_checkpoints import SYMMETRIC_ZERO
from .int8_linear import Int8Linear, quantize_int8
from .quant_scheme import PROJECTIONS, QuantScheme
from .quantized_linear import (
    BLOCK,
    BlockFp8Linear,
    Fp8Linear,
    Int4Linear,
    QuantizedLinear,
    int4_group_size,
    quantize_fp8,
    quantize_int4,
)
from .sharding import Shard, local_config
from .transformer import CausalLM


class Projection(NamedTuple):
    """A decoder projection: where it sits (parent module, attribute) and its shape."""

    parent: torch.nn.Module
    name: str
    in_features: int
    parts: tuple[int, ...]
    bias: bool


def _projections(model: CausalLM, cfg: ModelConfig) -> Iterator[Projection]:
    """Every decoder projection, at the shapes of `cfg`."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield Projection(attn, "qkv_proj", cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.qkv_bias)
        yield Projection(attn, "o_proj", cfg.q_size, (cfg.hidden_size,), cfg.o_bias)
        yield Projection(mlp, "gate_up_proj", cfg.hidden_size, (cfg.intermediate_size,) * 2, cfg.mlp_bias)
        yield Projection(mlp, "down_proj", cfg.intermediate_size, (cfg.hidden_size,), cfg.mlp_bias)


def _rank_projections(model: CausalLM, cfg: ModelConfig, ranks: int) -> Iterator[tuple[Projection, Projection]]:
    """Every decoder projection at the shapes of one of `ranks` tensor-parallel ranks, with the checkpoint's."""
    return zip(_projections(model, local_config(cfg, ranks)), _projections(model, cfg))


def _module(scheme: QuantScheme, in_features: int, parts: tuple[int, ...], bias: bool, dtype,
            checkpoint_in_features: int, ranks: int = 1) -> QuantizedLinear:
    """An empty quantized projection, one share of `ranks` tensor-parallel ranks of the checkpoint's projection of
    `checkpoint_in_features` inputs (compile-model's int4 groups are chosen from it, so that every rank count
    quantizes alike; those a per-channel int4 checkpoint's one scale a row is repeated over, from the share)."""
    share = f" (a share of {ranks} tensor-parallel ranks; use fewer ranks)" if ranks > 1 else ""
    if scheme.method == "int4":
        channel = scheme.from_checkpoint and scheme.weights == "channel"
        sized_by = in_features if channel else checkpoint_in_features
        group = scheme.group_size if scheme.from_checkpoint and not channel else int4_group_size(sized_by)
        if group is None:
            raise UnsupportedModelError(f"int4 needs a layer's input size divisible by 16; a layer has {sized_by}"
                                        f"{share if channel else ''}")
        if in_features % group:
            what = f"{scheme.source} int4" if scheme.from_checkpoint else "int4"
            raise UnsupportedModelError(f"{what} groups of {group} inputs do not divide a projection's input size "
                                        f"{in_features}{share}")
        if not scheme.from_checkpoint:
            return Int4Linear(in_features, parts, bias, dtype, group)
        return Int4Linear(in_features, parts, bias, dtype, group, scheme.source, scheme.symmetric, scheme.act_order,
                          channel)
    if scheme.weights == "block":
        if len(parts) > 1 and any(p % BLOCK for p in parts):
            raise UnsupportedModelError(
                f"block-wise fp8 with fused projections of sizes {parts}: each must be a multiple of {BLOCK}{share}"
            )
        scale_name = "weight_scale" if scheme.source == "compressed-tensors" else "weight_scale_inv"
        return BlockFp8Linear(in_features, parts, bias, dtype, scale_name)
    if scheme.method == "int8":
        return Int8Linear(in_features, parts, bias, dtype, static_input=scheme.activations == "static",
                          quantize_input=scheme.activations != "none", packed=scheme.packed, source=scheme.source,
                          group_size=scheme.group_size)
    return Fp8Linear(in_features, parts, bias, dtype, static_input=scheme.activations == "static")


def _rank_module(scheme: QuantScheme, ours: Projection, full: Projection, dtype, ranks: int) -> QuantizedLinear:
    """The empty module of one of `ranks` ranks' share (`ours`) of a projection, which records the checkpoint's shape
    of it (`full`)."""
    module = _module(scheme, ours.in_features, ours.parts, ours.bias, dtype, full.in_features, ranks)
    module.checkpoint_in_features, module.checkpoint_parts = full.in_features, full.parts
    return module


def install_quantized(model: CausalLM, cfg: ModelConfig, scheme: QuantScheme, dtype: torch.dtype,
                      shard: Shard = Shard()) -> None:
    """Replace every decoder projection of a model on the meta device by an empty quantized module of the rank's
    shape (`shard`)."""
    with torch.device("meta"):
        for ours, full in _rank_projections(model, cfg, shard.size):
            setattr(ours.parent, ours.name, _rank_module(scheme, ours, full, dtype, shard.size))


def reset_before_fill(model: CausalLM) -> None:
    """Static activation scales start at zero: the fused parts' scales are combined by their maximum. A symmetric
    int4 checkpoint that stores no zero points has them all at 8. An act-order input order starts as the identity:
    the kernels launched beside the weights (kernel_loads.py) gather the input with it before the checkpoint's
    group indices are read, and an index out of range there is a device-side assert that ends the process's
    CUDA context."""
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module.input_scale is not None:
            module.input_scale.zero_()
        if isinstance(module, Int4Linear) and module.symmetric:
            module.zeros.fill_(SYMMETRIC_ZERO)
        if isinstance(module, Int4Linear) and module.input_order is not None:
            torch.arange(module.in_features, out=module.input_order)


def checkpoint_kinds(module: QuantizedLinear) -> list[str]:
    """The kinds of checkpoint tensor (the last part of their names) that fill each part of a projection."""
    if isinstance(module, Int4Linear) and module.source is not None:
        kinds = int4_checkpoints.checkpoint_kinds(module.source, module.symmetric, module.input_order is not None)
        return [*kinds] + ["bias"] * (module.bias is not None)
    if isinstance(module, Int8Linear):
        return int8_checkpoints.checkpoint_kinds(module) + ["bias"] * (module.bias is not None)
    return [name for name, _ in module.named_parameters()]


def sort_int4_columns(model: CausalLM) -> None:
    """Store each act-order int4 weight's columns in its input_order (int4_checkpoints.sort_columns), once all
    of its tensors are in."""
    for module in model.modules():
        if isinstance(module, Int4Linear) and module.input_order is not None:
            int4_checkpoints.sort_columns(module)


def fill_quantized(module: QuantizedLinear, kind: str, index: int | None, tensor: torch.Tensor, where: str) -> None:
    """Copy one checkpoint tensor (`kind` of fused part `index`, None: unfused) into `module`; an int4 one is
    read in its checkpoint format's layout (int4_checkpoints.py). Per-tensor weight scales are spread over
    their part's channels; the static activation scales of fused parts are combined by their maximum, which
    every part's activations fit."""
    part = 0 if index is None else index
    if kind == "bias":
        dest = module.bias.split(module.parts)[part]
        _check_shape(tensor, dest.shape, where)
        dest.copy_(tensor)
    elif isinstance(module, Int4Linear):
        int4_checkpoints.fill_int4(module, kind, index, tensor, where)
    elif isinstance(module, Int8Linear) and int8_checkpoints.reads(module, kind):
        int8_checkpoints.fill_int8(module, kind, part, tensor, where)
    elif kind == "input_scale" and module.input_scale is not None:
        _check_scales(tensor, where, zero=False)
        _check_shape(tensor.reshape(-1), (1,), where)
        module.input_scale.copy_(torch.maximum(module.input_scale, tensor.float().reshape(1)))
    elif kind == "weight":
        dest = module.weight.split(module.parts)[part]
        _check_shape(tensor, dest.shape, where)
        if tensor.dtype != module.weight.dtype:
            raise WeightMismatchError(f"{where}: dtype {tensor.dtype}, the checkpoint's quantization_config needs "
                                      f"{module.weight.dtype}")
        dest.copy_(tensor)
    elif isinstance(module, BlockFp8Linear) and kind == module.scale_name:
        dest = getattr(module, kind).split([-(-p // BLOCK) for p in module.parts])[part]
        _check_scales(tensor, where)
        _check_shape(tensor, dest.shape, where)
        dest.copy_(tensor)
    elif kind == "weight_scale" and not isinstance(module, BlockFp8Linear):
        _check_scales(tensor, where)
        dest = module.weight_scale.split(module.parts)[part]
        values = tensor.float().reshape(-1)
        if values.numel() == 1:
            values = values.expand(dest.shape)
        _check_shape(values, dest.shape, where)
        dest.copy_(values)
    else:
        raise WeightMismatchError(f"{where}: no place for a {kind!r} tensor in a {type(module).__name__}")


def _check_scales(tensor: torch.Tensor, where: str, zero: bool = True) -> None:
    """fp8 scales are positive floats; a weight scale may be 0 (a row of zeros), an activation scale, which
    divides, may not."""
    if not tensor.is_floating_point():
        raise WeightMismatchError(f"{where}: dtype {tensor.dtype}, but the format stores floating-point scales")
    low = tensor.float().min() if tensor.numel() else None
    if low is not None and (low < 0 or (not zero and low == 0)):
        bound = ">= 0" if zero else "> 0"
        raise WeightMismatchError(f"{where}: holds the scale {low.item():g}, but scales are {bound}; the checkpoint "
                                  "is corrupt, download or save it again")


def _check_shape(tensor: torch.Tensor, shape, where: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise WeightMismatchError(
            f"{where}: shape {tuple(tensor.shape)} but config.json and quantization_config imply {tuple(shape)}"
        )


_quantized_in_process = 0


def projections_quantized() -> int:
    """How many projections this process has quantized (compile-model does; a warm load never should)."""
    return _quantized_in_process


@torch.no_grad()
def quantize_model(model: CausalLM, cfg: ModelConfig, scheme: QuantScheme) -> None:
    """Quantize every decoder projection of a loaded model (one tensor-parallel rank's share of it) in place, one
    layer at a time."""
    global _quantized_in_process
    for ours, full in _rank_projections(model, cfg, model.shard.size):
        _quantized_in_process += 1
        linear = getattr(ours.parent, ours.name)
        weight = linear.weight
        with torch.device(weight.device):
            module = _rank_module(scheme, ours, full, weight.dtype, model.shard.size)
        if isinstance(module, Int4Linear):
            for dest, value in zip((module.qweight, module.scales, module.zeros), quantize_int4(weight, module.group_size)):
                dest.copy_(value)
            module.allocate_tinygemm()
        else:
            q, scale = (quantize_int8 if isinstance(module, Int8Linear) else quantize_fp8)(weight)
            module.weight.copy_(q)
            module.weight_scale.copy_(scale)
        if ours.bias:
            module.bias.copy_(linear.bias)
        setattr(ours.parent, ours.name, module)


def quantized_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized projections, by parameter name."""
    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    return {name: p for name, p in model.named_parameters() if name.rsplit(".", 1)[0] in quantized}


def save_quantized(model: CausalLM, path: Path) -> None:
    save_file({name: t.contiguous().cpu() for name, t in quantized_tensors(model).items()}, str(path))


@torch.no_grad()
def load_quantized(model: CausalLM, path: Path) -> None:
    """Fill the quantized projections from a file save_quantized wrote (its sha256 already checked)."""
    wanted = quantized_tensors(model)
    try:
        with safe_open(str(path), framework="pt", device=str(next(iter(wanted.values())).device)) as f:
            names = set(f.keys())
            if names != set(wanted):
                odd = sorted(names ^ set(wanted))[:3]
                raise ArtifactError(f"{path}: its tensors differ from the model's quantized layers ({odd}); recompile")
            for name, dest in wanted.items():
                value = f.get_tensor(name)
                if value.shape != dest.shape or value.dtype != dest.dtype:
                    raise ArtifactError(f"{path}: tensor {name!r} is {value.dtype} {tuple(value.shape)}, the model "
                                        f"needs {dest.dtype} {tuple(dest.shape)}; recompile")
                dest.copy_(value)
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{path}: not a readable safetensors file ({e}); recompile") from e


def allocate_tinygemm(model: CausalLM) -> None:
    """Allocate every int4 projection's copy in tinygemm's layout where it applies (Int4Linear.allocate_tinygemm)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.allocate_tinygemm()


def fill_tinygemm(model: CausalLM) -> None:
    """Fill the copies `allocate_tinygemm` made, once the weights are in."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.fill_tinygemm()


def is_projection_tensor(name: str) -> bool:
    """A checkpoint tensor of a decoder projection (what a quantized artifact stores itself)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in PROJECTIONS


def layer_schemes(model: CausalLM) -> dict[str, str]:
    """Each linear layer's format, for the manifest and `graphkiln inspect`."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            out[name] = module.describe()
        elif isinstance(module, torch.nn.Linear):
            out[name] = f"{str(module.weight.dtype).removeprefix('torch.')} (not quantized)"
    return out
