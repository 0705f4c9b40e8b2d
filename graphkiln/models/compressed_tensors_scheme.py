"""compressed-tensors checkpoints' quantization_config (llm-compressor's formats), parsed and validated by the
compressed-tensors library: which one QuantScheme every decoder projection falls under (fp8 per tensor, channel
or 128 x 128 block; int8 W8A8 or W8A16; int4 pack-quantized), or an UnsupportedModelError naming what does not
fit. Imported only where a config names compressed-tensors, as is that library (and, through it, transformers).
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphkiln.errors import ConfigError, UnsupportedModelError

from .int8_linear import GROUP as INT8_GROUP
from .quant_scheme import QuantScheme, check_int4_group, projection_modules, unsupported
from .quantized_linear import BLOCK

FP8_FORMATS = ("float-quantized", "naive-quantized")
INT8_FORMATS = ("int-quantized", "naive-quantized")
PACKED_FORMAT = "pack-quantized"


def compressed_tensors_scheme(qc: dict, path: Path, num_layers: int) -> QuantScheme:
    """Parsed and validated by the compressed-tensors library; every decoder projection must fall under one
    fp8 or int4 scheme, and the LM head under none."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
        from compressed_tensors.utils.match import is_match
    except ImportError:
        raise ConfigError(
            f"{path}: a compressed-tensors checkpoint; reading it needs the compressed-tensors package: "
            "pip install 'graphkiln[quant]'"
        ) from None
    if not isinstance(qc.get("config_groups") or {}, dict):
        raise unsupported(path, f"config_groups {qc['config_groups']!r} (an object of named groups)")
    qc, numbered = _without_numbered_groups(qc)
    try:
        config = QuantizationConfig.model_validate(qc)
    except ValueError as e:
        raise UnsupportedModelError(f"{path}: quantization_config is not a valid compressed-tensors config: {e}") from e
    if config.format not in {*FP8_FORMATS, *INT8_FORMATS, PACKED_FORMAT}:
        raise unsupported(path, f"compressed-tensors format {config.format!r}")
    linear = torch.nn.Linear(1, 1, device="meta")
    schemes = set()
    for module in [*projection_modules(num_layers), "lm_head"]:
        groups = [(name, g) for name, g in config.config_groups.items()
                  if is_match(module, linear, g.targets, config.ignore)]
        if module == "lm_head":
            if groups:
                raise unsupported(path, "a quantized lm_head")
            continue
        if len(groups) != 1:
            raise unsupported(path, f"{len(groups)} config_groups for {module} (graphkiln needs exactly one)")
        name, group = groups[0]
        schemes.add(_group_args(group, path, name in numbered, config.format == PACKED_FORMAT))
    if len(schemes) != 1:
        raise unsupported(path, f"different schemes per projection {sorted(schemes)}")
    scheme = QuantScheme(*schemes.pop())
    formats = {"fp8": FP8_FORMATS, "int8": (*INT8_FORMATS, PACKED_FORMAT), "int4": (PACKED_FORMAT,)}
    if config.format not in formats[scheme.method]:
        raise unsupported(path, f"{scheme.describe()} in compressed-tensors format {config.format!r}")
    return scheme


def _group_args(group, path: Path, numbered: bool, packed: bool) -> tuple:
    """QuantScheme's fields for one config group, by its weights' type and bits."""
    w = group.weights
    kind = (_value(w.type), w.num_bits) if w is not None else None
    if kind == ("int", 4):
        return _int4_args(group, path, numbered)
    if kind == ("int", 8):
        return _int8_args(group, path, packed)
    return _fp8_args(group, path)


def _value(field) -> str | None:
    """An enum field of compressed-tensors' config as its string (the library returns either)."""
    return getattr(field, "value", field)


def _without_numbered_groups(qc: dict) -> tuple[dict, set[str]]:
    """`qc` with actorder "group" (alias "dynamic", or True) taken out, and the config groups that had it: it
    numbers each input's group (a `weight_g_idx` per projection), as older llm-compressor checkpoints do, and
    compressed-tensors 0.20 no longer parses it. actorder "weight" changes only the calibration."""
    numbered = {name for name, group in (qc.get("config_groups") or {}).items()
                if isinstance(group, dict) and isinstance(group.get("weights"), dict)
                and group["weights"].get("actorder") in ("group", "dynamic", True)}
    if not numbered:
        return qc, numbered
    groups = {name: {**g, "weights": {**g["weights"], "actorder": None}} if name in numbered else g
              for name, g in qc["config_groups"].items()}
    return {**qc, "config_groups": groups}, numbered


