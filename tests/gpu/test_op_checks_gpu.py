"""tests/test_op_checks.py's `opcheck` of every graphkiln op on CUDA, in bfloat16: the Triton kernels' paths at one
row and at three, whose outputs (the int4 norm's words, at one row) the CPU's reference bodies never make."""

import pytest
import torch

from op_samples import check_op, op_samples

NAMES = list(op_samples("cpu", torch.float32))  # the same calls, built on CUDA by the fixture below


@pytest.fixture(scope="module")
def samples() -> dict:
    return op_samples("cuda", torch.bfloat16)


@pytest.mark.parametrize("name", NAMES)
def test_op_passes_opcheck_on_cuda(samples: dict, name: str) -> None:
    check_op(name, *samples[name], "cuda")
