"""Which quantization a model uses, and its quantized linear layers: built, filled and quantized.

A scheme comes either from compile-model (`CompileConfig.quantization`: "fp8" or "int4", the
checkpoint's bf16/fp16 weights quantized here) or from the checkpoint itself (`quantization_config`
in config.json: compressed-tensors fp8, or block-wise fp8 as published for Qwen3). Either way the
decoder's projections (q/k/v, o, gate/up, down) become the modules of `quantized_linear.py`;
embeddings, norms and the LM head stay in the model dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from graphkiln.errors import ArtifactError, ConfigError, UnsupportedModelError, WeightMismatchError

from .config import ModelConfig
from .quantized_linear import (
    BLOCK,
    FP8,
    BlockFp8Linear,
    Fp8Linear,
    Int4Linear,
    QuantizedLinear,
    int4_group_size,
    quantize_fp8,
    quantize_int4,
)
from .transformer import CausalLM

COMPILE_SCHEMES = ("fp8", "int4")
CHECKPOINT_FORMATS = (
    "compressed-tensors fp8 (float-quantized: per-tensor or per-channel weight scales, static per-tensor or "
    "dynamic per-token activations)",
    "fp8 with weight_block_size [128, 128] and dynamic activations",
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class QuantScheme:
    """method "fp8" or "int4"; weights "channel", "tensor", "block" or "group"; activations "dynamic",
    "static" or "none" (weight-only); source "compile" or the checkpoint format."""

    method: str
    weights: str
    activations: str
    source: str

    @property
    def from_checkpoint(self) -> bool:
        return self.source != "compile"

    def describe(self) -> str:
        where = "quantized by compile-model" if not self.from_checkpoint else f"{self.source} checkpoint"
        activations = "weight-only" if self.activations == "none" else f"{self.activations} activations"
        return f"{self.method}, {self.weights} weight scales, {activations} ({where})"


def compile_scheme(name: str) -> QuantScheme:
    if name == "fp8":
        return QuantScheme("fp8", "channel", "dynamic", "compile")
    if name == "int4":
        return QuantScheme("int4", "group", "none", "compile")
    raise ConfigError(f"quantization {name!r} is not supported; use one of {COMPILE_SCHEMES}")


def checkpoint_scheme(model_dir: Path) -> QuantScheme | None:
    """The scheme config.json's `quantization_config` declares, or None for an unquantized checkpoint."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
        qc = config.get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # reading config.json itself reports what is wrong with it
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, path, config.get("num_hidden_layers", 1))
    if method == "fp8":
        return _block_fp8_scheme(qc, path)
    raise _unsupported(path, f"quant_method {method!r}")


def _unsupported(path: Path, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{path}: quantization_config: {what} is not supported; graphkiln loads {'; '.join(CHECKPOINT_FORMATS)}"
    )


def _block_fp8_scheme(qc: dict, path: Path) -> QuantScheme:
    block, activations = qc.get("weight_block_size"), qc.get("activation_scheme", "dynamic")
    if block != [BLOCK, BLOCK]:
        raise _unsupported(path, f"fp8 with weight_block_size {block!r}")
    if activations != "dynamic" or qc.get("fmt", "e4m3") != "e4m3":
        raise _unsupported(path, f"fp8 with activation_scheme {activations!r} and fmt {qc.get('fmt')!r}")
    return QuantScheme("fp8", "block", "dynamic", "fp8")


