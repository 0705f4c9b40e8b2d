"""The KV cache's element type (EngineConfig.kv_cache_dtype) and fp8 rows in torch, for the SDPA path.

"auto" stores keys and values in the model's dtype. "fp8_e4m3" stores them as float8_e4m3fn, one
byte an element, each (token, KV head) row with its own float32 scale beside the cache:
row = fp8(x / scale), scale = max|x| / 448. A scale per row needs no calibration pass and follows
every token's range, so one outlier token or head costs only its own row's precision; the Triton
kernels read a tile's scales with its rows and apply them to the logits (keys) and probabilities
(values) in registers. FlashInfer takes one scale per tensor only, so it does not serve this
cache. The kernels do the same arithmetic as `quantize` here (kernels/kv_format.py).
"""

from __future__ import annotations

import torch

from graphkiln.errors import ConfigError

from .config import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_AMAX = 1e-12  # a row of zeros gets a tiny scale, not a division by zero
SCALE_DTYPE = torch.float32


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a KV cache of EngineConfig.kv_cache_dtype stores for a model of `model_dtype`."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8
    raise ConfigError(f"EngineConfig.kv_cache_dtype={kv_cache_dtype!r}; use one of {KV_CACHE_DTYPES}")


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype keeps a scale per (token, KV head) row."""
    return dtype == FP8


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] as (fp8 [..., D], float32 scales [...])."""
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(MIN_AMAX) / FP8_MAX
    return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows [..., D] times their scales [...], as `dtype`."""
    return (x.float() * scale[..., None]).to(dtype)
