"""Choosing an attention backend: 'auto' is Triton on CUDA and the SDPA reference on the CPU."""

from __future__ import annotations

from graphkiln.errors import ConfigError
from graphkiln.runtime.kv_cache import KVCache

from .base import AttentionBackend

BACKENDS = ("auto", "sdpa", "triton")


def select_backend(name: str, kv_cache: KVCache) -> AttentionBackend:
    if name not in BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; use one of {BACKENDS}")
    cuda = kv_cache.keys.device.type == "cuda"
    if name == "auto":
        name = "triton" if cuda else "sdpa"
    if name == "triton":
        if not cuda:
            raise ConfigError("attention backend 'triton' needs a CUDA device; use 'sdpa' on the CPU")
        from .triton_backend import TritonBackend

        return TritonBackend(kv_cache)
    from .sdpa import SdpaBackend

    return SdpaBackend(kv_cache)
