"""GPU tests: skipped as a whole where CUDA is not available (CI); run on the GPU machine."""

import pytest
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def exact_float32_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