def _compressed_tensors_scheme(qc: dict, path: Path, num_layers: int) -> QuantScheme:
    """Parsed and validated by the compressed-tensors library; every decoder projection must fall under one
    fp8 scheme, and the LM head under none."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
        from compressed_tensors.utils.match import is_match
    except ImportError:
        raise ConfigError(
            f"{path}: a compressed-tensors checkpoint; reading it needs the compressed-tensors package: "
            "pip install 'graphkiln[quant]'"
        ) from None
    try:
        config = QuantizationConfig.model_validate(qc)
    except ValueError as e:
        raise UnsupportedModelError(f"{path}: quantization_config is not a valid compressed-tensors config: {e}") from e
    if config.format not in CT_FORMATS:
        raise _unsupported(path, f"compressed-tensors format {config.format!r}")
    if config.kv_cache_scheme is not None:
        raise _unsupported(path, "compressed-tensors kv_cache_scheme")
    linear = torch.nn.Linear(1, 1, device="meta")
    schemes = set()
    modules = [f"model.layers.{i}.{'mlp' if p.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{p}"
               for i in range(num_layers) for p in PROJECTIONS]
    for module in [*modules, "lm_head"]:
        groups = [g for g in config.config_groups.values() if is_match(module, linear, g.targets, config.ignore)]
        if module == "lm_head":
            if groups:
                raise _unsupported(path, "a quantized lm_head")
            continue
        if len(groups) != 1:
            raise _unsupported(path, f"{len(groups)} config_groups for {module} (graphkiln needs exactly one)")
        schemes.add(_fp8_args(groups[0], path))
    if len(schemes) != 1:
        raise _unsupported(path, f"different schemes per projection {sorted(schemes)}")
    weights, activations = schemes.pop()
    return QuantScheme("fp8", weights, activations, "compressed-tensors")


def _value(field) -> str | None:
    """An enum field of compressed-tensors' config as its string (the library returns either)."""
    return getattr(field, "value", field)


def _fp8_args(group, path: Path) -> tuple[str, str]:
    """(weight scales, activations) of one fp8 config group."""
    w, a = group.weights, group.input_activations
    if w is None or w.num_bits != 8 or _value(w.type) != "float" or not w.symmetric or _value(w.strategy) not in ("tensor", "channel"):
        raise _unsupported(path, f"weights {w!r}")
    if a is None:
        raise _unsupported(path, "fp8 weights with unquantized activations")
    if a.num_bits != 8 or _value(a.type) != "float" or not a.symmetric:
        raise _unsupported(path, f"input_activations {a!r}")
    if a.dynamic is True and _value(a.strategy) == "token":
        return _value(w.strategy), "dynamic"
    if a.dynamic is False and _value(a.strategy) == "tensor":
        return _value(w.strategy), "static"
    raise _unsupported(path, f"input_activations strategy {_value(a.strategy)!r} with dynamic={a.dynamic!r}")


def model_scheme(model_dir: Path, quantization: str | None) -> QuantScheme | None:
    """The checkpoint's own scheme, else the one compile-model asks for; both at once is an error."""
    found = checkpoint_scheme(model_dir)
    if found is not None and quantization is not None:
        raise ConfigError(
            f"CompileConfig.quantization={quantization!r}, but {model_dir / 'config.json'} is already quantized "
            f"({found.describe()}); compile it without --quantization"
        )
    return found if found is not None else (compile_scheme(quantization) if quantization else None)


