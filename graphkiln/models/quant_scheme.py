"""Which quantization a model uses: the scheme compile-model asks for, or the one a checkpoint declares.

A scheme comes either from compile-model (`CompileConfig.quantization`: "fp8", "int8" or "int4",
the checkpoint's bf16/fp16 weights quantized at compile time) or from the checkpoint itself
(`quantization_config` in config.json): compressed-tensors fp8 (per channel, tensor or 128 x 128
block), int8 (W8A8, W8A16) or int4 (pack-quantized), read with the compressed-tensors library;
block-wise fp8 as published for Qwen3; AutoFP8's and NVIDIA ModelOpt's fp8; GPTQ int4 and int8 and
AWQ int4 (int4_checkpoints.py and int8_checkpoints.py read their tensors). compressed-tensors configs are
parsed in compressed_tensors_scheme.py. Anything else is
refused by name. A checkpoint's KV cache scales (its kv_cache_scheme) are read past: the loader
skips them, since the cache is the model dtype or fp8 with scales of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from graphkiln.errors import ConfigError, ModelFileError, UnsupportedModelError

from .int8_linear import GROUP as INT8_GROUP
from .quantized_linear import BLOCK

COMPILE_SCHEMES = ("fp8", "int8", "int4")
CHECKPOINT_FORMATS = (
    "compressed-tensors fp8 (float-quantized: per-tensor or per-channel weight scales, static per-tensor or "
    "dynamic per-token activations; 128 x 128 block weight scales with dynamic 1 x 128 group activations)",
    "compressed-tensors int4 (pack-quantized, weight-only, group or channel scales, symmetric or asymmetric, any "
    "actorder)",
    "compressed-tensors int8 (int-quantized or pack-quantized, symmetric per-channel or per-tensor weight scales; "
    "symmetric int8 activations, dynamic per token or static per tensor (W8A8), or none (W8A16, which may also "
    "have groups of 128))",
    "fp8 with weight_block_size [128, 128] and dynamic activations",
    "AutoFP8's fp8 (per-tensor weight scales, static or dynamic activations)",
    "ModelOpt fp8 (quant_algo FP8 or FP8_PER_CHANNEL_PER_TOKEN)",
    "GPTQ int4 (checkpoint_format gptq or gptq_v2, groups or group_size -1, desc_act true or false)",
    "GPTQ int8 (symmetric, groups of 128 or per channel, desc_act false)",
    "AWQ int4 (version gemm, with zero points)",
)
# the files older exports write beside a config.json without quantization_config: the object in each that holds the
# config (ModelOpt's "quantization", AutoGPTQ's and AutoAWQ's whole file), and the kind of tensor its format stores
SIDE_FILES = {"hf_quant_config.json": ("modelopt", "quantization", "weight_scale"),
              "quantize_config.json": ("gptq", None, "qweight"), "quant_config.json": ("awq", None, "qweight")}
INT4_GROUPS = "a power of two from 16 that divides every projection's input size"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class QuantScheme:
    """method "fp8", "int8" or "int4"; weights "channel", "tensor", "block" or "group"; activations "dynamic",
    "static" or "none" (weight-only); source "compile" or the checkpoint format ("compressed-tensors",
    "fp8" (block-wise, or AutoFP8's), "modelopt", "gptq", "gptq_v2", "awq"). An int4 checkpoint sets its `group_size`, whether it is
    `symmetric` (zero points of 8 that compressed-tensors does not store) and whether its groups are
    numbered in `act_order` (GPTQ's desc_act: a group index per input instead of runs of inputs);
    compile-model picks the group per layer (quantized_linear.int4_group_size) and quantizes
    asymmetrically. `packed`: an int8 checkpoint stores its weights as pack-quantized int32 words."""

    method: str
    weights: str
    activations: str
    source: str
    group_size: int | None = None
    symmetric: bool = False
    act_order: bool = False
    packed: bool = False

    @property
    def from_checkpoint(self) -> bool:
        return self.source != "compile"

    def describe(self) -> str:
        where = "quantized by compile-model" if not self.from_checkpoint else f"{self.source} checkpoint"
        activations = "weight-only" if self.activations == "none" else f"{self.activations} activations"
        weights = f"{self.weights} weight scales"
        if self.group_size:
            weights = f"{'symmetric' if self.symmetric else 'asymmetric'} groups of {self.group_size}"
            weights += " in act-order" if self.act_order else ""
        return f"{self.method}, {weights}, {activations} ({where})"


def compile_scheme(name: str) -> QuantScheme:
    if name == "fp8":
        return QuantScheme("fp8", "channel", "dynamic", "compile")
    if name == "int8":
        return QuantScheme("int8", "channel", "none", "compile", symmetric=True)
    if name == "int4":
        return QuantScheme("int4", "group", "none", "compile")
    raise ConfigError(f"quantization {name!r} is not supported; use one of {COMPILE_SCHEMES}")


def checkpoint_scheme(model_dir: Path) -> QuantScheme | None:
    """The scheme config.json's `quantization_config` declares (or, without one, a file that older ModelOpt,
    AutoGPTQ or AutoAWQ exports write beside it: SIDE_FILES), or None for an unquantized checkpoint."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
        qc = config.get("quantization_config")
        layers = config.get("num_hidden_layers", 1)
    except (OSError, ValueError, AttributeError):
        return None  # reading config.json itself reports what is wrong with it
    if qc is None:
        return _side_file_scheme(model_dir, layers)
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "compressed-tensors":  # its reader imports this module's helpers: imported where needed
        from .compressed_tensors_scheme import compressed_tensors_scheme

        return compressed_tensors_scheme(qc, path, layers)
    if method == "modelopt":
        return _modelopt_scheme(qc, path, layers)
    if method == "fp8":
        return _fp8_scheme(qc, path)
    if method == "gptq":
        return _gptq_scheme(qc, path)
    if method == "awq":
        return _awq_scheme(qc, path)
    raise unsupported(path, f"quant_method {method!r}")


def check_tensor_parallel(scheme: QuantScheme | None, tensor_parallel_size: int) -> None:
    """What tensor parallel does not split: act-order int4, whose groups in o and down are spread over every input,
    so no rank's share of their inputs holds whole groups."""
    if scheme is not None and tensor_parallel_size > 1 and scheme.act_order:
        raise UnsupportedModelError(
            f"tensor_parallel_size={tensor_parallel_size} with an {scheme.describe()}: act-order groups are spread "
            "over every input of o and down, so no rank's share of their inputs holds whole groups; serve it on one "
            "rank, or use a checkpoint quantized without act-order (desc_act false)"
        )


def unsupported(path: Path, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{path}: quantization_config: {what} is not supported; graphkiln loads {'; '.join(CHECKPOINT_FORMATS)}"
    )


def _names(qc: dict, field: str, path: Path, nested: bool = False) -> list:
    """quantization_config's list of module names `field` (of lists of names if `nested`), [] when absent."""
    value = qc.get(field) or []
    ok = isinstance(value, list) and all(
        isinstance(v, list) and all(isinstance(n, str) for n in v) if nested else isinstance(v, str) for v in value)
    if not ok:
        raise unsupported(path, f"{field} {value!r} (a list of {'lists of ' * nested}module names)")
    return value


def _fp8_scheme(qc: dict, path: Path) -> QuantScheme:
    """quant_method "fp8": 128 x 128 blocks (Qwen3's fp8, transformers' fine-grained fp8) or, without
    weight_block_size, AutoFP8's per-tensor weight scales; its dynamic activations are quantized per token
    here (finer than AutoFP8's one scale a tensor)."""
    block, activations = qc.get("weight_block_size"), qc.get("activation_scheme", "dynamic")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise unsupported(path, f"fp8 with fmt {qc.get('fmt')!r}")
    if block is None:
        if activations not in ("static", "dynamic"):
            raise unsupported(path, f"fp8 with activation_scheme {activations!r}")
        skipped = [m for m in _names(qc, "ignored_layers", path) if m.rsplit(".", 1)[-1] in PROJECTIONS]
        if skipped:
            raise unsupported(path, f"fp8 leaving projections unquantized (ignored_layers {skipped[:3]!r})")
        return QuantScheme("fp8", "tensor", activations, "fp8")
    if block != [BLOCK, BLOCK]:
        raise unsupported(path, f"fp8 with weight_block_size {block!r}")
    if activations != "dynamic":
        raise unsupported(path, f"block-wise fp8 with activation_scheme {activations!r}")
    return QuantScheme("fp8", "block", "dynamic", "fp8")


def projection_modules(num_layers: int) -> list[str]:
    """Every decoder projection's module name, as checkpoints of the supported families spell them."""
    return [f"model.layers.{i}.{'mlp' if p.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{p}"
            for i in range(num_layers) for p in PROJECTIONS]


def _side_file_scheme(model_dir: Path, num_layers: int) -> QuantScheme | None:
    """The scheme of the first of SIDE_FILES in `model_dir` whose format's tensors the checkpoint holds (a file left
    beside weights that are not quantized is not read), or None."""
    present = [(model_dir / name, *read) for name, read in SIDE_FILES.items() if (model_dir / name).is_file()]
    if not present:  # the common case: no tensor names read at all
        return None
    kinds = {name.rsplit(".", 1)[-1] for name in _tensor_names(model_dir)}
    for path, method, key, kind in present:
        if kind not in kinds:
            continue
        try:
            qc = json.loads(path.read_text())
            qc = qc[key] if key else qc
            if not isinstance(qc, dict):
                raise TypeError(f"it holds a {type(qc).__name__}, not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelFileError(f"{path}: unreadable ({e!r}); it needs {f'a {key!r} object' if key else 'an object'}"
                                 " with the quantization config") from e
        if method == "modelopt":
            return _modelopt_scheme(qc, path, num_layers)
        return _gptq_scheme(qc, path) if method == "gptq" else _awq_scheme(qc, path)
    return None


def _tensor_names(model_dir: Path) -> set[str]:
    """The checkpoint's tensor names (loader.weight_files); none where they do not read (loading then names what
    is wrong)."""
    from .loader import weight_files  # the loader reads schemes from here: imported when first needed

    try:
        return set(weight_files(model_dir))
    except (ModelFileError, OSError):
        return set()


def _modelopt_scheme(qc: dict, path: Path, num_layers: int) -> QuantScheme:
    """NVIDIA ModelOpt's fp8: quant_algo FP8 (one weight scale a projection, a static input scale) or
    FP8_PER_CHANNEL_PER_TOKEN (channel scales, dynamic per-token activations); every projection quantized."""
    algo = str(qc.get("quant_algo")).upper()
    schemes = {"FP8": ("tensor", "static"), "FP8_PER_CHANNEL_PER_TOKEN": ("channel", "dynamic")}
    if algo not in schemes:
        raise unsupported(path, f"ModelOpt quant_algo {qc.get('quant_algo')!r}")
    excluded = _names(qc, "ignore" if "ignore" in qc else "exclude_modules", path)
    kept = [p for p in excluded if any(fnmatch(m, p) or p in m for m in projection_modules(num_layers))]
    if kept:
        raise unsupported(path, f"ModelOpt leaving projections unquantized (excluded {kept[:3]!r})")
    return QuantScheme("fp8", *schemes[algo], "modelopt")


def check_int4_group(group, path: Path, what: str) -> int:
    if not isinstance(group, int) or isinstance(group, bool) or group < 16 or group & (group - 1):
        raise unsupported(path, f"{what} group_size {group!r} (int4 groups must be {INT4_GROUPS})")
    return group


def _gptq_scheme(qc: dict, path: Path) -> QuantScheme:
    """GPTQ (AutoGPTQ, GPTQModel): 4 bits, every projection; desc_act numbers each input's group (act-order). The
    layout is `checkpoint_format` (or `format`, as some AutoGPTQ versions write it): gptq, whose zero points are
    stored minus one, or gptq_v2; `is_marlin_format` is Marlin's own layout."""
    bits = qc.get("bits")
    fmt = "marlin" if qc.get("is_marlin_format") else qc.get("checkpoint_format", qc.get("format", "gptq"))
    if bits not in (4, 8):
        raise unsupported(path, f"GPTQ with bits {bits!r} (graphkiln reads 4-bit and 8-bit GPTQ)")
    if fmt not in ("gptq", "gptq_v2"):
        raise unsupported(path, f"GPTQ checkpoint_format {fmt!r}")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise unsupported(path, f"GPTQ pack_dtype {qc['pack_dtype']!r} (graphkiln reads int32 words)")
    if qc.get("lm_head"):
        raise unsupported(path, "a quantized lm_head")
    if qc.get("dynamic"):
        raise unsupported(path, f"GPTQ per-module overrides (dynamic: {qc['dynamic']!r})")
    if blocks := _names(qc, "modules_in_block_to_quantize", path, nested=True):
        named = {m.rsplit(".", 1)[-1] for ms in blocks for m in ms}
        if not set(PROJECTIONS) <= named:
            raise unsupported(path, f"GPTQ leaving {sorted(set(PROJECTIONS) - named)} unquantized")
    if bits == 8:
        return _gptq_int8_scheme(qc, path, fmt)
    if qc.get("group_size") == -1:  # one group a row: its order (desc_act) changed only the calibration
        return QuantScheme("int4", "channel", "none", fmt, None, bool(qc.get("sym", True)))
    group = check_int4_group(qc.get("group_size"), path, "GPTQ")
    return QuantScheme("int4", "group", "none", fmt, group, bool(qc.get("sym", True)), bool(qc.get("desc_act")))


def _gptq_int8_scheme(qc: dict, path: Path, fmt: str) -> QuantScheme:
    """8-bit GPTQ (Qwen's -GPTQ-Int8): symmetric, groups of INT8_GROUP or a scale per channel (group_size -1), no
    act-order."""
    group = qc.get("group_size")
    if not qc.get("sym", True):
        raise unsupported(path, "asymmetric 8-bit GPTQ (graphkiln reads symmetric int8)")
    if qc.get("desc_act"):
        raise unsupported(path, "8-bit GPTQ with desc_act (act-order int8)")
    if group not in (INT8_GROUP, -1):
        raise unsupported(path, f"8-bit GPTQ group_size {group!r} (graphkiln reads {INT8_GROUP}, or -1: per channel)")
    if group == -1:
        return QuantScheme("int8", "channel", "none", fmt, None, True)
    return QuantScheme("int8", "group", "none", fmt, group, True)


def _awq_scheme(qc: dict, path: Path) -> QuantScheme:
    """AWQ (AutoAWQ) in its gemm layout, with zero points, every projection."""
    version, bits = str(qc.get("version", "gemm")).lower(), qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise unsupported(path, f"AWQ with bits {bits!r}")
    if version != "gemm":
        raise unsupported(path, f"AWQ version {version!r} (graphkiln reads the gemm layout)")
    if not qc.get("zero_point", True):
        raise unsupported(path, "AWQ without zero points")
    kept = [m for m in _names(qc, "modules_to_not_convert", path) if any(m in p or p in m for p in PROJECTIONS)]
    if kept:
        raise unsupported(path, f"AWQ leaving projections unquantized (modules_to_not_convert {kept!r})")
    group = check_int4_group(qc.get("group_size", qc.get("q_group_size")), path, "AWQ")
    return QuantScheme("int4", "group", "none", "awq", group, False)


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
