"""Load a Hugging Face model directory: config.json plus (sharded) safetensors, straight to device/dtype.

The model is built on the meta device, materialized empty on the target device in the target
dtype, and filled by the weights reader (weights_reader.py): each checkpoint tensor's bytes go
from the file to its (slice of a) parameter through a few rotating staging buffers, never whole
on the host. Each filled tensor is then summed once (one device sync for all of them): a NaN or
Inf weight is refused by name instead of decoding token 0. One rank of a tensor-parallel group
(`shard`) reads only its rows or columns of each tensor (models/sharding.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from graphkiln.compat import to_empty
from graphkiln.errors import ConfigError, ModelFileError, WeightMismatchError
from graphkiln.timing import Stopwatch

from .config import ModelConfig, model_config_from_hf, read_hf_config
from .quant_scheme import QuantScheme, check_tensor_parallel, model_scheme
from .quantized_layers import (
    allocate_tinygemm,
    checkpoint_kinds,
    fill_quantized,
    fill_tinygemm,
    install_quantized,
    is_projection_tensor,
    load_quantized,
    quantize_model,
    reset_before_fill,
    sort_int4_columns,
)
from .quantized_linear import QuantizedLinear
from .quantized_shards import quantized_slice, sliced_shape
from .rope import rope_cache
from .sharding import Part, Shard, checkpoint_part, held_by_rank0_only, local_config
from .transformer import CausalLM
from .safetensors_header import TensorEntry, read_header
from .weights_reader import TensorRead, WeightsReader

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")
# a quantized checkpoint's KV cache scales (compressed-tensors, ModelOpt; AutoFP8's k/v output scales): the cache
# is the model dtype, or fp8 with scales of its own per row, never one static scale
KV_CACHE_SCALES = re.compile(r".*\.(k_scale|v_scale|kv_scale)$|.*\.[kv]_proj\.output_scale$")
FUSED = {  # checkpoint projection -> (fused parameter, index of its slice)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"dtype {dtype!r} is not supported; use one of float32, float16, bfloat16")


def check_model_dir(model_dir: str | Path) -> Path:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFileError(f"{model_dir}: not a directory; pass a Hugging Face model directory or 'tiny'")
    return model_dir


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it (single file or sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFileError(f"{index}: unreadable index ({e}); it needs a 'weight_map' object") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelFileError(f"{index}: 'weight_map' must map each tensor name to a file name; download it again")
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise ModelFileError(f"{path}: listed in {index.name} but missing; download it again")
        return files
    if single.is_file():
        return {name: single for name in read_header(single)}
    raise ModelFileError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
        "graphkiln loads safetensors checkpoints only"
    )


def _our_name(name: str) -> tuple[str, int | None]:
    """Our parameter name for a checkpoint tensor name, and which fused slice it fills (None: whole)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED:
        fused, index = FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), index
    return name, None


def _target(model: CausalLM, name: str) -> tuple[str, torch.Tensor, int | None]:
    """Our parameter for a checkpoint tensor name, and which fused slice it fills (None: whole)."""
    ours, index = _our_name(name)
    return ours, model.get_parameter(ours), index


def _slice(cfg: ModelConfig, param: torch.Tensor, fused_name: str, index: int) -> torch.Tensor:
    sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size] if fused_name.endswith(("qkv_proj.weight", "qkv_proj.bias")) else [
        cfg.intermediate_size,
        cfg.intermediate_size,
    ]
    return param.split(sizes, dim=0)[index]


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype="float32",
    cfg: ModelConfig | None = None,
    quantization: str | QuantScheme | None = None,
    quantized_weights: Path | None = None,
    clock: Stopwatch | None = None,
    shard: Shard = Shard(),
) -> CausalLM:
    """Build a CausalLM from a Hugging Face directory on `device` in `dtype`.

    `cfg` is the ModelConfig already read from this directory's config.json (an artifact's manifest
    records it, so a warm load never imports transformers); without it config.json is read here.
    A checkpoint quantized by its publisher loads as it is. `quantization` ("fp8", "int8", "int4") quantizes
    the decoder's projections after loading, or, with `quantized_weights` (the file an artifact holds),
    takes them from that file instead of the checkpoint; a QuantScheme (an artifact's record) is used
    as it is. `clock` gets the stage "weights" and the count "weight_bytes". `shard`: one tensor-parallel
    rank's part of the model.
    """
    model = empty_model(model_dir, device, dtype, cfg, quantization, quantized_weights, shard)
    fill_model(model, model_dir, clock)
    return model


