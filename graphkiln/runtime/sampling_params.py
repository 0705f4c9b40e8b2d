"""SamplingParams: what one request asks of the sampler and the stop rules (public as graphkiln.SamplingParams).

Every field is checked on construction, type and range, so a bad value is a RequestError naming it
before the request reaches a step (where it would fail on the device, or in the host-to-device copy).
Values are normalized: numpy integers become ints, an integer temperature a float, logprobs=True 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from numbers import Integral, Real

from graphkiln.errors import RequestError

INT64_END = 2**63  # seeds and counts go to the device as int64
MAX_LOGPROBS = 20  # the most likely tokens a token's logprobs can list: the decode graphs compute this many


def _int(name: str, value, low: int, high: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or not low <= value < high:
        raise RequestError(f"SamplingParams.{name}={value!r}; {hint}")
    return int(value)


def _real(name: str, value, ok: Callable[[float], bool], hint: str) -> float:
    try:
        number = None if isinstance(value, bool) or not isinstance(value, Real) else float(value)
    except (OverflowError, ValueError):  # an int or Fraction past float's range
        number = None
    if number is None or not ok(number):
        raise RequestError(f"SamplingParams.{name}={value!r}; {hint}")
    return number


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off; seed makes sampling reproducible.

    logprobs: None (or False) for none; N in [0, 20] for the sampled token's log-probability and the N
    most likely tokens' (True is 0), of the model's own distribution (before temperature and filters).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        checked = {
            "max_tokens": _int("max_tokens", self.max_tokens, 1, INT64_END, "give an int >= 1"),
            "temperature": _real("temperature", self.temperature, lambda t: 0 <= t < math.inf,
                                 "give a finite real number >= 0 (0 is greedy)"),
            "top_k": _int("top_k", self.top_k, 0, INT64_END, "give an int in [0, 2**63); 0 disables the filter"),
            "top_p": _real("top_p", self.top_p, lambda p: 0 < p <= 1,
                           "give a real number in (0, 1]; 1 disables the filter"),
            "seed": None if self.seed is None else _int("seed", self.seed, 0, INT64_END,
                                                        "give an int in [0, 2**63), or None"),
            "stop_token_ids": _token_ids(self.stop_token_ids),
            "logprobs": _logprobs(self.logprobs),
        }  # fmt: skip
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"SamplingParams.ignore_eos={self.ignore_eos!r}; give True or False")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _token_ids(ids) -> tuple[int, ...] | None:
    hint = "give a list of token ids (ints), or None"
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise RequestError(f"SamplingParams.stop_token_ids={ids!r}; {hint}")
    ids = tuple(ids)
    if any(isinstance(t, bool) or not isinstance(t, Integral) for t in ids):
        raise RequestError(f"SamplingParams.stop_token_ids={ids!r}; {hint}")
    return tuple(int(t) for t in ids)



def _logprobs(n) -> int | None:
    if n is None or n is False:
        return None
    if n is True:
        return 0
    hint = f"give None, or N in [0, {MAX_LOGPROBS}] most likely tokens to list"
    return _int("logprobs", n, 0, MAX_LOGPROBS + 1, hint)