def _int4_args(group, path: Path, numbered: bool) -> tuple:
    """QuantScheme's fields for one int4 config group: weight-only, group scales, `numbered` groups (act-order)."""
    w, a = group.weights, group.input_activations
    if a is not None:
        raise unsupported(path, f"int4 weights with quantized activations {a!r}")
    if _value(w.strategy) == "channel":
        return "int4", "channel", "none", "compressed-tensors", None, bool(w.symmetric), False
    if _value(w.strategy) != "group":
        raise unsupported(path, f"int4 weights with strategy {_value(w.strategy)!r} (graphkiln takes groups or "
                                 "channels)")
    group = check_int4_group(w.group_size, path, "compressed-tensors")
    return "int4", "group", "none", "compressed-tensors", group, bool(w.symmetric), numbered


def _int8_args(group, path: Path, packed: bool) -> tuple:
    """QuantScheme's fields for one int8 config group: symmetric weights with channel (or tensor) scales, and
    symmetric int8 activations per token (dynamic) or per tensor (static), or none (W8A16)."""
    w, a = group.weights, group.input_activations
    strategy = _value(w.strategy)
    grouped = strategy == "group" and w.group_size == INT8_GROUP and a is None
    if not w.symmetric or (strategy not in ("channel", "tensor") and not grouped):
        raise unsupported(path, f"int8 weights {w!r} (graphkiln takes symmetric ones with per-channel or "
                                 f"per-tensor scales, or weight-only with groups of {INT8_GROUP})")
    if a is None:
        return "int8", strategy, "none", "compressed-tensors", w.group_size if grouped else None, True, False, packed
    if a.num_bits != 8 or _value(a.type) != "int" or not a.symmetric:
        raise unsupported(path, f"int8 weights with input_activations {a!r} (graphkiln takes symmetric int8 ones)")
    if a.dynamic is True and _value(a.strategy) == "token":
        return "int8", strategy, "dynamic", "compressed-tensors", None, True, False, packed
    if a.dynamic is False and _value(a.strategy) == "tensor":
        return "int8", strategy, "static", "compressed-tensors", None, True, False, packed
    raise unsupported(path, f"int8 input_activations strategy {_value(a.strategy)!r} with dynamic={a.dynamic!r}")


def _fp8_args(group, path: Path) -> tuple:
    """QuantScheme's fields for one fp8 config group."""
    w, a = group.weights, group.input_activations
    if _fp8_blocks(w, a):  # llm-compressor's FP8_BLOCK
        return "fp8", "block", "dynamic", "compressed-tensors"
    if w is None or w.num_bits != 8 or _value(w.type) != "float" or not w.symmetric or _value(w.strategy) not in ("tensor", "channel"):
        raise unsupported(path, f"weights {w!r}")
    if a is None:
        raise unsupported(path, "fp8 weights with unquantized activations")
    if a.num_bits != 8 or _value(a.type) != "float" or not a.symmetric:
        raise unsupported(path, f"input_activations {a!r}")
    if a.dynamic is True and _value(a.strategy) == "token":
        return "fp8", _value(w.strategy), "dynamic", "compressed-tensors"
    if a.dynamic is False and _value(a.strategy) == "tensor":
        return "fp8", _value(w.strategy), "static", "compressed-tensors"
    raise unsupported(path, f"input_activations strategy {_value(a.strategy)!r} with dynamic={a.dynamic!r}")


def _fp8_blocks(w, a) -> bool:
    """Whether fp8 weights and activations are in 128 x 128 blocks and dynamic 1 x 128 groups."""
    if w is None or a is None or _value(w.strategy) != "block" or _value(a.strategy) != "group":
        return False
    weights = (w.num_bits == 8 and _value(w.type) == "float" and w.symmetric
               and list(w.block_structure or []) == [BLOCK, BLOCK])
    inputs = a.num_bits == 8 and _value(a.type) == "float" and a.symmetric and a.dynamic is True
    return weights and inputs and a.group_size == BLOCK