def empty_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype="float32",
    cfg: ModelConfig | None = None,
    quantization: str | QuantScheme | None = None,
    quantized_weights: Path | None = None,
    shard: Shard = Shard(),
) -> CausalLM:
    """`load_model`'s model before its weights are read: every parameter allocated on `device`, uninitialised
    (what compiled pieces bind to may be bound now, and `fill_model` run beside that). Quantized projections
    are in place already where the checkpoint or `quantized_weights` holds them."""
    model_dir = check_model_dir(model_dir)
    device = torch.device(device)
    dtype = resolve_dtype(dtype)
    cfg = cfg or model_config_from_hf(read_hf_config(model_dir), model_dir)
    scheme = model_scheme(model_dir, quantization)
    check_tensor_parallel(scheme, shard.size)
    with torch.device("meta"):
        model = CausalLM(cfg, shard)
    model = model.to(dtype=dtype)
    if scheme is not None and (scheme.from_checkpoint or quantized_weights is not None):
        install_quantized(model, cfg, scheme, dtype, shard)
    model = to_empty(model, device)
    reset_before_fill(model)
    allocate_tinygemm(model)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.register_buffer("rope_cache", rope_cache(cfg, device), persistent=False)
    if shard.parallel:
        embed = model.model.embed_tokens
        start = torch.tensor(shard.rank * embed.rows, dtype=torch.int64, device=device)
        embed.register_buffer("vocab_start", start, persistent=False)
    model.weight_source = WeightSource(scheme, quantized_weights)
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class WeightSource:
    """Where `fill_model` takes an `empty_model`'s projections from: the checkpoint, quantized after
    (`scheme` applied at compile time), or an artifact's `quantized_weights` file."""

    scheme: QuantScheme | None
    quantized_weights: Path | None


def fill_model(model: CausalLM, model_dir: str | Path, clock: Stopwatch | None = None) -> None:
    """Read the checkpoint into an `empty_model`; refuse a missing, misplaced, misshapen or non-finite tensor."""
    clock = clock or Stopwatch()
    model_dir = check_model_dir(model_dir)
    source: WeightSource = model.weight_source
    skip = is_projection_tensor if source.quantized_weights is not None else lambda name: False
    files = {name: path for name, path in weight_files(model_dir).items() if not skip(name)}
    param = next(model.parameters())
    with clock.stage("weights"):
        filled, read = _fill_weights(model, model.cfg, files, param.device, param.dtype)
    clock.counts["weight_bytes"] = clock.counts.get("weight_bytes", 0) + read
    missing = sorted(n for n in _checkpoint_names(model) - filled if not skip(n))
    if missing:
        raise WeightMismatchError(
            f"{model_dir}: checkpoint lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            "the checkpoint does not match config.json"
        )
    sort_int4_columns(model)
    if source.quantized_weights is not None:
        load_quantized(model, source.quantized_weights)
    elif source.scheme is not None and not source.scheme.from_checkpoint:
        quantize_model(model, model.cfg, source.scheme)
    fill_tinygemm(model)


def _checkpoint_names(model: CausalLM) -> set[str]:
    """The checkpoint tensor names that fill every parameter (fused ones by their separate parts; a quantized
    projection by the tensors of its checkpoint's format)."""
    parts = {fused: [p for p, (f, _) in FUSED.items() if f == fused] for fused, _ in FUSED.values()}
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    owners = [name.rsplit(".", 1) for name, _ in model.named_parameters() if name.rsplit(".", 1)[0] not in quantized]
    owners += [(name, kind) for name, module in quantized.items() for kind in checkpoint_kinds(module)]
    names = set()
    for owner, kind in owners:
        *prefix, module = owner.split(".")
        for part in parts.get(module, [module]):
            names.add(".".join([*prefix, part, kind]))
    return names


