"""int4 products that take their input from the kernel before them: the SiLU-and-mul, and the RMSNorm's words.

At one row the int4 product (kernels/int4_dp4a.py) first writes x as 16-bit fixed-point words, one launch of its
own between x's producer and the product. These ops move that work into the producer, so a decode step at batch 1
loses a launch, and its wait in the chain of launches, per fused pair.

`graphkiln::int4_silu_mul_linear(gate_up, qweight, scales, zeros, group_size, tinygemm_weight, tinygemm_params)`:
int4_linear of silu(gate) * up for gate_up = [gate | up], the MLP's down projection (passes/silu_mul_linear.py). At
one row on CUDA the words kernel applies the activation as it loads gate_up; elsewhere the SiLU-and-mul kernel (or
the reference) runs first, as the unfused graph did.
`graphkiln::add_rms_norm_int4(x, residual, weight, eps, group_size) -> (sum, out, words, xscales, xsums)`:
add_rms_norm's outputs and, at one row on CUDA where the dp4a GEMV takes such an x (kernels/int4_linear
.one_row_words), out's words in groups of `group_size`, written by the norm's own program; elsewhere they are left
unwritten. `graphkiln::int4_linear_words(x, words, xscales, xsums, qweight, ...)`: int4_linear(x, qweight, ...),
taking those words under the same rule. passes/int4_norm_words.py puts both in the graph. Each op computes what
the ops it replaces compute, bit for bit.
"""

from __future__ import annotations

import torch

from .linear import silu_mul_reference
from .norm import _add_rms_norm, _takes_kernel
from .ops import define
from .quantized_linear import _int4_linear


def _int4_silu_mul_linear(gate_up: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, tinygemm_weight: torch.Tensor | None = None,
                          tinygemm_params: torch.Tensor | None = None) -> torch.Tensor:
    if gate_up.is_cuda:  # triton is optional: the kernel is imported only where it runs
        from graphkiln.kernels.int4_linear import int4_linear as kernel

        return kernel(gate_up, qweight, scales, zeros, group_size, tinygemm_weight, tinygemm_params, gated=True)
    return _int4_linear(silu_mul_reference(gate_up), qweight, scales, zeros, group_size)


def _int4_silu_mul_linear_shape(gate_up, qweight, scales, zeros, group_size, tinygemm_weight=None,
                                tinygemm_params=None):
    return gate_up.new_empty(gate_up.shape[0], qweight.shape[0])


int4_silu_mul_linear = define(
    "int4_silu_mul_linear(Tensor gate_up, Tensor qweight, Tensor scales, Tensor zeros, int group_size, "
    "Tensor? tinygemm_weight=None, Tensor? tinygemm_params=None) -> Tensor",
    _int4_silu_mul_linear, _int4_silu_mul_linear_shape,
)


def empty_words(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty words [4, K/8] int32, scales and sums [K/G] float32 for x [M, K] (fake or real)."""
    k = x.shape[1]
    return (x.new_empty(4, k // 8, dtype=torch.int32), x.new_empty(k // group_size, dtype=torch.float32),
            x.new_empty(k // group_size, dtype=torch.float32))


def _takes_words(x: torch.Tensor, group_size: int) -> bool:
    """Whether x's words are written (by the norm) and read (by the products): one_row_words on CUDA."""
    if not x.is_cuda:
        return False
    from graphkiln.kernels.int4_linear import one_row_words

    return one_row_words(x, group_size)


def _add_rms_norm_int4(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       group_size: int) -> tuple[torch.Tensor, ...]:
    if _takes_words(x, group_size):
        if _takes_kernel(x, residual, weight):
            from graphkiln.kernels.rms_norm import add_rms_norm

            return add_rms_norm(x, residual, weight, eps, words_group=group_size)
        from graphkiln.kernels.int4_dp4a import x_words

        total, out = _add_rms_norm(x, residual, weight, eps)
        return total, out, *x_words(out, group_size)
    return (*_add_rms_norm(x, residual, weight, eps), *empty_words(x, group_size))


def _add_rms_norm_int4_shape(x, residual, weight, eps, group_size) -> tuple[torch.Tensor, ...]:
    return x.new_empty(x.shape), x.new_empty(x.shape), *empty_words(x, group_size)


add_rms_norm_int4 = define(
    "add_rms_norm_int4(Tensor x, Tensor residual, Tensor weight, float eps, int group_size) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _add_rms_norm_int4, _add_rms_norm_int4_shape,
)


def _int4_linear_words(x: torch.Tensor, words: torch.Tensor, xscales: torch.Tensor, xsums: torch.Tensor,
                       qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                       tinygemm_weight: torch.Tensor | None = None,
                       tinygemm_params: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda:
        from graphkiln.kernels.int4_linear import int4_linear as kernel

        given = (words, xscales, xsums) if _takes_words(x, group_size) else None
        return kernel(x, qweight, scales, zeros, group_size, tinygemm_weight, tinygemm_params, words=given)
    return _int4_linear(x, qweight, scales, zeros, group_size)


def _int4_linear_words_shape(x, words, xscales, xsums, qweight, scales, zeros, group_size, tinygemm_weight=None,
                             tinygemm_params=None):
    return x.new_empty(x.shape[0], qweight.shape[0])


int4_linear_words = define(
    "int4_linear_words(Tensor x, Tensor words, Tensor xscales, Tensor xsums, Tensor qweight, Tensor scales, "
    "Tensor zeros, int group_size, Tensor? tinygemm_weight=None, Tensor? tinygemm_params=None) -> Tensor",
    _int4_linear_words, _int4_linear_words_shape,
)
