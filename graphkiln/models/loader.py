"""Load a Hugging Face model directory: config.json plus (sharded) safetensors, straight to device/dtype.

The model is built on the meta device, materialized empty on the target device in the target
dtype, and filled one checkpoint tensor at a time, so at most one tensor exists twice in memory.
Each filled tensor is summed once as it lands (one pass over memory the copy just touched, one
device sync for all of them): a NaN or Inf weight is refused by name instead of decoding token 0.
One rank of a tensor-parallel group (`shard`) reads only its slices of each tensor (models/sharding.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from graphkiln.errors import ConfigError, ModelFileError, WeightMismatchError

from .config import ModelConfig, model_config_from_hf, read_hf_config
from .rope import rope_cache
from .sharding import Shard, checkpoint_part, held_by_rank0_only, local_config, read_part
from .transformer import CausalLM

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
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise ModelFileError(f"{path}: listed in {index.name} but missing; download it again")
        return files
    if single.is_file():
        return {name: single for name in _tensor_names(single)}
    raise ModelFileError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json; "
        "graphkiln loads safetensors checkpoints only"
    )


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ModelFileError(f"{path}: not a readable safetensors file ({e}); download it again") from e


def _target(model: CausalLM, name: str) -> tuple[str, torch.Tensor, int | None]:
    """Our parameter for a checkpoint tensor name, and which fused slice it fills (None: whole)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED:
        fused, index = FUSED[parts[-2]]
        ours = ".".join(parts[:-2] + [fused, parts[-1]])
        return ours, model.get_parameter(ours), index
    return name, model.get_parameter(name), None


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
    shard: Shard = Shard(),
) -> CausalLM:
    """Build a CausalLM from a Hugging Face directory on `device` in `dtype`; with `shard`, that rank's part.

    `cfg` is the ModelConfig already read from this directory's config.json (an artifact's manifest
    records it, so a warm load never imports transformers); without it config.json is read here.
    """
    model_dir = check_model_dir(model_dir)
    device = torch.device(device)
    dtype = resolve_dtype(dtype)
    cfg = cfg or model_config_from_hf(read_hf_config(model_dir), model_dir)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg, shard)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    filled = _fill_weights(model, cfg, shard, files, device, dtype)
    missing = sorted(_checkpoint_names(model) - filled)
    if missing:
        raise WeightMismatchError(
            f"{model_dir}: checkpoint lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            "the checkpoint does not match config.json"
        )
    model.model.register_buffer("rope_cache", rope_cache(cfg, device), persistent=False)
    if shard.parallel:
        embed = model.model.embed_tokens
        start = torch.tensor(shard.rank * embed.rows, dtype=torch.int64, device=device)
        embed.register_buffer("vocab_start", start, persistent=False)
    return model.eval().requires_grad_(False)


def _checkpoint_names(model: CausalLM) -> set[str]:
    """The checkpoint tensor names that fill every parameter (fused ones by their separate parts)."""
    parts = {fused: [p for p, (f, _) in FUSED.items() if f == fused] for fused, _ in FUSED.values()}
    names = set()
    for name, _ in model.named_parameters():
        *prefix, module, kind = name.split(".")
        for part in parts.get(module, [module]):
            names.add(".".join([*prefix, part, kind]))
    return names


def _fill_weights(
    model: CausalLM, cfg: ModelConfig, shard: Shard, files: dict[str, Path], device, dtype
) -> set[str]:
    """Copy every checkpoint tensor (this rank's part) into its (slice of a) parameter; return the checkpoint
    names used."""
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    filled: set[str] = set()
    sums: list[tuple[Path, str, torch.Tensor, torch.Tensor]] = []  # (file, name, filled slice, its sum)
    with torch.no_grad():
        for path, names in by_file.items():
            try:
                with safe_open(str(path), framework="pt", device=str(device)) as f:
                    for name in names:
                        if IGNORED_TENSORS.match(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                            continue
                        if shard.rank and held_by_rank0_only(name):
                            _target(model, name)[1].zero_()
                            filled.add(name)
                            continue
                        tensor = read_part(f, name, checkpoint_part(cfg, shard, name))
                        dest = _copy_tensor(model, cfg, name, tensor, path, filled, dtype)
                        sums.append((path, name, dest, _sum(dest)))
            except (SafetensorError, OSError) as e:
                raise ModelFileError(f"{path}: not a readable safetensors file ({e}); download it again") from e
        _check_finite(sums, dtype)
    return filled


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum, accumulated and returned in float32 for float16 (whose sums of finite weights overflow)."""
    return tensor.sum(dtype=torch.float32 if tensor.dtype == torch.float16 else None)


def _check_finite(sums: list[tuple[Path, str, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
    """A sum is finite unless its tensor holds NaN or Inf, or the sum overflows: the tensor is then checked whole."""
    if not sums or bool(torch.isfinite(torch.stack([s for *_, s in sums])).all()):
        return
    for path, name, dest, total in sums:
        if not bool(torch.isfinite(total)) and not bool(torch.isfinite(dest).all()):
            with safe_open(str(path), framework="pt") as f:
                finite_source = bool(torch.isfinite(f.get_tensor(name)).all())
            if finite_source:
                raise ModelFileError(
                    f"{path}: tensor {name!r} holds values beyond {str(dtype).removeprefix('torch.')}'s range "
                    "(they become Inf); load the model in bfloat16 or float32"
                )
            raise ModelFileError(
                f"{path}: tensor {name!r} holds NaN or Inf values; the checkpoint is corrupt, download or save it again"
            )


def _copy_tensor(model, cfg, name, tensor, path, filled, dtype) -> torch.Tensor:
    try:
        ours, param, index = _target(model, name)
    except AttributeError:
        raise WeightMismatchError(
            f"{path}: tensor {name!r} has no place in a {cfg.architecture} with this config.json"
        ) from None
    dest = param if index is None else _slice(local_config(cfg, model.shard.size), param, ours, index)
    if model.shard.parallel and name.endswith(("embed_tokens.weight", "lm_head.weight")):
        dest[tensor.shape[0] :].zero_()  # the vocabulary's padding rows, on the last rank
        dest = dest[: tensor.shape[0]]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise WeightMismatchError(
            f"{path}: tensor {name!r} has shape {tuple(tensor.shape)} but config.json implies "
            f"{tuple(dest.shape)}; the checkpoint and config.json disagree"
        )
    dest.copy_(tensor.to(dtype))
    filled.add(name)
    return dest
