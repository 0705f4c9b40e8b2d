"""Choosing an attention backend.

'auto' is FlashInfer on CUDA when the package imports and serves the cache's dtype and head
size, Triton on CUDA otherwise, and the SDPA reference on the CPU.
"""

from __future__ import annotations

from graphkiln.errors import ConfigError
from graphkiln.runtime.kv_cache import KVCache

from .base import AttentionBackend

BACKENDS = ("auto", "sdpa", "triton", "flashinfer")


def _auto(kv_cache: KVCache) -> str:
    from .flashinfer_backend import flashinfer_importable, unsupported

    if kv_cache.keys.device.type != "cuda":
        return "sdpa"
    if unsupported(kv_cache.keys.dtype, kv_cache.keys.shape[-1]) is None and flashinfer_importable():
        return "flashinfer"
    return "triton"


def select_backend(name: str, kv_cache: KVCache) -> AttentionBackend:
    if name not in BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; use one of {BACKENDS}")
    if name == "auto":
        name = _auto(kv_cache)
    if name in ("triton", "flashinfer") and kv_cache.keys.device.type != "cuda":
        raise ConfigError(f"attention backend {name!r} needs a CUDA device; use 'sdpa' on the CPU")
    if name == "flashinfer":
        from .flashinfer_backend import FlashInferBackend

        return FlashInferBackend(kv_cache)
    if name == "triton":
        from .triton_backend import TritonBackend

        return TritonBackend(kv_cache)
    from .sdpa import SdpaBackend

    return SdpaBackend(kv_cache)
