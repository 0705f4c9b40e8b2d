"""Rotary position embeddings: a cos/sin table computed once, and `graphkiln::rope(x, table, positions)`,
which gathers each token's row by its position and rotates its heads.

The op is one Triton launch on CUDA (kernels/rope.py) and these torch ops elsewhere; either computes in
float32 and rounds once to x's dtype, as Inductor's fused kernel for the same ops does. It takes the table
and the positions, graph inputs both, so no piece of the split graph carries gathered rows across a cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .ops import define

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


def rope_reference(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the rows of table [P, 2D] (cos then sin) at positions [T], in float32."""
    cos, sin = table[positions].float().unsqueeze(1).chunk(2, dim=-1)
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def _takes_kernel(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 3 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0 and table.dim() == 2
            and table.shape[-1] == 2 * x.shape[-1] and table.stride(-1) == 1 and positions.dim() == 1)


def _rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if _takes_kernel(x, table, positions):  # triton is optional: the kernel is imported only where it runs
        from graphkiln.kernels.rope import rope as rope_kernel

        return rope_kernel(x, table, positions)
    return rope_reference(x, table, positions).contiguous()


def _rope_shape(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


# x [T, H, D] (the query and key heads side by side: one launch for both) rotated by the rows of the cos/sin
# table [P, 2D] at their positions [T]
rope = define("rope(Tensor x, Tensor table, Tensor positions) -> Tensor", _rope, _rope_shape)
