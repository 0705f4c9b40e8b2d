"""Sampling: seeded reproducibility end to end, and the sampler's filters and draws in isolation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

from graphkiln import LLM, SamplingParams
from graphkiln.runtime.sampler import argmax_rows, filter_logits, sample

if TYPE_CHECKING:
    from conftest import Checkpoint

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm(llama: Checkpoint) -> LLM:
    return LLM.eager(llama.path)


@pytest.fixture(scope="module")
def prompt(random_ids: Callable[..., list[int]]) -> list[int]:
    return random_ids(7, seed=11)


@pytest.fixture(scope="module")
def greedy(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids


def sampled(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, **params))
    return [o.token_ids for o in outs]


def test_seed_reproducible(
    llm: LLM, prompt: list[int], greedy: list[int], random_ids: Callable[..., list[int]]
) -> None:
    first = sampled(llm, [prompt], seed=1)[0]
    assert sampled(llm, [prompt], seed=1)[0] == first
    assert sampled(llm, [prompt], seed=2)[0] != first
    assert first != greedy
    batched = sampled(llm, [random_ids(5, seed=12), prompt, prompt], seed=1)  # one generator per request
    assert batched[1] == batched[2] == first


def test_top_k_1_is_greedy(llm: LLM, prompt: list[int], greedy: list[int]) -> None:
    assert sampled(llm, [prompt], top_k=1, seed=3)[0] == greedy


def test_tiny_top_p_is_greedy(llm: LLM, prompt: list[int], greedy: list[int]) -> None:
    assert sampled(llm, [prompt], top_p=1e-6, seed=3)[0] == greedy


def test_sampled_logprobs_are_the_model_distribution(llm: LLM, prompt: list[int]) -> None:
    """Log-probabilities are those of the model itself, before temperature and filters."""
    params = SamplingParams(max_tokens=8, temperature=1.7, top_k=20, seed=5, ignore_eos=True, logprobs=True)
    out = llm.generate([prompt], params)[0]
    logits = llm.score(prompt + out.token_ids[:-1])[len(prompt) - 1 :]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def test_filter_top_k_keeps_exactly_k() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    for k in (1, 7, 49):
        kept = filter_logits(logits, top_k=k, top_p=1.0).isfinite()
        assert kept.sum() == k
        assert set(kept.nonzero().flatten().tolist()) == set(logits.topk(k).indices.tolist())
    assert torch.equal(filter_logits(logits, top_k=0, top_p=1.0), logits)
    assert torch.equal(filter_logits(logits, top_k=50, top_p=1.0), logits)


@pytest.mark.parametrize(
    "top_p, kept", [(0.05, {2}), (0.39, {2}), (0.41, {2, 0}), (0.69, {2, 0}), (0.71, {2, 0, 3}), (0.99, {0, 1, 2, 3})]
)
def test_filter_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: set[int]) -> None:
    probs = torch.tensor([0.3, 0.1, 0.4, 0.2])  # sorted: 2 (0.4), 0 (0.3), 3 (0.2), 1 (0.1)
    filtered = filter_logits(probs.log(), top_k=0, top_p=top_p)
    assert set(filtered.isfinite().nonzero().flatten().tolist()) == kept
    assert torch.equal(filtered[list(kept)], probs.log()[list(kept)])


def test_filter_top_p_random_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = 3 * torch.randn(30, generator=gen)
        top_p = torch.rand(1, generator=gen).item()
        probs, order = logits.softmax(-1).sort(descending=True)
        size = int((probs.cumsum(-1) < top_p).sum()) + 1
        kept = filter_logits(logits, top_k=0, top_p=top_p).isfinite()
        assert set(kept.nonzero().flatten().tolist()) == set(order[:size].tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sample_frequencies_follow_softmax(temperature: float) -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 4000
    logits = probs.log().expand(draws, 4)
    params = [SamplingParams(temperature=temperature, logprobs=True)] * draws
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits, params, [gen] * draws)
    expected = (probs.log() / temperature).softmax(-1)
    frequencies = torch.bincount(tokens, minlength=4).float() / draws
    assert (frequencies - expected).abs().max() < 0.03  # about 4 standard deviations
    assert torch.allclose(logprobs, probs.log()[tokens])


def test_sample_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 0.0, 0.0], [5.0, 0.0, 1.0]]).repeat(100, 1)
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(top_k=1, temperature=1.0)] * 100
    tokens, _ = sample(logits, params, [torch.Generator().manual_seed(0)] * 300)
    assert tokens[0::3].eq(1).all() and tokens[2::3].eq(0).all()
    assert set(tokens[1::3].tolist()) == {0, 1, 2}


def test_logprobs_only_when_asked() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert sample(logits, [SamplingParams()], [None])[1] is None
    _, logprobs = sample(logits, [SamplingParams(logprobs=True)], [None])
    assert torch.allclose(logprobs, logits.log_softmax(-1)[:, 1])


@pytest.mark.parametrize("vocab", [7, 512, 4096, 1000, 151936])
def test_argmax_rows_matches_torch_argmax_including_ties(vocab: int) -> None:
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1] = 0.0  # every index ties: the first wins
    logits[2, vocab // 2] = logits[2, -1] = 100.0  # a tie across chunks
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
