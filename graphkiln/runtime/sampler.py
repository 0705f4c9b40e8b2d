"""Sampling on the device, batched and without a host round trip, so it runs inside decode CUDA graphs.

Every row carries its own temperature (0: greedy), top-k (0: off), top-p (1: off), seed and step.
Sampled rows draw by the exponential race, argmax of p / E with E ~ Exp(1), where E comes from a
counter-based hash of (seed, step, token id): a seeded request gets the same tokens whatever else
shares its batch and whichever path (graph replay or not) runs it. Temperature applies first, then
top-k, then top-p, as in transformers and vLLM. Log-probabilities are those of the model's own
distribution (before temperature and filters): the sampled token's, and the MAX_LOGPROBS most likely
tokens' at a fixed width, so one captured graph serves every N; each request's N is sliced on the host.

A step runs in one of three modes, so a batch pays only for what it uses: "greedy" (argmax only, no
log-probabilities), "sample" (temperature, no filter: no sort) and "filter" (top-k/top-p: one sort
of the logits). A batch where a row asks for log-probabilities runs "sample" at least.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .sampling_params import MAX_LOGPROBS, SamplingParams
from .transfer import upload

MODES = ("greedy", "sample", "filter")
# splitmix64's constants as signed int64 (torch multiplies int64 with two's-complement wrap-around)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


DTYPES = (torch.float32, torch.int64, torch.float32, torch.int64, torch.int64)  # SamplingTensors' fields
NEUTRAL_ROW = (0.0, 0, 1.0, 0, 0)  # greedy, no filter: what padded rows carry


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters on the device; the decode graphs keep one static set."""

    temperature: torch.Tensor  # float32 [N]
    top_k: torch.Tensor  # int64 [N]
    top_p: torch.Tensor  # float32 [N]
    seed: torch.Tensor  # int64 [N]
    step: torch.Tensor  # int64 [N]

    @classmethod
    def empty(cls, rows: int, device: torch.device | str) -> SamplingTensors:
        """`rows` neutral rows."""
        return cls(*(torch.full((rows,), v, dtype=d, device=device) for v, d in zip(NEUTRAL_ROW, DTYPES)))

    def rows(self, n: int) -> SamplingTensors:
        return SamplingTensors(*(t[:n] for t in self))


class Sampled(NamedTuple):
    """One step's sampled rows on the device: token ids and, unless greedy, the model's log-probabilities
    of them and its most likely tokens with theirs (most likely first)."""

    ids: torch.Tensor  # int64 [N]
    logprobs: torch.Tensor | None  # float32 [N]
    top_ids: torch.Tensor | None  # int64 [N, min(MAX_LOGPROBS, vocab)]
    top_logprobs: torch.Tensor | None  # float32 [N, min(MAX_LOGPROBS, vocab)]

    def rows(self, n: int) -> Sampled:
        return Sampled(*(None if t is None else t[:n] for t in self))


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling rows on the host: what the device tensors are filled from."""

    temperature: tuple[float, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]
    seed: tuple[int, ...]
    step: tuple[int, ...]
    logprobs: int | None  # the most likely tokens any row lists (None: no row asks for log-probabilities)

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> SamplingBatch:
        logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        return cls(
            tuple(0.0 if p.greedy else p.temperature for p in params), tuple(p.top_k for p in params),
            tuple(p.top_p for p in params), tuple(seeds), tuple(steps), logprobs,
        )  # fmt: skip

    @property
    def mode(self) -> str:
        sampled = [i for i, t in enumerate(self.temperature) if t > 0]
        if any(self.top_k[i] > 1 or self.top_p[i] < 1.0 for i in sampled):
            return "filter"
        return "sample" if sampled or self.logprobs is not None else "greedy"

    def columns(self) -> tuple[tuple, ...]:
        """The five per-row fields in SamplingTensors order."""
        return self.temperature, self.top_k, self.top_p, self.seed, self.step

    def padded(self, rows: int) -> SamplingBatch:
        """Grown to `rows` with neutral rows (greedy, no filter): what a padded batch's rows carry."""
        pad = rows - len(self.temperature)
        if pad == 0:
            return self
        return SamplingBatch(*(c + (fill,) * pad for c, fill in zip(self.columns(), NEUTRAL_ROW)), self.logprobs)

    def tensors(self, device: torch.device | str) -> SamplingTensors:
        return SamplingTensors(*(upload(c, d, device) for c, d in zip(self.columns(), DTYPES)))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [N, V] in two parallel stages (chunk maxima, then the best chunk).

    One row of a large vocabulary is a single-block reduction for torch.argmax, one multiprocessor
    reading the whole row; splitting it into up to 256 chunks spreads it over the GPU. Ties resolve to the first index,
    as torch.argmax does.
    """
    rows, vocab = logits.shape
    chunks = math.gcd(vocab, 256)
    if chunks == 1:
        return logits.argmax(-1)
    values, inner = logits.view(rows, chunks, vocab // chunks).max(-1)
    best = values.argmax(-1, keepdim=True)
    return inner.gather(1, best).add_(best, alpha=vocab // chunks).squeeze(1)  # one launch for the offset


def filter_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what each row's top-k, then top-p (smallest prefix of probability >= p), excludes; the most
    likely token always stays (a top_p that is 0 in float32 would otherwise exclude every token)."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    keep = ranks < torch.where(top_k > 0, top_k, vocab)[:, None]
    probs = ordered.masked_fill(~keep, float("-inf")).softmax(-1)
    keep &= (probs.cumsum(-1) - probs < top_p[:, None]) | (ranks == 0)
    drop = torch.empty_like(keep).scatter_(1, order, ~keep)
    return logits.masked_fill(drop, float("-inf"))


def _mix64(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


def exponential_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws [N, vocab], a pure function of (seed, step, token id): splitmix64 of a counter."""
    row = _mix64(seed * _GOLDEN + step)
    x = _mix64(row[:, None] + torch.arange(vocab, device=seed.device, dtype=torch.int64) * _GOLDEN)
    uniform = ((x >> 32) & 0x7FFFFF).float().add_(0.5).mul_(2.0**-23)  # bits 32..54; exact in float32, never 0 or 1
    return uniform.log_().neg_()


def sample(logits: torch.Tensor, rows: SamplingTensors, mode: str) -> Sampled:
    """Token ids [N] for logits [N, V] and, unless greedy, the model's log-probabilities of them and its
    min(MAX_LOGPROBS, V) most likely tokens. The greedy choice is taken in the logits' own dtype, whose
    conversion to float32 keeps their order: a greedy step converts nothing."""
    greedy = argmax_rows(logits)
    if mode == "greedy":
        return Sampled(greedy, None, None, None)
    logits = logits.float()
    scaled = logits / rows.temperature.clamp_min(1e-6)[:, None]
    if mode == "filter":
        scaled = filter_rows(scaled, rows.top_k, rows.top_p)
    drawn = argmax_rows(scaled - exponential_noise(rows.seed, rows.step, logits.shape[-1]).log_())
    chosen = torch.where(rows.temperature > 0, drawn, greedy)
    logprobs = logits.log_softmax(-1)
    top_logprobs, top_ids = logprobs.topk(min(MAX_LOGPROBS, logits.shape[-1]), -1)
    return Sampled(chosen, logprobs.gather(1, chosen[:, None]).squeeze(1), top_ids, top_logprobs)
