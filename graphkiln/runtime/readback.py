"""A launched step's sampled rows on their way to the host, and what the engine makes of them.

The engine reads each step back one step later (engine.py): the sampled ids, and the log-probabilities
and most likely tokens where a request asks, are copied into pinned host buffers without waiting,
and read once the copy's event has fired.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .sampler import Sampled

if TYPE_CHECKING:
    from .scheduler import Sequence


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the `top` N most likely tokens' (token id, logprob), most
    likely first, under the model's own distribution (before temperature and filters)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class TokenEvent:
    """One new token of one request, as a step produced it."""

    request_id: int
    token_id: int
    logprobs: TokenLogprobs | None
    finish_reason: str | None


@dataclass
class LaunchedStep:
    """A step on the device: which token of which sequence each sampled row fills."""

    rows: list[tuple[Sequence, int]]
    ids: torch.Tensor  # device [rows]
    host: Sampled  # the host copy of what the rows need, once `ready` (pinned on CUDA)
    ready: torch.cuda.Event | None

    def live(self) -> bool:
        return any(seq.finish_reason is None for seq, _ in self.rows)

    def results(self) -> tuple[list | None, ...]:
        """The host copy as lists (Sampled's fields), once the device has written it."""
        if self.ready is not None:
            self.ready.synchronize()
        return tuple(None if t is None else t.tolist() for t in self.host)


class ReadBack:
    """Two sets of pinned host buffers, alternating, for the asynchronous copy of each step's sampled rows."""

    def __init__(self, rows: int, top: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        pin = {"pin_memory": True} if self.cuda else {}
        shapes = ((rows,), (rows,), (rows, top), (rows, top))
        dtypes = (torch.int64, torch.float32, torch.int64, torch.float32)
        self.buffers = [Sampled(*(torch.empty(s, dtype=d, **pin) for s, d in zip(shapes, dtypes))) for _ in range(2)]
        self.turn = 0

    def start(self, out: Sampled, logprobs: int | None) -> tuple[Sampled, torch.cuda.Event | None]:
        """Queue the copy of the ids, of their log-probabilities if a row asks (`logprobs` not None), and of
        the most likely tokens if a row lists any (`logprobs` > 0)."""
        self.turn ^= 1
        n = out.ids.shape[0]
        wanted = (True, logprobs is not None, bool(logprobs), bool(logprobs))
        host = Sampled(*(buffer[:n].copy_(t, non_blocking=self.cuda) if want else None
                         for buffer, t, want in zip(self.buffers[self.turn], out, wanted)))  # fmt: skip
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        return host, ready


def token_logprobs(results: tuple[list, ...], row: int, n: int) -> TokenLogprobs:
    """Row `row`'s token with its logprob and the `n` most likely tokens, from LaunchedStep.results()."""
    ids, logprobs, top_ids, top_logprobs = results
    return TokenLogprobs(ids[row], logprobs[row], tuple(zip(top_ids[row][:n], top_logprobs[row][:n])) if n else ())
