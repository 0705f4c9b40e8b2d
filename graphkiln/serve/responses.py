"""The JSON the server answers with, in the OpenAI API's shapes: completions and chat completions, whole or as
server-sent-event chunks, each with `usage`. vLLM's extras: `stop_reason` (the stop string or stop token
id that ended a choice) and, with `return_token_ids`, `prompt_token_ids` and `token_ids` per choice.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from graphkiln.runtime.readback import TokenLogprobs

from .loop import Job
from .output import ChoiceOutput, Piece

TokenText = Callable[[int], str]


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(body: dict) -> str:
    return sse(body) + sse("[DONE]")


def prompt_tokens(jobs: list[Job]) -> int:
    """Each prompt's tokens once (the choices of a prompt share its token list)."""
    return sum({id(job.prompt_ids): len(job.prompt_ids) for job in jobs}.values())


def usage(jobs: list[Job], outputs: list[ChoiceOutput]) -> dict:
    """Prompt tokens once per prompt, completion tokens of every choice up to its end."""
    prompt, completion = prompt_tokens(jobs), sum(len(out.token_ids) for out in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Responder:
    """Builds one request's answer: `whole` for a plain response, `chunks` per batch of pieces for a stream."""

    def __init__(self, chat: bool, model: str, token_text: TokenText, return_token_ids: bool, logprobs: bool) -> None:
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                     "model": model, "system_fingerprint": None}  # fmt: skip
        self.token_text = token_text
        self.return_token_ids = return_token_ids
        self.logprobs = logprobs
        self.started: set[int] = set()  # choices a chunk was sent for

    def whole(self, jobs: list[Job], outputs: list[ChoiceOutput]) -> dict:
        choices = []
        for job, out in zip(jobs, outputs):
            choice = {"index": job.index, "logprobs": self._logprobs(out.logprobs, out.offsets),
                      "finish_reason": out.finish_reason, "stop_reason": _stop_reason(job, out)}  # fmt: skip
            if self.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            if self.return_token_ids:
                choice |= {"prompt_token_ids": job.prompt_ids, "token_ids": out.token_ids}
            choices.append(choice)
        return {**self.head, "object": self.object, "choices": choices, "usage": usage(jobs, outputs)}

    def chunks(
        self, jobs: list[Job], outputs: list[ChoiceOutput], pieces: list[tuple[int, Piece]], with_usage: bool
    ) -> list[dict]:
        """One chunk per piece worth sending; `with_usage` (the last batch): the last chunk carries `usage`."""
        chunks = []
        for index, piece in pieces:
            shows_tokens = piece.token_ids and (self.return_token_ids or self.logprobs)
            if not (piece.text or piece.finish_reason or shows_tokens):
                continue
            choice = {"index": index, "logprobs": self._logprobs(piece.logprobs, piece.offsets),
                      "finish_reason": piece.finish_reason}  # fmt: skip
            if piece.finish_reason:
                choice["stop_reason"] = _stop_reason(jobs[index], outputs[index])
            if self.chat:
                choice["delta"] = {"content": piece.text}
                if index not in self.started:
                    choice["delta"]["role"] = "assistant"
            else:
                choice["text"] = piece.text
            if self.return_token_ids:
                choice["token_ids"] = piece.token_ids
                if index not in self.started:
                    choice["prompt_token_ids"] = jobs[index].prompt_ids
            self.started.add(index)
            chunks.append({**self.head, "object": self.chunk_object, "choices": [choice]})
        if with_usage and chunks:
            chunks[-1]["usage"] = usage(jobs, outputs)
        return chunks

    def usage_chunk(self, jobs: list[Job], outputs: list[ChoiceOutput]) -> dict:
        """OpenAI's `stream_options.include_usage` chunk: no choices, the whole request's usage."""
        return {**self.head, "object": self.chunk_object, "choices": [], "usage": usage(jobs, outputs)}

    def _logprobs(self, logprobs: list[TokenLogprobs], offsets: list[int]) -> dict | None:
        if not self.logprobs:
            return None
        text = self.token_text
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                token_text = text(token)
                return {"token": token_text, "logprob": logprob, "bytes": list(token_text.encode())}

            content = [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(*top) for top in lp.top]}
                       for lp in logprobs]  # fmt: skip
            return {"content": content, "refusal": None}
        return {"tokens": [text(lp.token_id) for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{text(t): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}  # fmt: skip


def _stop_reason(job: Job, out: ChoiceOutput) -> str | int | None:
    """The stop string, or the stop token id, that ended the choice (None: an end-of-sequence token, a length)."""
    if out.finish_reason != "stop":
        return None
    if out.stop_reason is not None:
        return out.stop_reason
    last = out.token_ids[-1] if out.token_ids else None
    return last if job.params.stop_token_ids and last in job.params.stop_token_ids else None
