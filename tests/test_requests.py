"""One bad request must not break the engine: parameters checked before a step, failures inside a step
confined to the requests involved, an interrupted generate cleaned up."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import graphkiln
from graphkiln import LLM, SamplingParams
from graphkiln.errors import RequestError, RequestFailedError
from graphkiln.runtime import runner
from graphkiln.runtime.readback import LaunchedStep
from graphkiln.runtime.sampler import SamplingTensors

PROMPT = "the kiln compiles a graph"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BAD_SEED = 666  # the request whose steps the fault below hits


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.eager("tiny", kv_cache_tokens=1024)


@pytest.fixture(scope="module", params=["eager", "compiled"])
def any_llm(request: pytest.FixtureRequest, artifact: Path) -> LLM:
    """The eager tiny model, and its compiled artifact (same weights, padded batches, compiled pieces)."""
    if request.param == "eager":
        return LLM.eager("tiny", kv_cache_tokens=1024)
    return graphkiln.load(artifact, kv_cache_tokens=1024, capture="blocking")


def fault_in_sampler(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, hit: Callable[[SamplingTensors], bool]
) -> None:
    """Make a step raise `error` on the device side (the sampler a step without a graph runs) when `hit`
    says so for its sampling rows."""
    sample = runner.sample

    def faulty(logits, rows, mode):
        if hit(rows):
            raise error
        return sample(logits, rows, mode)

    monkeypatch.setattr(runner, "sample", faulty)


def nth_call(n: int) -> Callable[..., bool]:
    calls = itertools.count(1)
    return lambda *_: next(calls) == n


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
        pytest.param("temperature", 10**400, id="temperature-past-float"),
        pytest.param("top_p", 10**400, id="top_p-past-float"),
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
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", 2.0),
    ],
)
def test_sampling_params_reject_wrong_types_and_ranges(field: str, value) -> None:
    with pytest.raises(RequestError, match=rf"SamplingParams\.{field}=") as caught:
        SamplingParams(**{field: value})
    assert repr(value) in str(caught.value) or repr(tuple(value)) in str(caught.value)
    assert "give" in str(caught.value)  # and what to do


def test_a_top_k_out_of_range_is_refused_with_the_range() -> None:
    with pytest.raises(RequestError, match=r"top_k=1180591620717411303424; give an int in \[0, 2\*\*63\); 0 disables"):
        SamplingParams(top_k=2**70)


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
    with pytest.raises(RequestError, match=r"stop_token_ids: token ids \[-?\d+\] are outside the vocabulary"):
        llm.generate([PROMPT, PROMPT], [GREEDY, SamplingParams(stop_token_ids=stop)])
    assert_idle(llm)


@pytest.mark.parametrize("prompt", [[1, 2.5], [1, "2"], [1, None]], ids=["float", "str", "none"])
def test_prompt_ids_that_are_not_ints(llm: LLM, prompt: list) -> None:
    with pytest.raises(RequestError, match="give a string or a list of token ids"):
        llm.generate([prompt], GREEDY)
    assert_idle(llm)


@pytest.mark.parametrize("prompts", [None, 5, b"If the file"], ids=["none", "int", "bytes"])
def test_prompts_that_are_neither_a_prompt_nor_a_list_of_them(llm: LLM, prompts) -> None:
    with pytest.raises(RequestError, match=r"prompts=.*: give a string \(one prompt\) or a list of prompts"):
        llm.generate(prompts, GREEDY)
    assert_idle(llm)


def test_chat_joins_text_parts_as_serve_does(llm: LLM) -> None:
    """Content given as text parts is their text in the prompt, not their Python repr."""
    parts = [{"type": "text", "text": "If the "}, {"type": "text", "text": "file"}]
    [got] = llm.chat([{"role": "user", "content": parts, "name": "ann"}], SamplingParams(max_tokens=1))
    [want] = llm.chat([{"role": "user", "content": "If the file", "name": "ann"}], SamplingParams(max_tokens=1))
    assert got.prompt_token_ids == want.prompt_token_ids
    assert "If the file" in llm.decode(got.prompt_token_ids)


BAD_CONVERSATIONS = {  # id: (conversations, words the RequestError must hold)
    "no-role": ([{"content": "x"}], ["messages.0.role: missing", "system, user, assistant, developer, tool"]),
    "empty-role": ([{"role": "", "content": "x"}], ["messages.0.role: '' is not a role", "developer"]),
    "unknown-role": ([{"role": "user", "content": "x"}, {"role": "wizard", "content": "hi"}],
                     ["messages.1.role: 'wizard' is not a role"]),
    "no-content": ([{"role": "user"}], ["messages.0.content: missing", "text parts"]),
    "null-content": ([{"role": "assistant", "content": None}], ["messages.0.content: missing"]),
    "tool-calls": ([{"role": "assistant", "content": "x", "tool_calls": []}],
                   ["messages.0.tool_calls: unknown field", "role, content, name"]),
    "image-part": ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                   ["messages.0.content.0=", "text parts"]),
    "second-conversation": ([[{"role": "user", "content": "x"}], [{"role": "user", "content": 5}]],
                            ["conversations.1.0.content=5"]),
    "none": (None, ["conversations=None", "a list of conversations"]),
    "string": ("hello", ["conversations='hello'", "a list of conversations"]),
    "ints": ([1, 2], ["conversations.0=1", "a list of messages"]),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD_CONVERSATIONS), ids=list(BAD_CONVERSATIONS))
def test_chat_refuses_malformed_messages_by_name(llm: LLM, bad: str) -> None:
    conversations, words = BAD_CONVERSATIONS[bad]
    with pytest.raises(RequestError) as caught:
        llm.chat(conversations, GREEDY)
    assert all(word in str(caught.value) for word in words), str(caught.value)
    assert_idle(llm)


def bad_request_past_its_third_token(rows: SamplingTensors) -> bool:
    return any(seed == BAD_SEED and step >= 3 for seed, step in zip(rows.seed.tolist(), rows.step.tolist()))


def test_a_step_failing_fails_only_the_request_at_fault(
    any_llm: LLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A request whose fourth draw makes the step raise, batched with a request running on its own
    (another caller's) and two more of the same call: the failed step's requests each run alone once,
    only the one at fault fails (with the tokens it had), the others give what they give alone."""
    llm = any_llm
    other = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=1)
    params = [GREEDY, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=BAD_SEED),
              SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_k=20, seed=2)]  # fmt: skip
    prompts = ["the kiln", PROMPT, "graphs flow"]
    alone = [llm.generate(p, q)[0].token_ids for p, q in zip(prompts, params)]
    other_alone = llm.generate("a long running request", other)[0].token_ids

    fault_in_sampler(monkeypatch, RuntimeError("device fault"), bad_request_past_its_third_token)
    engine = llm.engine
    running = engine.add_request(llm.encode("a long running request"), other)
    for _ in range(4):
        engine.step()
    failed = r"request \d+ \(prompt 1\) failed in an engine step \(RuntimeError: device fault\)"
    with caplog.at_level(logging.WARNING, logger="graphkiln.runtime"):
        with pytest.raises(RequestFailedError, match=failed) as caught:
            llm.generate(prompts, params)
    assert "running each alone once" in caplog.text
    outputs = caught.value.outputs
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert [o.token_ids for o in outputs] == [alone[0], alone[1][:3], alone[2]]
    assert isinstance(caught.value.__cause__, RuntimeError)
    while engine.has_work():
        engine.step()
    assert running.output_ids == other_alone and running.finish_reason == "length"
    assert_idle(llm)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone


