"""The engine under pressure and its request features: batching limits, preemption, streaming, stops, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

from graphkiln import LLM, SamplingParams
from graphkiln.errors import CapacityError

if TYPE_CHECKING:
    from conftest import Checkpoint, CheckpointFactory

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
LENGTHS = (10, 12, 3, 14, 9)


@pytest.fixture(scope="module")
def llm(llama: Checkpoint) -> LLM:
    return LLM.eager(llama.path)


@pytest.fixture(scope="module")
def many_prompts(random_ids: Callable[..., list[int]]) -> list[list[int]]:
    return [random_ids(n, seed=100 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def solo(llm: LLM, many_prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of every prompt generated alone."""
    return [llm.generate([p], GREEDY)[0].token_ids for p in many_prompts]


def run_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int, int]:
    """Drive the engine step by step: each request's tokens, the most sequences running after a step, and how
    many steps left a sequence that had already generated back in the waiting queue (preempted)."""
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompts]
    most_running = preempted_steps = 0
    while engine.has_work():
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
        preempted_steps += any(s.output_ids and s.num_computed == 0 for s in engine.scheduler.waiting)
    assert all(s.finish_reason == "length" for s in seqs)
    return [list(s.output_ids) for s in seqs], most_running, preempted_steps


def test_more_prompts_than_max_num_seqs(
    llama: Checkpoint, many_prompts: list[list[int]], solo: list[list[int]]
) -> None:
    llm = LLM.eager(llama.path, max_num_seqs=2)
    tokens, most_running, _ = run_engine(llm, many_prompts, GREEDY)
    assert tokens == solo
    assert most_running == 2
    assert [o.token_ids for o in llm.generate(many_prompts, GREEDY)] == solo


def test_kv_cache_exhaustion_preempts_and_recomputes(
    llama: Checkpoint, many_prompts: list[list[int]], solo: list[list[int]]
) -> None:
    """4 blocks of 16 tokens hold any one request (at most 33 tokens) but not all five at once."""
    llm = LLM.eager(llama.path, kv_cache_tokens=64, block_size=16)
    free = llm.engine.allocator.num_free
    assert free == 4
    tokens, _, preempted_steps = run_engine(llm, many_prompts, GREEDY)
    assert tokens == solo
    assert preempted_steps > 0
    assert llm.engine.allocator.num_free == free
    assert [o.token_ids for o in llm.generate(many_prompts, GREEDY)] == solo
    assert llm.engine.allocator.num_free == free


