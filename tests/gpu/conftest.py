"""GPU tests: collected everywhere, skipped where CUDA is not available (CI); run on a CUDA machine."""

import threading
from pathlib import Path

import pytest
import torch

from tiny_engines import compile_tiny, engines

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def strict_float32_products():
    """Float32 comparisons against references must not run on TF32 tensor cores."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


@pytest.fixture(autouse=True)
def no_capture_into_the_next_test():
    """Wait for the background preparation of every engine a test left alive: a capture in progress holds
    the default CUDA generator, and the next test's random draws on the device would fail beside it."""
    yield
    for thread in threading.enumerate():
        if thread.name == "graphkiln-prepare":
            thread.join(timeout=300)


@pytest.fixture(scope="session")
def tiny_fp32_parts():
    """(model, compiled model, tokenizer) of the tiny model in float32, compiled once for the session."""
    return compile_tiny("float32")


@pytest.fixture(scope="session")
def tiny_fp32(tiny_fp32_parts):
    """(eager, compiled without graphs, compiled with CUDA graphs) engines of it."""
    return engines(tiny_fp32_parts)
