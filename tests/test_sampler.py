"""Sampling: seeded reproducibility end to end, and the sampler's filters and draws in isolation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

from graphkiln import LLM, SamplingParams
from graphkiln.runtime.sampler import SamplingBatch, argmax_rows, exponential_noise, filter_rows, sample

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
    batched = sampled(llm, [random_ids(5, seed=12), prompt, prompt], seed=1)  # draws depend on (seed, step) only
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
    assert torch.allclose(torch.tensor([lp.logprob for lp in out.logprobs]), expected, atol=1e-4, rtol=0)


def filter_row(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    return filter_rows(logits[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]


def rows_of(params: list[SamplingParams], seeds: list[int] | None = None) -> SamplingBatch:
    seeds = list(range(len(params))) if seeds is None else seeds
    return SamplingBatch.of(params, seeds, [0] * len(params))


def test_filter_top_k_keeps_exactly_k() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    for k in (1, 7, 49):
        kept = filter_row(logits, top_k=k, top_p=1.0).isfinite()
        assert kept.sum() == k
        assert set(kept.nonzero().flatten().tolist()) == set(logits.topk(k).indices.tolist())
    assert torch.equal(filter_row(logits, top_k=0, top_p=1.0), logits)
    assert torch.equal(filter_row(logits, top_k=50, top_p=1.0), logits)


@pytest.mark.parametrize(
    "top_p, kept", [(0.05, {2}), (0.39, {2}), (0.41, {2, 0}), (0.69, {2, 0}), (0.71, {2, 0, 3}), (0.99, {0, 1, 2, 3})]
)
def test_filter_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: set[int]) -> None:
    probs = torch.tensor([0.3, 0.1, 0.4, 0.2])  # sorted: 2 (0.4), 0 (0.3), 3 (0.2), 1 (0.1)
    filtered = filter_row(probs.log(), top_k=0, top_p=top_p)
    assert set(filtered.isfinite().nonzero().flatten().tolist()) == kept
    assert torch.equal(filtered[list(kept)], probs.log()[list(kept)])


@pytest.mark.parametrize("top_p", [1e-46, 1e-45, 1e-30])
def test_filter_keeps_the_most_likely_token_at_any_positive_top_p(top_p: float) -> None:
    """1e-46 is 0 in float32: the prefix test alone would drop every token and the draw would fall on id 0."""
    probs = torch.tensor([0.3, 0.1, 0.4, 0.2])
    filtered = filter_row(probs.log(), top_k=0, top_p=top_p)
    assert filtered.isfinite().nonzero().flatten().tolist() == [2]


def test_filter_rows_each_row_its_own_top_k_and_top_p() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(20, 30, generator=gen)
    top_k = torch.randint(0, 12, (20,), generator=gen)
    top_p = torch.rand(20, generator=gen)
    kept = filter_rows(logits, top_k, top_p).isfinite()
    for row in range(20):
        ordered, order = logits[row].sort(descending=True)
        k = int(top_k[row]) or 30
        probs = ordered[:k].softmax(-1)
        size = int((probs.cumsum(-1) < top_p[row]).sum()) + 1  # top-p over what top-k kept
        assert set(kept[row].nonzero().flatten().tolist()) == set(order[: min(size, k)].tolist())


def test_noise_is_exponential_and_depends_only_on_seed_and_step() -> None:
    noise = exponential_noise(torch.tensor([5, 5, 5, 6]), torch.tensor([0, 0, 1, 0]), 200_000)
    assert torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[3])
    assert (noise > 0).all() and noise.isfinite().all()
    assert (noise.mean(1) - 1).abs().max() < 0.01 and (noise.std(1) - 1).abs().max() < 0.01
    assert torch.corrcoef(noise[[0, 2, 3]]).triu(1).abs().max() < 0.01


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sample_frequencies_follow_softmax(temperature: float) -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 4000
    logits = probs.log().expand(draws, 4)
    rows = rows_of([SamplingParams(temperature=temperature, logprobs=True)] * draws)
    tokens, logprobs, _, _ = sample(logits, rows.tensors("cpu"), rows.mode)
    expected = (probs.log() / temperature).softmax(-1)
    frequencies = torch.bincount(tokens, minlength=4).float() / draws
    assert (frequencies - expected).abs().max() < 0.03  # about 4 standard deviations
    assert torch.allclose(logprobs, probs.log()[tokens])


def test_filtered_sampling_draws_only_kept_tokens_in_proportion() -> None:
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    draws = 4000
    rows = rows_of([SamplingParams(temperature=1.0, top_k=3, top_p=0.7)] * draws)
    assert rows.mode == "filter"
    tokens = sample(probs.log().expand(draws, 4), rows.tensors("cpu"), rows.mode).ids
    frequencies = torch.bincount(tokens, minlength=4).float() / draws  # top-k keeps 1..3, top-p keeps 3, 2
    assert frequencies[:2].sum() == 0
    assert abs(frequencies[3].item() - 0.5 / 0.8) < 0.03


def test_sample_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 0.0, 0.0], [5.0, 0.0, 1.0]]).repeat(100, 1)
    rows = rows_of([SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(top_k=1, temperature=1.0)] * 100)
    assert rows.mode == "sample"  # top-k 1 is greedy, so no row filters
    tokens = sample(logits, rows.tensors("cpu"), rows.mode).ids
    assert tokens[0::3].eq(1).all() and tokens[2::3].eq(0).all()
    assert set(tokens[1::3].tolist()) == {0, 1, 2}


def test_modes_and_logprobs_only_when_asked() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    greedy = rows_of([SamplingParams()])
    assert greedy.mode == "greedy" and greedy.logprobs is None
    assert sample(logits, greedy.tensors("cpu"), greedy.mode)[1:] == (None, None, None)
    asked = rows_of([SamplingParams(logprobs=True), SamplingParams(logprobs=2), SamplingParams()])
    assert asked.mode == "sample" and asked.logprobs == 2  # the most any row lists
    out = sample(logits.expand(3, 3), asked.tensors("cpu"), asked.mode)
    assert out.ids.tolist() == [1] * 3 and torch.allclose(out.logprobs, logits.log_softmax(-1)[:, 1])
    assert out.top_ids.tolist() == [[1, 2, 0]] * 3  # every token of a 3-token vocabulary, most likely first
    assert torch.allclose(out.top_logprobs, logits.log_softmax(-1).sort(descending=True).values)
    assert rows_of([SamplingParams(temperature=0.0, top_p=0.5)]).mode == "greedy"


@pytest.mark.parametrize("vocab", [24, 512, 4096, 1000, 151936])  # every one in chunks: 24 in 8 of 3
def test_argmax_rows_matches_torch_argmax_including_ties(vocab: int) -> None:
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1] = 0.0  # every index ties: the first wins
    logits[2, vocab // 2] = logits[2, -1] = 100.0  # a tie across chunks
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_tokens_of_half_precision_logits_are_those_of_their_float32_values(dtype: torch.dtype) -> None:
    """A greedy step takes the argmax in the logits' own dtype, converting nothing: the same tokens as float32,
    ties (frequent at 8 bits of mantissa) to the first index."""
    logits = (torch.randn(6, 128256, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    logits[3, 100] = logits[3, 90000] = logits[3].max() + 1  # a tie across chunks
    greedy = rows_of([SamplingParams()] * 6)
    assert torch.equal(sample(logits, greedy.tensors("cpu"), greedy.mode).ids, logits.float().argmax(-1))
    padded = torch.cat([logits, torch.full((6, 2), 1e4, dtype=dtype)], dim=1)[:, :-2]  # a tensor-parallel gather's
    assert not padded.is_contiguous()  # slice of the padded vocabulary
    assert torch.equal(sample(padded, greedy.tensors("cpu"), greedy.mode).ids, logits.float().argmax(-1))