def test_a_batched_step_failing_once_is_rerun_and_nobody_fails(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault of the step, not of a request (it does not come back): its requests run alone once each,
    then together again, and every one gives what it gives without the fault."""
    prompts = ["the kiln", PROMPT, "graphs flow"]
    params = [GREEDY, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7), GREEDY]
    want = [o.token_ids for o in llm.generate(prompts, params)]
    fault_in_sampler(monkeypatch, RuntimeError("transient fault"), nth_call(3))
    with caplog.at_level(logging.WARNING, logger="graphkiln.runtime"):
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert "running each alone once" in caplog.text
    assert_idle(llm)


def test_a_step_of_one_request_failing(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    fault_in_sampler(monkeypatch, RuntimeError("device fault"), nth_call(2))
    with pytest.raises(RequestFailedError, match=r"request \d+ \(prompt 0\) failed") as caught:
        llm.generate(PROMPT, GREEDY)
    assert [(o.finish_reason, len(o.token_ids)) for o in caught.value.outputs] == [("error", 1)]
    assert_idle(llm)
    fault_in_sampler(monkeypatch, RuntimeError("device fault"), bad_request_past_its_third_token)
    stream = llm.generate_stream(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, seed=BAD_SEED, temperature=1.0))
    assert len([next(stream) for _ in range(3)]) == 3
    with pytest.raises(RequestFailedError, match=r"request \d+ failed in an engine step \(RuntimeError"):
        next(stream)
    monkeypatch.undo()
    assert_idle(llm)
    assert len(llm.generate(PROMPT, GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_a_fault_found_at_read_back_fails_that_steps_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device fault surfacing when a step's ids are read (as an asynchronous CUDA error does)."""
    results, fail = LaunchedStep.results, nth_call(3)

    def faulty(step: LaunchedStep):
        if fail():
            raise RuntimeError("illegal memory access")
        return results(step)

    want = [o.token_ids for o in llm.generate([PROMPT, "graphs"], GREEDY)]
    monkeypatch.setattr(LaunchedStep, "results", faulty)
    with pytest.raises(RequestFailedError, match=r"prompt 0\), request \d+ \(prompt 1\) failed") as caught:
        llm.generate([PROMPT, "graphs"], GREEDY)
    assert [o.token_ids for o in caught.value.outputs] == [w[:2] for w in want]
    assert_idle(llm)
    assert [o.token_ids for o in llm.generate([PROMPT, "graphs"], GREEDY)] == want


def test_interrupted_launch_aborts_the_calls_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    want = [o.token_ids for o in llm.generate([PROMPT, "graphs"], GREEDY)]
    fault_in_sampler(monkeypatch, KeyboardInterrupt(), nth_call(3))
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, "graphs"], GREEDY)
    assert_idle(llm)
    assert [o.token_ids for o in llm.generate([PROMPT, "graphs"], GREEDY)] == want


def test_interrupted_read_back_loses_no_other_callers_token(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while waiting for a step's ids: the interrupted call's requests are aborted; a request of
    another caller in that step gets its token when the next step reads the step back."""
    other = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=1)
    other_alone = llm.generate("a long running request", other)[0].token_ids
    engine = llm.engine
    running = engine.add_request(llm.encode("a long running request"), other)
    for _ in range(3):
        engine.step()
    results, interrupt = LaunchedStep.results, nth_call(2)

    def interrupted(step: LaunchedStep):
        if interrupt():
            raise KeyboardInterrupt
        return results(step)

    monkeypatch.setattr(LaunchedStep, "results", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPT, GREEDY)
    assert len(engine.in_flight) == 2  # the step cut short, and the one launched before it
    while engine.has_work():
        engine.step()
    assert running.output_ids == other_alone
    assert_idle(llm)