def _projections(model: CausalLM, cfg: ModelConfig):
    """(parent module, attribute, in_features, fused parts, has bias) of every decoder projection."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield attn, "qkv_proj", cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.qkv_bias
        yield attn, "o_proj", cfg.q_size, (cfg.hidden_size,), cfg.o_bias
        yield mlp, "gate_up_proj", cfg.hidden_size, (cfg.intermediate_size,) * 2, cfg.mlp_bias
        yield mlp, "down_proj", cfg.intermediate_size, (cfg.hidden_size,), cfg.mlp_bias


def _module(scheme: QuantScheme, in_features: int, parts: tuple[int, ...], bias: bool, dtype) -> QuantizedLinear:
    if scheme.method == "int4":
        group = int4_group_size(in_features)
        if group is None:
            raise UnsupportedModelError(f"int4 needs a layer's input size divisible by 16; a layer has {in_features}")
        return Int4Linear(in_features, parts, bias, dtype, group)
    if scheme.weights == "block":
        if len(parts) > 1 and any(p % BLOCK for p in parts):
            raise UnsupportedModelError(
                f"block-wise fp8 with fused projections of sizes {parts}: each must be a multiple of {BLOCK}"
            )
        return BlockFp8Linear(in_features, parts, bias, dtype)
    return Fp8Linear(in_features, parts, bias, dtype, static_input=scheme.activations == "static")


def install_quantized(model: CausalLM, cfg: ModelConfig, scheme: QuantScheme, dtype: torch.dtype) -> None:
    """Replace every decoder projection of a model on the meta device by an empty quantized module."""
    with torch.device("meta"):
        for parent, name, in_features, parts, bias in _projections(model, cfg):
            setattr(parent, name, _module(scheme, in_features, parts, bias, dtype))


def reset_input_scales(model: CausalLM) -> None:
    """Static activation scales start at zero: the fused parts' scales are combined by their maximum."""
    for module in model.modules():
        if isinstance(module, Fp8Linear) and module.input_scale is not None:
            module.input_scale.zero_()


def fill_quantized(module: QuantizedLinear, kind: str, index: int | None, tensor: torch.Tensor, where: str) -> torch.Tensor:
    """Copy one checkpoint tensor (`kind` of fused part `index`, None: unfused) into `module`; return its
    destination. Per-tensor weight scales are spread over their part's channels; the static activation
    scales of fused parts are combined by their maximum, which every part's activations fit."""
    part = 0 if index is None else index
    if kind == "input_scale":
        dest = module.input_scale
        _check_shape(tensor.reshape(-1), (1,), where)
        return dest.copy_(torch.maximum(dest, tensor.float().reshape(1)))
    if kind == "bias":
        dest = module.bias.split(module.parts)[part]
        _check_shape(tensor, dest.shape, where)
        return dest.copy_(tensor)
    if kind == "weight":
        dest = module.weight.split(module.parts)[part]
        _check_shape(tensor, dest.shape, where)
        if tensor.dtype != FP8:
            raise WeightMismatchError(f"{where}: dtype {tensor.dtype}, the checkpoint's quantization_config needs {FP8}")
        return dest.copy_(tensor)
    if kind == "weight_scale_inv" and isinstance(module, BlockFp8Linear):
        dest = module.weight_scale_inv.split([-(-p // BLOCK) for p in module.parts])[part]
        _check_shape(tensor, dest.shape, where)
        return dest.copy_(tensor)
    if kind == "weight_scale" and not isinstance(module, BlockFp8Linear):
        dest = module.weight_scale.split(module.parts)[part]
        values = tensor.float().reshape(-1)
        if values.numel() == 1:
            values = values.expand(dest.shape)
        _check_shape(values, dest.shape, where)
        return dest.copy_(values)
    raise WeightMismatchError(f"{where}: no place for a {kind!r} tensor in a {type(module).__name__}")


def _check_shape(tensor: torch.Tensor, shape, where: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise WeightMismatchError(
            f"{where}: shape {tuple(tensor.shape)} but config.json and quantization_config imply {tuple(shape)}"
        )


@torch.no_grad()
def quantize_model(model: CausalLM, cfg: ModelConfig, scheme: QuantScheme) -> None:
    """Quantize every decoder projection of a loaded model in place, one layer at a time."""
    for parent, name, in_features, parts, bias in _projections(model, cfg):
        linear = getattr(parent, name)
        weight = linear.weight
        with torch.device(weight.device):
            module = _module(scheme, in_features, parts, bias, weight.dtype)
        if isinstance(module, Int4Linear):
            for dest, value in zip((module.qweight, module.scales, module.zeros), quantize_int4(weight, module.group_size)):
                dest.copy_(value)
        else:
            q, scale = quantize_fp8(weight)
            module.weight.copy_(q)
            module.weight_scale.copy_(scale)
        if bias:
            module.bias.copy_(linear.bias)
        setattr(parent, name, module)


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
