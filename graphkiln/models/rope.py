"""Rotary position embeddings: a cos/sin table computed once, gathered by position at run time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import ModelConfig


def default_inv_freq(theta: float, head_dim: int) -> tuple[float, ...]:
    """The unscaled RoPE frequencies 1 / theta^(2i / head_dim), in float32 as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float()
    return tuple((1.0 / (theta ** (exponents / head_dim))).tolist())


def rope_frequencies(hf_config, rope_type: str, head_dim: int) -> tuple[tuple[float, ...], float]:
    """Inverse frequencies and attention scaling of a transformers config, computed on the CPU in float32
    by transformers' own functions for the scaled types (linear, llama3, yarn)."""
    if rope_type == "default":
        return default_inv_freq(hf_config.rope_parameters["rope_theta"], head_dim), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return tuple(inv_freq.float().tolist()), float(scaling)


def rope_cache(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """Return float32 [max_context, 2 * head_dim]: cos then sin, as transformers computes them."""
    inv_freq = torch.tensor(cfg.rope_inv_freq, dtype=torch.float32, device=device)
    positions = torch.arange(cfg.max_context, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return torch.cat((angles.cos() * cfg.rope_scaling, angles.sin() * cfg.rope_scaling), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (the query and key heads side by side: one kernel for both) by the rows of
    cos_sin [T, 2D] gathered for their positions."""
    cos, sin = cos_sin.to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    return x * cos + rotate_half(x) * sin
