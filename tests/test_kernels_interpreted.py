"""The attention and quantized-product kernels' arithmetic on the CPU, where Triton is installed: each kernel run
by Triton's interpreter in a fresh process (tests/interpreted_kernels.py) against float32 references.

Speed, concurrency and the compiled code are the GPU tests' (tests/gpu/); this checks a kernel change before a
GPU sees it: masks, the step's new row, the split merge and the cache write in decode; causal masks over cached
prefixes and a work table shared by fewer programs in prefill; the fp8 and int4 weight products on every
path their row count picks, x rounded as the kernels round it, and the int4 words their producers make; the
residual add and RMSNorm kernel; the rope kernel; and the Triton backend in a whole engine
(tests/interpreted_engine.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from interpreted_kernels import CASES, NORM_CASES, PREFILL_CASES, PRODUCT_CASES, ROPE_CASES, WORDS_CASES  # noqa: E402

HERE = Path(__file__).parent
ERROR = 1e-3
BF16_ERROR = 5e-3  # a bfloat16 query's dots round the probabilities to 8 bits


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "interpreted_kernels.py")], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", CASES)
def test_interpreted_decode_matches_float32_attention(results: dict, name: str) -> None:
    dtype = CASES[name][1]
    case = results[name]
    assert case["error"] < (BF16_ERROR if dtype == torch.bfloat16 else ERROR)
    assert case["new_key_equal"] == 1.0  # stored as the key itself, or in fp8 as torch rounds it
    assert case["new_key_scale_error"] < 1e-6
    assert case["counters_zero"]


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_interpreted_prefill_matches_float32_causal_attention(results: dict, name: str) -> None:
    assert results[name]["error"] < ERROR


@pytest.mark.parametrize("name", PRODUCT_CASES)
def test_interpreted_quantized_product_matches_float32(results: dict, name: str) -> None:
    assert results[name]["error"] < ERROR  # float16 output rounding
    assert results[name]["counters_zero"]  # the split counters left as the next product needs them
    if name.startswith("half-tma-activated"):  # the activation in the epilogue as its own kernel computes it:
        # the interpreter's dots are NumPy matmuls, whose float32 sums follow the tile's shape and the CPU's BLAS
        # kernels, so a gate or up product may round a unit apart between the two tilings (one of 300 did here)
        assert results[name]["ulps_from_two_launches"] <= 1


@pytest.mark.parametrize("name", NORM_CASES)
def test_interpreted_add_rms_norm_matches_the_models_ops(results: dict, name: str) -> None:
    """The sum as the model's add rounds it; the norm within float32's rsqrt and sum order of it, nearly every
    output the same number."""
    case = results[name]
    assert case["sum_equal"]
    assert case["error"] < 2e-3  # under one rounding of the half-precision output
    assert case["equal"] > 0.95
    assert case["quantized_as_quantize_rows"]  # what the fp8 products after the norm would have made of it


@pytest.mark.parametrize("name", WORDS_CASES)
def test_interpreted_int4_words_made_before_the_product_are_its_own(results: dict, name: str) -> None:
    """The words kernel applying the SiLU-and-mul, and the RMSNorm writing its output's words, make what the
    product would have made itself, and the product taking them computes the same outputs."""
    assert results[name] == dict.fromkeys(("gated_words", "gated_product", "norm_unchanged", "norm_words",
                                           "norm_outputs_apart", "norm_product"), True)


@pytest.mark.parametrize("name", ROPE_CASES)
def test_interpreted_rope_matches_the_reference(results: dict, name: str) -> None:
    """Both compute in float32 and round once: nearly every output the same number, the rest one rounding off."""
    case = results[name]
    assert case["contiguous"]
    assert case["error"] < 1e-3
    assert case["equal"] > 0.95


def test_interpreted_triton_engine_alone_and_with_a_long_prefill_backend_matches_transformers() -> None:
    """A CPU engine on the Triton backend, interpreted: a 100-token prompt in chunks of 32 scored and continued
    greedily, against transformers on the float16 checkpoint; then with chunks 2 and 3 (2048 pairs or more) handed
    to the FlashInfer stand-in (LongPrefillBackend), the other steps still Triton's."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "interpreted_engine.py")], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    for name in ("triton", "triton+stand-in"):
        assert results[name]["error"] < 5e-3 and results[name]["greedy_equal"], results
    assert results["triton"]["steps_without_graph"] == {"prefill": 8, "decode": 3}
    assert results["triton+stand-in"]["steps_without_graph"] == {"prefill": 4, "long_prefill": 4, "decode": 3}
