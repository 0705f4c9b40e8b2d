"""One bad request must not break the engine: parameters checked before a step, failures inside a step
confined to the requests involved, an interrupted generate cleaned up."""

from __future__ import annotations

import numpy as np
import pytest

from graphkiln import LLM, SamplingParams
from graphkiln.errors import RequestError

PROMPT = "the kiln compiles a graph"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.eager("tiny", kv_cache_tokens=1024)


def assert_idle(llm: LLM) -> None:
    """No request left in the engine, every KV block free."""
    engine = llm.engine
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    assert not engine.has_work()
    assert engine.allocator.num_free == engine.allocator.capacity


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**63),
        ("seed", -1),
        ("seed", "1"),
        ("seed", 1.0),
        ("temperature", "0.7"),
        ("temperature", True),
        ("temperature", float("inf")),
        ("top_p", "0.9"),
        ("top_p", False),
        ("max_tokens", "8"),
        ("max_tokens", True),
        ("top_k", 2.0),
        ("top_k", 2**63),
        ("stop_token_ids", 5),
        ("stop_token_ids", "12"),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("logprobs", "yes"),
    ],
)
def test_sampling_params_reject_wrong_types_and_ranges(field: str, value) -> None:
    with pytest.raises(RequestError, match=rf"SamplingParams\.{field}=") as caught:
        SamplingParams(**{field: value})
    assert repr(value) in str(caught.value) or repr(tuple(value)) in str(caught.value)
    assert "give" in str(caught.value)  # and what to do


def test_sampling_params_normalize_numbers() -> None:
    params = SamplingParams(max_tokens=np.int64(4), temperature=1, top_k=np.int32(3), seed=np.uint8(7),
                            stop_token_ids=[np.int64(5)])  # fmt: skip
    assert params == SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=7, stop_token_ids=(5,))
    assert type(params.max_tokens) is int and type(params.seed) is int and type(params.temperature) is float
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_seed_out_of_int64_range_is_refused_and_the_llm_serves_on(llm: LLM) -> None:
    """It used to be accepted, then fail in the step's host-to-device copy, stay running with its KV
    blocks, and make every later generate on this LLM fail the same way."""
    want = llm.generate(PROMPT, GREEDY)[0].token_ids
    with pytest.raises(RequestError, match=r"SamplingParams\.seed=9223372036854775808"):
        llm.generate(PROMPT, SamplingParams(seed=2**63, temperature=1.0))
    assert_idle(llm)
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == want


@pytest.mark.parametrize(
    "params", [{"max_tokens": 4}, [GREEDY, {"max_tokens": 4}], "greedy", 4], ids=["dict", "dict-in-list", "str", "int"]
)
def test_params_that_are_not_sampling_params(llm: LLM, params) -> None:
    with pytest.raises(RequestError, match=r"give a SamplingParams"):
        llm.generate([PROMPT, PROMPT], params)
    with pytest.raises(RequestError, match=r"give a graphkiln\.SamplingParams"):
        next(llm.generate_stream(PROMPT, {"max_tokens": 4}))
    with pytest.raises(RequestError, match=r"give a graphkiln\.SamplingParams"):
        llm.engine.add_request([1, 2, 3], {"max_tokens": 4})
    assert_idle(llm)


@pytest.mark.parametrize("stop", [[2, 4096], [-1]], ids=["past-the-end", "negative"])
def test_stop_token_ids_outside_the_vocabulary(llm: LLM, stop: list[int]) -> None:
    with pytest.raises(RequestError, match=r"stop_token_ids: token ids \[-?\d+\] are outside the vocabulary \[0, 4096\)"):
        llm.generate([PROMPT, PROMPT], [GREEDY, SamplingParams(stop_token_ids=stop)])
    assert_idle(llm)


@pytest.mark.parametrize("prompt", [[1, 2.5], [1, "2"], [1, None]], ids=["float", "str", "none"])
def test_prompt_ids_that_are_not_ints(llm: LLM, prompt: list) -> None:
    with pytest.raises(RequestError, match="give a string or a list of token ids"):
        llm.generate([prompt], GREEDY)
    assert_idle(llm)
