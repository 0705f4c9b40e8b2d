"""logprobs=N: each generated token's log-probability and the N most likely tokens', computed on the
device with the sampler and checked against a float32 reference from the same engine's score()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import graphkiln
from graphkiln import LLM, RequestOutput, SamplingParams

PROMPTS = ["the kiln compiles a graph", "tokens", "every layer of the model", "a b c"]
PARAMS = [
    SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5),  # greedy, computed in the "sample" mode
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=1, logprobs=20),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_k=30, top_p=0.9, seed=2, logprobs=0),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.7, seed=3),
]


@pytest.fixture(scope="module", params=["eager", "compiled"])
def llm(request: pytest.FixtureRequest, artifact: Path) -> LLM:
    if request.param == "eager":
        return LLM.eager("tiny", kv_cache_tokens=1024)
    return graphkiln.load(artifact, kv_cache_tokens=1024, capture="blocking")


def assert_matches_reference(llm: LLM, out: RequestOutput, n: int) -> None:
    """Every token's entry against log_softmax of the float32 logits score() gives for the same prefix."""
    prompt = out.prompt_token_ids
    reference = llm.score(prompt + out.token_ids[:-1])[len(prompt) - 1 :].log_softmax(-1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for entry, token, ref in zip(out.logprobs, out.token_ids, reference):
        assert entry.token_id == token and abs(entry.logprob - ref[token].item()) <= 1e-4
        ids = [i for i, _ in entry.top]
        values = torch.tensor([v for _, v in entry.top])
        assert len(ids) == len(set(ids)) == n
        assert torch.allclose(values, ref.topk(n).values, atol=1e-4, rtol=0)  # the n largest, most likely first
        assert torch.allclose(ref[ids], values, atol=1e-4, rtol=0)  # each with its own logprob (ties in any order)


def test_logprobs_n_against_the_reference_alone_and_batched(llm: LLM) -> None:
    """Alone and batched (one sampling mode for the batch, at its widest N: test_sampler.py checks which), each
    request's tokens the same and its own N entries against the reference."""
    alone = [llm.generate(prompt, params)[0] for prompt, params in zip(PROMPTS, PARAMS)]
    batched = llm.generate(PROMPTS, PARAMS)
    for one, many, params in zip(alone, batched, PARAMS):
        assert many.token_ids == one.token_ids
        if params.logprobs is None:
            assert one.logprobs is None and many.logprobs is None
            continue
        assert_matches_reference(llm, one, params.logprobs)
        assert_matches_reference(llm, many, params.logprobs)


def test_stream_deltas_carry_the_same_logprobs(llm: LLM) -> None:
    params = PARAMS[1]
    out = llm.generate(PROMPTS[1], params)[0]
    deltas = list(llm.generate_stream(PROMPTS[1], params))
    assert [d.logprobs for d in deltas] == out.logprobs
    assert all(d.logprobs is None for d in llm.generate_stream(PROMPTS[1], PARAMS[3]))


def test_logprobs_true_false_none() -> None:
    assert SamplingParams(logprobs=True).logprobs == 0
    assert SamplingParams(logprobs=False).logprobs is None
    assert SamplingParams().logprobs is None
    assert SamplingParams(logprobs=20).logprobs == 20
