"""`graphkiln::add_rms_norm(x, residual, weight, eps) -> (sum, out)`: a decoder layer's residual add and the RMSNorm
after it, as one op (passes/add_rms_norm.py puts it in the graph, where enabled).

sum = x + residual; out = weight * RMSNorm(sum), computed as transformer.RMSNorm computes it. On CUDA, for
half-precision rows of at most kernels/rms_norm.MAX_WIDTH inputs, one Triton launch; elsewhere these torch ops.
"""

from __future__ import annotations

import torch

from .linear import on_triton
from .ops import define


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own ops: the add in x's dtype, the norm in float32, cast back before the weight scales it."""
    total = x + residual
    x32 = total.float()
    return total, weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(total.dtype)


def _takes_kernel(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    if not (on_triton(x, weight) and x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.stride(-1) == 1 and weight.dim() == 1):
        return False
    from graphkiln.kernels.rms_norm import MAX_WIDTH

    return x.shape[1] <= MAX_WIDTH


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _takes_kernel(x, residual, weight):  # triton is optional: the kernel is imported only where it runs
        from graphkiln.kernels.rms_norm import add_rms_norm

        return add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def _add_rms_norm_shape(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


add_rms_norm = define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
                      _add_rms_norm, _add_rms_norm_shape)
