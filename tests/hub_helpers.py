"""The Hugging Face hub id the tests give the tiny model, and the environment that points at their hub cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

HUB_REPO = "graphkiln-test/tiny"


@contextlib.contextmanager
def use_hub_env(env: dict[str, str]) -> Iterator[pytest.MonkeyPatch]:
    """`env` in this process; huggingface_hub read HF_HUB_CACHE when imported, so its constant is set too."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
        yield patch

