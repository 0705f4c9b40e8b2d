"""The builds ahead (kernels/launch.py) start one build per specialization: launches that differ only as every
layer's do (pointers, floats) or only in a descriptor's shape (x of 2 or 8 rows in one 16-row block) share one; a
dtype, an alignment, an integer's class or a descriptor's block shape makes another. The builds themselves run on
the GPU (tests/gpu/test_startup_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphkiln.kernels.launch import _specialized


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
