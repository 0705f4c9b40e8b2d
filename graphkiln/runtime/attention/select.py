"""Choosing an attention backend.

'auto' takes the first backend that serves the cache's dtype and head size: on CUDA, Triton where
triton imports (any head_dim up to 256, the fp8 cache included), then FlashInfer where the package
imports (float16/bfloat16 caches, head_dim 64, 128 or 256), then the SDPA reference, which serves
everything; on the CPU, SDPA. So `auto` never refuses a model the engine can load. Triton comes
first by measurement (`python -m bench serving`, README "Attention at serving shapes"): it is faster
at decode, at batch 1 and at the serving shapes measured, and it loads faster. FlashInfer prefills
long prompts faster on Hopper (its fa3 kernels): "triton+flashinfer" (long_prefill.py) serves with
Triton and hands FlashInfer the long prefill steps. It is chosen by name: `auto` would import
FlashInfer on every Hopper load and build fa3 on a machine's first, for a gain only long prompts see.
"""

from __future__ import annotations

import importlib.util

from graphkiln.errors import ConfigError
from graphkiln.runtime.config import ATTENTION_BACKENDS
from graphkiln.runtime.kv_cache import KVCache

from .base import AttentionBackend
from .block_decode import check_decode_kernel
from .long_prefill import NAME as LONG_PREFILL


def auto_backend(device_type: str, dtype, head_dim: int, flashinfer: bool, triton: bool) -> str:
    """The backend 'auto' means for a cache of `dtype` and `head_dim` on `device_type`, given which of
    the optional packages import."""
    from . import flashinfer_backend, triton_backend

    if device_type != "cuda":
        return "sdpa"
    if triton and triton_backend.unsupported(dtype, head_dim) is None:
        return "triton"
    if flashinfer and flashinfer_backend.unsupported(dtype, head_dim) is None:
        return "flashinfer"
    return "sdpa"


def _auto(kv_cache: KVCache) -> str:
    """auto_backend for this cache. FlashInfer is imported (seconds of its own modules) only to learn whether it
    can stand in where Triton cannot serve the cache."""
    from . import triton_backend
    from .flashinfer_backend import flashinfer_importable

    keys = kv_cache.keys
    cuda = keys.device.type == "cuda"
    triton = cuda and importlib.util.find_spec("triton") is not None
    triton_serves = triton and triton_backend.unsupported(keys.dtype, keys.shape[-1]) is None
    flashinfer = cuda and not triton_serves and flashinfer_importable()
    return auto_backend(keys.device.type, keys.dtype, keys.shape[-1], flashinfer, triton)


def select_backend(name: str, kv_cache: KVCache, decode_kernel: str = "auto") -> AttentionBackend:
    """The backend `name` means for this cache; `decode_kernel` "blocks" needs Triton (block_decode.py)."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; use one of {ATTENTION_BACKENDS}")
    if name == "auto":
        name = _auto(kv_cache)
    check_decode_kernel(decode_kernel, name)
    if name != "sdpa" and kv_cache.keys.device.type != "cuda":
        raise ConfigError(f"attention backend {name!r} needs a CUDA device; use 'sdpa' on the CPU")
    if name == LONG_PREFILL:
        from .long_prefill import triton_with_flashinfer

        return triton_with_flashinfer(kv_cache, decode_kernel)
    if name == "flashinfer":
        from .flashinfer_backend import FlashInferBackend

        return FlashInferBackend(kv_cache)
    if name == "triton":
        from .triton_backend import TritonBackend

        return TritonBackend(kv_cache, decode_kernel)
    from .sdpa import SdpaBackend

    return SdpaBackend(kv_cache)
