"""Sizing the KV cache: from free device memory on CUDA, from an explicit token count on the CPU."""

from __future__ import annotations

import torch

from graphkiln.compiler.config import check_block_size
from graphkiln.errors import ConfigError
from graphkiln.models.config import ModelConfig

from .kv_cache import KVCache

DEFAULT_CPU_KV_TOKENS = 16384


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device ({e}); use 'cpu' or 'cuda'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but this machine has no CUDA device; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return dev


def kv_cache_blocks(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    kv_cache_tokens: int | None,
    gpu_memory_fraction: float,
) -> int:
    """Number of KV blocks (the dummy block included) to allocate."""
    check_block_size(block_size, "block_size")
    if not 0 < gpu_memory_fraction <= 1:
        raise ConfigError(f"gpu_memory_fraction={gpu_memory_fraction}; it must be in (0, 1]")
    if kv_cache_tokens is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            usable = free - (1 - gpu_memory_fraction) * total
            kv_cache_tokens = int(usable // KVCache.bytes_per_token(cfg, dtype))
        else:
            kv_cache_tokens = DEFAULT_CPU_KV_TOKENS
    if kv_cache_tokens < block_size:
        raise ConfigError(
            f"KV cache of {kv_cache_tokens} tokens is smaller than one block of {block_size}; "
            "raise kv_cache_tokens or gpu_memory_fraction"
        )
    return kv_cache_tokens // block_size + 1
