"""The builds ahead (kernels/launch.py) start one build per specialization: launches that differ only as every
layer's do (pointers, floats), only in a descriptor's shape (x of 2 or 8 rows in one 16-row block) or only in an
integer the kernel does not specialize on share one; a dtype, an alignment, an integer's class or a descriptor's
block shape makes another. The builds themselves run on the GPU (tests/gpu/test_startup_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from graphkiln.kernels.launch import _specialized, build_key


@dataclass
class Descriptor:
    base: torch.Tensor
    shape: list[int]
    block_shape: list[int]


def test_every_layers_launch_specializes_alike() -> None:
    caches = torch.zeros(4, 64, dtype=torch.bfloat16)
    layer0, layer1 = caches[0], caches[1]  # 128 bytes apart: both aligned
    assert layer0.data_ptr() != layer1.data_ptr()
    assert _specialized(layer0) == _specialized(layer1)
    assert _specialized(0.125) == _specialized(0.5)
    assert _specialized(32) == _specialized(4096)
    assert _specialized(Descriptor(layer0, [64], [16])) == _specialized(Descriptor(layer1, [64], [16]))
    assert _specialized(Descriptor(layer0, [2, 64], [16, 64])) == _specialized(Descriptor(layer0, [8, 64], [16, 64]))


def test_what_triton_compiles_in_tells_builds_apart() -> None:
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert _specialized(x) != _specialized(x.float())
    assert _specialized(x) != _specialized(x[1:])  # 2 bytes off the 16-byte alignment
    assert len({_specialized(n) for n in (1, 2, 16, 2**31)}) == 4
    assert _specialized(Descriptor(x, [64], [16])) != _specialized(Descriptor(x, [64], [32]))
    assert _specialized(Descriptor(x, [64], [16])) != _specialized(Descriptor(x.float(), [64], [16]))
    assert _specialized(True) != _specialized(False)


def test_an_integer_the_kernel_does_not_specialize_on_counts_by_width_alone() -> None:
    """The TMA kernel's row count M is not specialized: x of 2 and of 16 rows (one 16-row block) share a build,
    though 16 is a multiple of 16 and 2 is not; its N is, so there they differ."""
    pytest.importorskip("triton")
    from graphkiln.kernels.tma_products import _tma_kernel

    m = [p.name for p in _tma_kernel.params].index("M")
    two, sixteen = [0] * len(_tma_kernel.params), [0] * len(_tma_kernel.params)
    two[m], sixteen[m] = 2, 16
    assert build_key(_tma_kernel, tuple(two)) == build_key(_tma_kernel, tuple(sixteen))
    n = m + 1
    two[n], sixteen[n] = 2, 16
    assert build_key(_tma_kernel, tuple(two)) != build_key(_tma_kernel, tuple(sixteen))
    sixteen[n], sixteen[m] = 2, 2**31
    assert build_key(_tma_kernel, tuple(two)) != build_key(_tma_kernel, tuple(sixteen))  # i64, not i32
