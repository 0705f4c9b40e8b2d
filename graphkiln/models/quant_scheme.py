"""Which quantization a model uses: the scheme compile-model asks for, or the one a checkpoint declares.

A scheme comes either from compile-model (`CompileConfig.quantization`: "fp8" or "int4", the
checkpoint's bf16/fp16 weights quantized at compile time) or from the checkpoint itself
(`quantization_config` in config.json): compressed-tensors fp8, read with the compressed-tensors
library, or block-wise fp8 as published for Qwen3. Anything else is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from graphkiln.errors import ConfigError, UnsupportedModelError

from .quantized_linear import BLOCK

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


def model_scheme(model_dir: Path, quantization: str | QuantScheme | None) -> QuantScheme | None:
    """The checkpoint's own scheme, else the one compile-model asks for; both at once is an error. A QuantScheme
    (the one an artifact's manifest records) is taken as it is, without reading config.json again: parsing a
    compressed-tensors config imports that library and transformers, which a warm load must not."""
    if isinstance(quantization, QuantScheme):
        return quantization
    found = checkpoint_scheme(model_dir)
    if found is not None and quantization is not None:
        raise ConfigError(
            f"CompileConfig.quantization={quantization!r}, but {model_dir / 'config.json'} is already quantized "
            f"({found.describe()}); compile it without --quantization"
        )
    return found if found is not None else (compile_scheme(quantization) if quantization else None)
