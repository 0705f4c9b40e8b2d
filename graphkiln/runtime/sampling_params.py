"""SamplingParams: what one request asks of the sampler and the stop rules (public as graphkiln.SamplingParams)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphkiln.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off; seed makes sampling reproducible."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"SamplingParams.max_tokens={self.max_tokens}; it must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"SamplingParams.temperature={self.temperature}; it must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"SamplingParams.top_k={self.top_k}; use 0 to disable, or a positive count")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"SamplingParams.top_p={self.top_p}; it must be in (0, 1]")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
