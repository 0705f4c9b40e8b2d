"""GPU tests: skipped as a whole where CUDA is not available (CI); run on the GPU machine."""

import os

import pytest
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def graphkiln_gpu_cache(tmp_path_factory: pytest.TempPathFactory):
    os.environ.setdefault("GRAPHKILN_CACHE", str(tmp_path_factory.mktemp("graphkiln-cache")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