def _fill_weights(model: CausalLM, cfg: ModelConfig, files: dict[Path, Path], device, dtype) -> tuple[set[str], int]:
    """Read every checkpoint tensor into its (slice of a) parameter; return the checkpoint names used and
    the bytes read."""
    headers = {path: read_header(path) for path in sorted(set(files.values()))}
    reads = []
    staged = []  # (quantized owner, entry, its tensor or this rank's slice of it) for fill_quantized
    held_by_rank0: set[str] = set()  # row-parallel biases, zero on the other ranks
    scheme = model.weight_source.scheme
    kv_scales = scheme is not None and scheme.from_checkpoint
    for name, path in files.items():
        if IGNORED_TENSORS.match(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if kv_scales and KV_CACHE_SCALES.match(name):
            continue
        entry = headers[path].get(name)
        if entry is None:
            raise ModelFileError(f"{path}: holds no tensor {name!r}, which the index lists there; download it again")
        if model.shard.rank and held_by_rank0_only(name):
            _destination(model, cfg, entry, None).zero_()
            held_by_rank0.add(name)
            continue
        part = checkpoint_part(cfg, model.shard, name)
        quantized = _quantized_owner(model, cfg, entry)
        if quantized:  # this rank's slice of the stored tensor, in the format's own layout
            projection = checkpoint_part(cfg, model.shard, f"{name.rsplit('.', 1)[0]}.weight")
            part = quantized_slice(quantized[0], quantized[1], entry.shape, projection, f"{path}: tensor {name!r}")
            dest = torch.empty(sliced_shape(entry.shape, part), dtype=entry.dtype, device=device)
        else:
            dest = _destination(model, cfg, entry, part)
        rows = cols = None
        if part is not None:  # this rank's rows (dim 0) or columns (dim 1)
            dim, start, stop = part
            rows, cols = ((start, stop), None) if dim == 0 else (None, (start, stop))
        reads.append(TensorRead(entry, dest, rows, cols))
        if quantized:
            staged.append((quantized, entry, dest))
    with torch.no_grad():
        stats = WeightsReader(device).read(reads)
        floats = [r for r in reads if r.dest.is_floating_point()]  # integers (packed int4) hold no NaN
        sums = [(r.entry, r.dest, total) for r, total in zip(floats, _magnitudes([r.dest for r in floats]))]
        for (module, kind, index), entry, tensor in staged:
            fill_quantized(module, kind, index, tensor, f"{entry.path}: tensor {entry.name!r}")
        _check_finite(sums, dtype)
    return {r.entry.name for r in reads} | held_by_rank0, stats.bytes


def _quantized_owner(model: CausalLM, cfg: ModelConfig, entry: TensorEntry) -> tuple | None:
    """(module, tensor kind, fused index) where the tensor fills a QuantizedLinear (read whole, or this rank's slice,
    then placed by fill_quantized, which fuses scales and reads int4 formats); None for a plain parameter. The kind
    need not be a parameter of the module: each format names its own tensors."""
    ours, index = _our_name(entry.name)
    owner, kind = ours.rsplit(".", 1) if "." in ours else ("", ours)
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return None  # _destination names the misplaced tensor
    return (module, kind, index) if isinstance(module, QuantizedLinear) else None


def _magnitudes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each floating-point tensor's sum of magnitudes in float32, finite unless the tensor holds NaN or Inf (or the
    sum overflows): one launch for all but the fp8 ones (a sum each would be a launch each), which torch cannot
    reduce, so those one at a time as float32."""
    out = [t.float().abs().sum() if _one_byte_float(t) else None for t in tensors]
    plain = [i for i, t in enumerate(tensors) if not _one_byte_float(t)]
    if plain:  # _foreach_norm refuses an empty list
        for i, total in zip(plain, torch._foreach_norm([tensors[i] for i in plain], 1, dtype=torch.float32)):
            out[i] = total
    return out


def _one_byte_float(tensor: torch.Tensor) -> bool:
    """Any float8 dtype (e4m3, e5m2, ...): a checkpoint may hold one its format does not name."""
    return tensor.is_floating_point() and tensor.element_size() == 1


def _numeric(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 tensors, which torch cannot sum or test for NaN, as float32."""
    return tensor.float() if _one_byte_float(tensor) else tensor


def _check_finite(sums: list[tuple[TensorEntry, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
    """A sum is finite unless its tensor holds NaN or Inf, or the sum overflows: the tensor is then checked whole."""
    if not sums or bool(torch.isfinite(torch.stack([s for *_, s in sums])).all()):
        return
    for entry, dest, total in sums:
        if not bool(torch.isfinite(total)) and not bool(torch.isfinite(_numeric(dest)).all()):
            source = torch.empty(entry.shape, dtype=entry.dtype)
            WeightsReader(torch.device("cpu")).read([TensorRead(entry, source)])
            if bool(torch.isfinite(_numeric(source)).all()):
                raise ModelFileError(
                    f"{entry.path}: tensor {entry.name!r} holds values beyond {str(dtype).removeprefix('torch.')}'s "
                    "range (they become Inf); load the model in bfloat16 or float32"
                )
            raise ModelFileError(
                f"{entry.path}: tensor {entry.name!r} holds NaN or Inf values; the checkpoint is corrupt, download or "
                "save it again"
            )


def _destination(model: CausalLM, cfg: ModelConfig, entry: TensorEntry, part: Part | None) -> torch.Tensor:
    """The (slice of a) parameter a checkpoint tensor (this rank's `part` of it) fills, its shape checked."""
    try:
        ours, param, index = _target(model, entry.name)
    except AttributeError:
        raise WeightMismatchError(
            f"{entry.path}: tensor {entry.name!r} has no place in a {cfg.architecture} with this config.json"
        ) from None
    dest = param if index is None else _slice(local_config(cfg, model.shard.size), param, ours, index)
    shape = entry.shape
    if part is not None:
        dim, start, stop = part
        shape = (*shape[:dim], stop - start, *shape[dim + 1 :])
    if model.shard.parallel and entry.name.endswith(("embed_tokens.weight", "lm_head.weight")):
        dest[shape[0] :].zero_()  # the vocabulary's padding rows, on the last rank
        dest = dest[: shape[0]]
    if tuple(dest.shape) != tuple(shape):
        raise WeightMismatchError(
            f"{entry.path}: tensor {entry.name!r} has shape {tuple(shape)} but config.json implies "
            f"{tuple(dest.shape)}; the checkpoint and config.json disagree"
        )
    if dest.is_floating_point() and not entry.dtype.is_floating_point:
        raise WeightMismatchError(
            f"{entry.path}: tensor {entry.name!r} is stored as {entry.dtype}, but the parameter it fills holds "
            "floating-point values; the file is damaged or mislabelled: download it again"
        )
    return dest