@pytest.mark.parametrize("prompt_len, max_tokens", [(10, 100), (65, 1)], ids=["by-max-tokens", "by-prompt"])
def test_request_that_never_fits(
    llama: Checkpoint, random_ids: Callable[..., list[int]], prompt_len: int, max_tokens: int
) -> None:
    llm = LLM.eager(llama.path, kv_cache_tokens=64, block_size=16)
    with pytest.raises(CapacityError, match=r"needs \d+ KV blocks but the cache holds 4"):
        llm.generate([random_ids(3), random_ids(prompt_len)], SamplingParams(max_tokens=max_tokens))
    assert llm.engine.allocator.num_free == 4 and not llm.engine.has_work()
    assert len(llm.generate([random_ids(3)], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids) == 5


def test_stream_matches_generate_token_ids(llm: LLM, many_prompts: list[list[int]], solo: list[list[int]]) -> None:
    deltas = list(llm.generate_stream(many_prompts[0], GREEDY))
    assert [d.token_id for d in deltas] == solo[0]
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert all(d.text == "" for d in deltas)  # no tokenizer: ids only


def test_stream_text_concatenates_to_final_text() -> None:
    llm = LLM.eager("tiny")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = llm.generate("the kiln compiles a graph", params)[0]
    deltas = list(llm.generate_stream("the kiln compiles a graph", params))
    assert [d.token_id for d in deltas] == out.token_ids
    assert out.text and "".join(d.text for d in deltas) == out.text
    assert out.prompt_token_ids[0] == 1  # the tokenizer prepends <s>


def test_abandoned_stream_frees_its_request(llama: Checkpoint, many_prompts: list[list[int]]) -> None:
    llm = LLM.eager(llama.path)
    free = llm.engine.allocator.num_free
    stream = llm.generate_stream(many_prompts[0], SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_work() and llm.engine.allocator.num_free == free


def test_stop_token_ids(llm: LLM, many_prompts: list[list[int]], solo: list[list[int]]) -> None:
    greedy = solo[1]
    index = next(i for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    out = llm.generate([many_prompts[1]], SamplingParams(max_tokens=20, stop_token_ids=[greedy[index]]))[0]
    assert out.token_ids == greedy[: index + 1]
    assert out.finish_reason == "stop"


def test_stop_found_at_read_back_drops_the_step_launched_after_it(
    llm: LLM, many_prompts: list[list[int]], solo: list[list[int]]
) -> None:
    """Steps are pipelined: when a token is read back as a stop, one more step already ran for that
    request. Its row is dropped, the others in the batch continue, and every KV block comes back."""
    greedy = solo[1]
    index = next(i for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    free = llm.engine.allocator.num_free
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * len(many_prompts)
    params[1] = SamplingParams(max_tokens=20, stop_token_ids=[greedy[index]])
    outs = llm.generate(many_prompts, params)
    assert (outs[1].token_ids, outs[1].finish_reason) == (greedy[: index + 1], "stop")
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [s for i, s in enumerate(solo) if i != 1]
    assert not llm.engine.has_work() and llm.engine.allocator.num_free == free


def test_a_step_in_flight_is_read_back_one_step_later(llm: LLM, many_prompts: list[list[int]]) -> None:
    engine = llm.engine
    seq = engine.add_request(many_prompts[0], SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.step() == [] and seq.output_ids == [] and seq.num_output == 1  # launched, token pending
    first = engine.step()  # launches the next step, returns the first token
    assert [e.token_id for e in first] == seq.output_ids and len(seq.output_ids) == 1
    engine.abort(seq)
    assert not engine.has_work() and engine.step() == [] and not engine.in_flight


def test_eos_stops_unless_ignored(
    hf_checkpoint: CheckpointFactory, many_prompts: list[list[int]], solo: list[list[int]]
) -> None:
    greedy = solo[2]
    index = next(i for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    llm = LLM.eager(hf_checkpoint("llama", eos_token_id=greedy[index]).path)  # same weights, an eos id
    stopped = llm.generate([many_prompts[2]], SamplingParams(max_tokens=20))[0]
    assert (stopped.token_ids, stopped.finish_reason) == (greedy[: index + 1], "stop")
    ignored = llm.generate([many_prompts[2]], GREEDY)[0]
    assert (ignored.token_ids, ignored.finish_reason) == (greedy, "length")


def test_max_tokens_finishes_with_length(llm: LLM, many_prompts: list[list[int]], solo: list[list[int]]) -> None:
    outs = llm.generate(many_prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 5, 7, 2, 20)])
    assert [o.token_ids for o in outs] == [s[:n] for s, n in zip(solo, (1, 5, 7, 2, 20))]
    assert all(o.finish_reason == "length" for o in outs)


def test_generation_stops_at_context_end(llm: LLM, llama: Checkpoint, random_ids: Callable[..., list[int]]) -> None:
    prompt = random_ids(llama.max_context - 5)
    out = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_prompt_filling_the_context_is_prefilled_in_chunks_then_stops(
    llama: Checkpoint, random_ids: Callable[..., list[int]]
) -> None:
    """A full-context prompt reaches the context limit before its last chunk; it must still be scheduled."""
    llm = LLM.eager(llama.path, max_num_batched_tokens=32)
    out = llm.generate([random_ids(llama.max_context)], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_logprobs(llm: LLM, many_prompts: list[list[int]], solo: list[list[int]]) -> None:
    prompt = many_prompts[3]
    out = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, logprobs=True))[0]
    assert out.token_ids == solo[3]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids and all(lp.top == () for lp in out.logprobs)
    logprobs = torch.tensor([lp.logprob for lp in out.logprobs])
    assert (logprobs <= 0).all()
    logits = llm.score(prompt + out.token_ids[:-1])[len(prompt) - 1 :]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(logprobs, expected, atol=1e-4, rtol=0)
    assert llm.generate([prompt], GREEDY)[0].logprobs is None


def test_timings(llm: LLM, many_prompts: list[list[int]]) -> None:
    out = llm.generate([many_prompts[0]], GREEDY)[0]
    assert 0 < out.time_to_first_token_s <= out.total_s and out.tokens_per_s > 0
