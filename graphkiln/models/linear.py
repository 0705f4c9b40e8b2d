"""`graphkiln::linear(x, weight)`: y = x @ weight^T, with a Triton kernel for one-row inputs on CUDA;
`graphkiln::silu_mul_linear(gate_up, weight)`: y = (silu(gate) * up) @ weight^T, the MLP's down
projection with its activation, so that at one row the activation rides in the GEMV.
`graphkiln::linear_silu_mul(x, weight)`: silu(gate) * up of [gate | up] = x @ weight^T, the MLP's gate and
up projections with their activation, which at one row the GEMV applies to its own outputs.

At one row (decode at batch 1) the product is a pass over the weight, and cuBLAS reads the
narrow projections of a decoder (q/k/v, o, down: 2048 to 6144 outputs) at a half to two thirds of
the memory bandwidth: its few output tiles leave multiprocessors idle, and a split-K variant adds
a second launch. Here each program owns a slab of a few weight rows and walks all of K, so every
multiprocessor streams. From 2 to 64 rows on sm90+, products whose weight has at least 2048 rows go to the TMA-fed
kernel (kernels/tma_products.py's `tma_product`), which read the bench models' projections faster than cuBLAS there.
Every other input (more rows, older GPUs, CPU, float32) goes to torch.mm. The ops are opaque to Inductor; the
passes `passes/linear_op.py`, `passes/silu_mul_epilogue.py` and `passes/silu_mul_linear.py` route the
decoder's products to them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from graphkiln.compat import pin_triton_environment, warm_triton

from .ops import define

GEMV_DTYPES = (torch.bfloat16, torch.float16)


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[0] == 1 and on_triton(x, weight)


def on_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CUDA, half precision, unit stride along K: what the Triton kernels take."""
    return x.is_cuda and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype and x.stride(-1) == weight.stride(-1) == 1


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T for more than one row: the TMA-fed kernel where it fits, else cuBLAS."""
    if x.is_cuda:  # triton is optional: the kernel is imported only where it may run
        from graphkiln.kernels.tma_products import product_fits, tma_product

        if product_fits(x, weight):
            return tma_product(x, weight)
    return torch.mm(x, weight.t())


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N]."""
    if uses_gemv(x, weight):  # triton is optional: the kernel is imported only where it runs
        from graphkiln.kernels.gemv import gemv

        return gemv(x, weight)
    return product(x, weight)


def _linear_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


linear = define("linear(Tensor x, Tensor weight) -> Tensor", _linear, _linear_shape)


def _silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] = [gate | up], weight [N, I] -> (silu(gate) * up) @ weight^T [M, N]."""
    if on_triton(gate_up, weight):  # triton is optional: the kernels are imported only where they run
        from graphkiln.kernels.gemv import gemv, silu_mul

        if gate_up.shape[0] == 1:
            return gemv(gate_up, weight, gated=True)
        return product(silu_mul(gate_up), weight)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.mm(F.silu(gate) * up, weight.t())


silu_mul_linear = define("silu_mul_linear(Tensor gate_up, Tensor weight) -> Tensor", _silu_mul_linear,
                         _linear_shape)


def silu_mul_reference(y: torch.Tensor) -> torch.Tensor:
    """silu(y[:, :I]) * y[:, I:] computed in float32 and rounded once, as the kernels and Inductor's fusion do."""
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)


def _linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [2I, K]^T = [gate | up] -> silu(gate) * up [M, I]."""
    if on_triton(x, weight):  # triton is optional: the kernels are imported only where they run
        from graphkiln.kernels.gemv import gemv, silu_mul

        if x.shape[0] == 1:
            return gemv(x, weight, activated=True)
        return silu_mul(product(x, weight))
    return silu_mul_reference(torch.mm(x, weight.t()))


def _activated_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


linear_silu_mul = define("linear_silu_mul(Tensor x, Tensor weight) -> Tensor", _linear_silu_mul, _activated_shape)


def import_kernels(device: torch.device, shipped: Path | None = None) -> None:
    """Import the Triton kernels these ops call on `device` now (CUDA; they are imported where they first run
    otherwise, triton being optional), with Triton's hash of its own sources, which a process pays once at its
    first launch: a load does both while the weights are read, so a step does not. `shipped`: an artifact's
    Triton kernels, put into Triton's cache where it lacks them, before any launch (kernels/shipped.py)."""
    if device.type == "cuda":
        import graphkiln.kernels.tma_products  # noqa: F401
        import graphkiln.kernels.gemv  # noqa: F401
        import graphkiln.kernels.rms_norm  # noqa: F401
        from graphkiln.kernels.shipped import install_shipped_kernels

        pin_triton_environment()
        if shipped is not None:
            install_shipped_kernels(shipped)
        warm_triton()
