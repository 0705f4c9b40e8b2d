"""What a client receives of its jobs: each choice's text piece by piece, cut before its first stop string.

Text comes from an IncrementalDecoder per choice (never half a character). With stop strings, the last
(longest stop string - 1) characters are held back until more text shows they start no stop string, so
a stop string split over tokens is never sent in part; on a match the text ends before it, the choice
finishes with "stop" and its job is aborted (its tokens up to the match stay in `token_ids`, as in vLLM).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from graphkiln.models.tokenizer import IncrementalDecoder
from graphkiln.runtime.readback import TokenEvent, TokenLogprobs

from .loop import EngineLoop, Job, ServerStopping, Update


class GenerationFailed(Exception):
    """A job of the request failed (in an engine step, or the server stopping); `error` says why."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


@dataclass(frozen=True)
class Piece:
    """What one choice adds at once: text, the tokens and their logprobs, each token's offset in the text."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    offsets: list[int]
    finish_reason: str | None


class ChoiceOutput:
    """One choice's text, tokens and logprobs so far; `add` turns new events into the piece to send."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self.decoder = IncrementalDecoder(decode)
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of `text` already in a piece
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.offsets: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None  # the stop string matched

    def add(self, events: list[TokenEvent], finish_reason: str | None) -> Piece:
        first = len(self.token_ids)
        for event in events:
            if self.finish_reason is not None:
                break
            self.token_ids.append(event.token_id)
            self.offsets.append(len(self.text))
            if event.logprobs is not None:
                self.logprobs.append(event.logprobs)
            self._extend(self.decoder.push([event.token_id]) + (self.decoder.flush() if event.finish_reason else ""))
        if self.finish_reason is None:
            self.finish_reason = finish_reason
        end = len(self.text) if self.finish_reason else max(self.sent, len(self.text) - self.hold)
        text, self.sent = self.text[self.sent : end], end
        return Piece(text, self.token_ids[first:], self.logprobs[first:], self.offsets[first:], self.finish_reason)

    def _extend(self, text: str) -> None:
        start = max(0, len(self.text) - self.hold)  # a match must end in the new text
        self.text += text
        matches = [(i, stop) for stop in self.stops if (i := self.text.find(stop, start)) >= 0]
        if matches:
            at, self.stop_reason = min(matches)
            self.text = self.text[:at]
            self.finish_reason = "stop"


class Generation:
    """The jobs of one HTTP request (one per prompt and choice) and their outputs: updates in, pieces out."""

    def __init__(self, loop: EngineLoop, jobs: list[Job], decode: Callable[[list[int]], str], stops: list[str]):
        self.loop = loop
        self.jobs = jobs
        self.outputs = [ChoiceOutput(decode, stops) for _ in jobs]

    @property
    def done(self) -> bool:
        return all(out.finish_reason is not None for out in self.outputs)

    async def batches(self) -> AsyncIterator[list[tuple[int, Piece]]]:
        """Each time updates arrive: (choice index, piece) of every choice they move on, in arrival order.
        Updates that queued up meanwhile are taken together, so a loaded server sends fewer, larger pieces."""
        queue = self.jobs[0].updates
        while not self.done:
            updates = [await queue.get()]
            while not queue.empty():
                updates.append(queue.get_nowait())
            yield self._apply(updates)

    def _apply(self, updates: list[Update]) -> list[tuple[int, Piece]]:
        merged: dict[int, tuple[list[TokenEvent], str | None]] = {}
        for update in updates:
            index = update.job.index
            if self.outputs[index].finish_reason is not None:
                continue  # stopped on a stop string; the rest of its job is being aborted
            if update.finish_reason in ("error", "abort"):
                raise GenerationFailed(update.error or ServerStopping("the request was aborted"))
            events, _ = merged.get(index, ([], None))
            merged[index] = (events + update.events, update.finish_reason)
        pieces = []
        for index, (events, finish_reason) in merged.items():
            piece = self.outputs[index].add(events, finish_reason)
            if piece.finish_reason == "stop" and finish_reason is None:  # a stop string: the engine goes on
                self.jobs[index].finish_reason = "stop"
                self.loop.abort([self.jobs[index]])
            pieces.append((index, piece))
        return pieces

    def close(self) -> None:
        """Abort what is still running (a client gone, an error in another choice); a no-op once all finished."""
        self.loop.abort([job for job in self.jobs if job.finished is None])
