"""One artifact can never change what another loads: two CPU artifacts whose compiled kernels share file
names (the hash of the kernel's source) but not contents each run their own, whichever loads first into
the same Inductor cache, each in a fresh process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import graphkiln
from artifact_helpers import ENGINE, GREEDY, PROMPTS, RESULT_PREFIX, greedy_tokens, plant_marker_kernel, run_python_json

pytestmark = pytest.mark.slow


def _load_in_fresh_process(out: Path, cache: Path, generate: bool) -> dict:
    code = f"""
import os
os.environ["TORCHINDUCTOR_CACHE_DIR"] = {str(cache)!r}
import json, torch
torch.set_num_threads(1)
import graphkiln
llm = graphkiln.load({str(out)!r}, **{ENGINE!r})
llm.wait_compiled()  # the pieces (and the kernels under test) load in the background
tokens = [o.token_ids for o in llm.generate({PROMPTS!r}, graphkiln.{GREEDY!r})] if {generate!r} else None
print({RESULT_PREFIX!r} + json.dumps({{"tokens": tokens}}))
"""
    return run_python_json(code)


def test_each_artifact_runs_its_own_kernels(artifact: Path, tmp_path: Path, eager_tokens: list[list[int]]) -> None:
    """Both orders in one sequence: the tampered artifact into an empty cache, the clean one after it, and the
    tampered one again after the clean one."""
    marker = tmp_path / "marker-kernel-ran"
    tampered = Path(shutil.copytree(artifact, tmp_path / "tampered"))
    planted = plant_marker_kernel(tampered, marker)
    assert (artifact / planted.relative_to(tampered)).is_file()  # the clean artifact has a kernel of that name
    cache = tmp_path / "shared-inductor-cache"
    for which in ("tampered", "clean", "tampered"):
        marker.unlink(missing_ok=True)
        if which == "tampered":
            _load_in_fresh_process(tampered, cache, generate=False)  # its kernel computes nothing: load only
            assert marker.is_file() and "loaded" in marker.read_text(), "the tampered artifact ran another's kernel"
        else:
            result = _load_in_fresh_process(artifact, cache, generate=True)
            assert not marker.exists(), "the clean artifact ran the kernel the tampered one put in the cache"
            assert result["tokens"] == eager_tokens


def test_in_one_process_too(artifact: Path, tmp_path: Path, eager_tokens: list[list[int]]) -> None:
    """A server loading several artifacts: the tampered one's kernel, loaded first, never runs for the clean one."""
    marker = tmp_path / "marker-kernel-ran"
    tampered = Path(shutil.copytree(artifact, tmp_path / "tampered"))
    plant_marker_kernel(tampered, marker)
    tampered_llm = graphkiln.load(tampered, **ENGINE)
    tampered_llm.wait_ready()  # its warm-ups run its own kernel
    own = marker.read_text()
    assert own.startswith("loaded\n")
    clean = graphkiln.load(artifact, **ENGINE)
    assert clean.wait_compiled()  # raises what kept its pieces out: an engine serving eagerly would pass below
    clean.wait_ready()
    assert greedy_tokens(clean) == eager_tokens
    assert marker.read_text() == own  # neither loaded again nor called for the clean one
