"""Rotary position embeddings: a cos/sin table computed once, gathered by position at run time."""

from __future__ import annotations

import torch

from .config import ModelConfig


def rope_cache(hf_config, cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """Return float32 [max_context, 2 * head_dim]: cos then sin, as transformers computes them."""
    if cfg.rope_type == "default":
        base = hf_config.rope_parameters["rope_theta"]
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (base ** (exponents / cfg.head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf_config, device)
    positions = torch.arange(cfg.max_context, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    angles = torch.cat((freqs, freqs), dim=-1)
    return torch.cat((angles.cos() * scaling, angles.sin() * scaling), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by the rows of cos_sin [T, 2D] gathered for their positions."""
    cos, sin = cos_sin.to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
