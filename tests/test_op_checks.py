"""Every graphkiln op through `torch.library.opcheck` on the CPU: its schema (mutations declared, no output aliasing
an input or another output), its fake kernel's shapes, dtypes and strides against the real outputs, and tracing
through AOTAutograd with dynamic shapes. tests/gpu/test_op_checks_gpu.py runs the same calls on CUDA's kernels."""

import pytest
import torch

from op_samples import check_op, op_samples

SAMPLES = op_samples("cpu", torch.float32)


@pytest.mark.parametrize("name", SAMPLES)
def test_op_passes_opcheck(name: str) -> None:
    check_op(name, *SAMPLES[name], "cpu")
