"""The request bodies of `/v1/completions` and `/v1/chat/completions`, and the errors the server answers with.

Fields follow the OpenAI API, plus the extra fields vLLM users pass in the body (`top_k`, `ignore_eos`,
`stop_token_ids`, `return_token_ids`). Bodies are parsed strictly (no "1" for 1) and an unknown field is
refused, as is a known one graphkiln cannot honour (penalties, logit_bias, best_of > n, echo, suffix)
unless it holds its neutral value: nothing a client asks for is silently dropped.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from graphkiln.chat import template_messages
from graphkiln.errors import RequestError
from graphkiln.runtime.sampling_params import INT64_END, MAX_LOGPROBS, SamplingParams

MAX_N = 128
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 500: "server_error", 503: "server_overloaded"}  # fmt: skip


class APIError(Exception):
    """An error answer: HTTP status and an OpenAI-style body naming the field at fault (`param`)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """What both endpoints take: the model, sampling, stopping, streaming."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None  # None: 1, as in the OpenAI API
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=INT64_END)] | None = None  # -1 and 0: off
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    seed: Annotated[int, Field(ge=0, lt=INT64_END)] | None = None
    stop: Any = Field(None, validate_default=True)  # a list of strings once validated
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> list[str]:
        stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("give a non-empty string or a list of them (stop token ids go in stop_token_ids)")
        return stops

    @property
    def choices(self) -> int:
        return self.n or 1

    def check_supported(self) -> None:
        """Refuse what graphkiln does not implement unless it asks for nothing (a neutral value)."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name}={getattr(self, name)!r}: graphkiln serve has no penalties; leave it 0",
                               param=name)  # fmt: skip
        if self.logit_bias:
            raise APIError(400, "logit_bias: graphkiln serve has no logit bias; leave it out", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options applies to streamed responses only; set stream to true or leave it "
                                "out", param="stream_options")  # fmt: skip

    def sampling(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """The engine's SamplingParams of choice `choice`: a seed gives choice i the seed + i, so choices differ
        and each one is what `LLM.generate` gives with that seed."""
        seed = None if self.seed is None else self.seed + choice
        if seed is not None and seed >= INT64_END:
            raise APIError(400, f"seed={self.seed} with n={self.choices}: choice i samples with seed + i, so "
                                "seed + n - 1 must stay below 2**63; lower seed or n", param="seed")  # fmt: skip
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_k=max(self.top_k or 0, 0), top_p=1.0 if self.top_p is None else self.top_p, seed=seed,
                stop_token_ids=self.stop_token_ids or None, ignore_eos=self.ignore_eos, logprobs=logprobs,
            )  # fmt: skip
        except RequestError as e:
            raise APIError(400, str(e), param=field_of(e)) from e


class CompletionRequest(GenerationRequest):
    prompt: Any
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: Any) -> list[str | list[int]]:
        """A list of prompts, each a string or token ids."""
        hint = "give a string, a list of token ids, or a list of those (several prompts)"
        if isinstance(prompt, str) or _token_ids(prompt):
            return [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(hint)
        if not all(isinstance(p, str) or _token_ids(p) for p in prompt):
            raise ValueError(hint)
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo=true: graphkiln serve does not echo prompts; leave it false", param="echo")
        if self.suffix:
            raise APIError(400, "suffix: graphkiln serve does not insert text; leave it out", param="suffix")
        if self.best_of is not None and self.best_of != self.choices:
            raise APIError(400, f"best_of={self.best_of}: graphkiln serve returns every choice; give best_of = n or "
                                "leave it out", param="best_of")  # fmt: skip


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[Any], Field(min_length=1)]  # checked by conversation(), as LLM.chat checks them
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them, or a 400 naming the message and field at fault."""
        try:
            return template_messages(self.messages)
        except RequestError as e:
            raise APIError(400, str(e), param="messages") from e

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def field_of(error: Exception, default: str | None = None) -> str | None:
    """The SamplingParams field a RequestError names (its messages start `SamplingParams.<field>`), else `default`."""
    match = re.match(r"SamplingParams\.(\w+)", str(error))
    return match.group(1) if match else default


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request `body` as `model`, or a 400 naming the field at fault (malformed JSON named as such)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON ({error['msg']})") from None
        if not error["loc"]:
            raise APIError(400, f"the body must be a JSON object ({error['msg']})") from None
        field = str(error["loc"][0])
        where = ".".join(str(x) for x in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        union = [x for x in e.errors() if x["loc"][:1] == error["loc"][:1]][1:]
        if union:  # one error per form the field may take: name the field and the value
            where = ".".join(str(x) for x in os.path.commonprefix([x["loc"] for x in [error, *union]]))
            message = "not a value this field takes; see the OpenAI API reference"
        if error["type"] == "extra_forbidden":
            holder = ".".join(str(x) for x in error["loc"][:-1]) or "graphkiln serve"
            message = f"unknown field; {holder} takes {', '.join(sorted(_model_at(model, error['loc']).model_fields))}"
        elif error["type"] != "missing":
            message = f"{message} (got {error['input']!r:.80})"
        raise APIError(400, f"{where}: {message}", param=field) from None


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The model (`model` or one nested in it, such as StreamOptions) that holds the field at `loc`."""
    for key in loc[:-1]:
        if isinstance(key, str):  # (an int indexes a list of the same model)
            model = _model_in(model.model_fields[key].annotation)
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field's annotation names (StreamOptions | None: StreamOptions), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_model_in, get_args(annotation))), None)
