"""Sizing the KV cache: from free device memory on CUDA, from an explicit token count or a default on the CPU.

A cache that cannot fit is a CapacityError that says how much memory it needs, how much is
free, who holds the rest, and what to change, never an allocator traceback.
"""

from __future__ import annotations

import os

import torch

from graphkiln.checks import torch_device
from graphkiln.errors import CapacityError, ConfigError
from graphkiln.models.config import ModelConfig

from .config import DEFAULT_CPU_KV_TOKENS, EngineConfig
from .kv_cache import KVCache

GIB = 2**30


def resolve_device(device: str | torch.device) -> torch.device:
    dev = torch_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but this machine has no CUDA device; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return dev


def _host_available_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _cuda_budget(device: torch.device, fraction: float) -> tuple[int, int, str]:
    """(bytes free now, bytes the cache may take, who holds the device's memory) on a CUDA device. What
    this process's allocator keeps cached but unused counts as free: the cache reuses it."""
    device_free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    free = device_free + reserved - torch.cuda.memory_allocated(device)
    holders = (f"{_gib(free)} of {_gib(total)} free; this process holds {_gib(reserved)}, "
               f"others {_gib(total - device_free - reserved)}")  # fmt: skip
    return free, int(free - (1 - fraction) * total), holders


def kv_cache_blocks(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, config: EngineConfig) -> int:
    """Number of KV blocks (the dummy block included) to allocate; a CapacityError if they cannot fit."""
    per_token = KVCache.bytes_per_token(cfg, dtype)
    block = config.block_size
    tokens = config.kv_cache_tokens
    if device.type == "cuda":
        free, usable, holders = _cuda_budget(device, config.gpu_memory_fraction)
        if tokens is None:
            tokens = max(usable, 0) // per_token
            if tokens < block:
                raise CapacityError(
                    f"no room for a KV cache on {device}: {holders}, and gpu_memory_fraction="
                    f"{config.gpu_memory_fraction} leaves {_gib(max(usable, 0))} for it; close other engines "
                    "(llm.close()) or processes, raise gpu_memory_fraction, or set kv_cache_tokens (one block of "
                    f"block_size={block} tokens takes {_gib(block * per_token)})"
                )
        elif (tokens // block + 1) * block * per_token > free:
            raise CapacityError(
                f"kv_cache_tokens={tokens} needs {_gib((tokens // block + 1) * block * per_token)} of KV cache "
                f"({per_token} bytes a token) on {device}: {holders}; lower kv_cache_tokens"
            )
    else:
        tokens = tokens or DEFAULT_CPU_KV_TOKENS
        if tokens < block:  # (an explicit kv_cache_tokens below one block is EngineConfig's error)
            raise ConfigError(f"block_size={block} exceeds the {tokens} tokens of the CPU's default KV cache; lower "
                              "block_size (16 is usual), or set kv_cache_tokens")  # fmt: skip
        need = (tokens // block + 1) * block * per_token
        available = _host_available_bytes()
        if available is not None and need > available:
            raise CapacityError(
                f"kv_cache_tokens={tokens} needs {_gib(need)} of KV cache ({per_token} bytes a token) but "
                f"{_gib(available)} of host memory is available; lower kv_cache_tokens"
            )
    return tokens // block + 1


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """The KV cache, or a CapacityError naming its size when the allocator refuses it."""
    try:
        return KVCache(cfg, num_blocks, block_size, dtype, device)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        need = num_blocks * block_size * KVCache.bytes_per_token(cfg, dtype)
        raise CapacityError(
            f"could not allocate a KV cache of {num_blocks} blocks ({_gib(need)}) on {device} ({e}); "
            "lower kv_cache_tokens or gpu_memory_fraction"
        ) from e
