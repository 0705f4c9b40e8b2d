"""The FastAPI app of `graphkiln serve`: OpenAI's routes on one LLM, its engine owned by an EngineLoop.

A request is checked whole before anything is queued (API key, body size, JSON, fields, model name,
prompt length against the context, what the engine would refuse), so a bad one costs nothing and no
request affects another. Past the queue bound (requests admitted and unfinished > max_num_seqs +
max_queued_requests) the answer is 503 with Retry-After. A client that goes away (a stream closed, a
plain request's connection dropped) aborts its requests: the engine thread frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from graphkiln.errors import ConfigError, GraphkilnError
from graphkiln.llm import LLM

from .loop import EngineLoop, Job, ServerStopping
from .metrics import Metrics
from .output import Generation, GenerationFailed
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, GenerationRequest, field_of, parse
from .responses import Responder, error_event, prompt_tokens, sse

log = logging.getLogger("graphkiln.serve")
DEFAULT_MAX_TOKENS = 16  # completions, as in the OpenAI API; chat defaults to what the context leaves


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP side decides: the model's name, the API key, the queue bound, the body size limit."""

    model_name: str
    api_key: str | None = None
    max_queued_requests: int = 256
    max_body_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("ServerConfig.model_name is empty; name the model clients ask for")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("ServerConfig.api_key is empty; give a key, or None for no key")
        for name, low in (("max_queued_requests", 0), ("max_body_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"ServerConfig.{name}={value!r}; give an int >= {low}")


def create_app(llm: LLM, config: ServerConfig,
               on_engine_stopped: Callable[[BaseException], None] = lambda error: None) -> FastAPI:  # fmt: skip
    """The app; its lifespan starts the engine thread and stops it (the caller closes `llm` after).
    `on_engine_stopped` hears the error that ended the engine thread, after which nothing is served."""
    service = Service(llm, config, on_engine_stopped)
    app = FastAPI(title="graphkiln", lifespan=service.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.get("/health")(service.health)
    app.get("/v1/models")(service.models)
    app.get("/metrics")(service.metrics_text)
    app.post("/v1/completions")(service.completions)
    app.post("/v1/chat/completions")(service.chat)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    if config.api_key is not None:
        app.add_middleware(RequireApiKey, key=config.api_key)
    return app


class Service:
    """The routes' state: the LLM, its EngineLoop, the metrics."""

    def __init__(self, llm: LLM, config: ServerConfig, on_engine_stopped: Callable[[BaseException], None]) -> None:
        self.llm = llm
        self.config = config
        self.loop = EngineLoop(llm.engine, on_engine_stopped=on_engine_stopped)
        self.metrics = Metrics(lambda: self.loop.snapshot, lambda: self.loop.unfinished)
        self.loop.on_finish = self.metrics.job_finished
        self.limit = llm.engine.config.max_num_seqs + config.max_queued_requests
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        # Chat templates run off the asyncio loop (the first loads transformers), one at a time: a Hugging Face
        # tokenizer is not safe to call from several threads at once.
        self._templates = ThreadPoolExecutor(1, thread_name_prefix="graphkiln-chat-template")

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(self.loop.stop)
            self._templates.shutdown(wait=False, cancel_futures=True)

    async def health(self) -> JSONResponse:
        """200 while the engine thread runs. `ready`: the graphs (or warm-ups) a load prepares in the background
        are all in; requests are served before that, some steps without their graph."""
        ok = self.loop.alive
        body = {"status": "ok" if ok else "engine stopped", "ready": ok and self.llm.engine.preparation.ready}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(self) -> dict:
        card = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "graphkiln",
                "max_model_len": self.llm.max_context}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await _body(request, self.config.max_body_bytes))
        self._check(req)
        try:
            prompts = [self.llm.encode(p) for p in req.prompt]
        except GraphkilnError as e:
            raise APIError(400, str(e), param="prompt") from e
        jobs = self._jobs(prompts, req, req.max_tokens or DEFAULT_MAX_TOKENS, req.logprobs, "prompt")
        return await self._respond(request, req, jobs, Responder(False, self.config.model_name, self.token_text,
                                                                 req.return_token_ids, req.logprobs is not None))

    async def chat(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await _body(request, self.config.max_body_bytes))
        conversation = req.conversation()
        self._check(req)
        logprobs = req.num_logprobs
        tokenizer = self.llm.tokenizer
        try:
            template = tokenizer and tokenizer.chat_template_ids
            ids = template and await asyncio.get_running_loop().run_in_executor(self._templates, template, conversation)
        except Exception as e:  # the template refused the conversation (its own checks: the order of roles, ...)
            raise APIError(400, f"messages: the chat template refused them ({type(e).__name__}: {e})",
                           param="messages") from e  # fmt: skip
        if not ids:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        max_tokens = req.max_new_tokens or self.llm.max_context - len(ids)
        jobs = self._jobs([ids], req, max_tokens, logprobs, "messages")
        return await self._respond(request, req, jobs, Responder(True, self.config.model_name, self.token_text,
                                                                 req.return_token_ids, logprobs is not None))

    def token_text(self, token: int) -> str:
        """A token's own text for logprobs (special tokens shown), or `token_id:N` without a tokenizer."""
        if token not in self._token_texts:
            tokenizer = self.llm.tokenizer
            self._token_texts[token] = tokenizer.decode([token], False) if tokenizer else f"token_id:{token}"
        return self._token_texts[token]

    def _check(self, req: GenerationRequest) -> None:
        if req.model is not None and req.model != self.config.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.config.model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")  # fmt: skip
        req.check_supported()
        if req.stop and self.llm.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer and this model has none; use stop_token_ids",
                           param="stop")  # fmt: skip

    def _jobs(self, prompts: list[list[int]], req: GenerationRequest, max_tokens: int, logprobs: int | None,
              what: str) -> list[Job]:  # fmt: skip
        """One job per prompt and choice, each checked as the engine would check it."""
        context = self.llm.max_context
        updates: asyncio.Queue = asyncio.Queue()
        jobs = []
        for ids in prompts:
            if max_tokens < 1:
                raise APIError(400, f"{what}: {len(ids)} tokens leave no room in the model's context of {context} "
                                    "tokens; shorten them", param=what)  # fmt: skip
            if len(ids) + max_tokens > context:
                raise APIError(400, f"{what}: {len(ids)} tokens plus max_tokens={max_tokens} exceed the model's "
                                    f"context of {context} tokens; shorten them or lower max_tokens", param=what)
            choices = [req.sampling(max_tokens, logprobs, choice) for choice in range(req.choices)]
            try:
                self.llm.engine.check_request(ids, choices[0])  # the choices differ only in their seeds
            except GraphkilnError as e:
                raise APIError(400, str(e), param=field_of(e, what)) from e
            jobs += [Job(len(jobs) + i, ids, params, updates) for i, params in enumerate(choices)]
        if len(jobs) > self.limit:
            raise APIError(400, f"{len(jobs)} prompts x choices exceed the {self.limit} requests this server admits "
                                "at once; send fewer", param="n")  # fmt: skip
        return jobs

    async def _respond(self, request: Request, req: GenerationRequest, jobs: list[Job], responder: Responder
                       ) -> Response:  # fmt: skip
        if self.loop.unfinished + len(jobs) > self.limit:
            self.metrics.rejected.inc()
            raise APIError(503, f"the server is at its limit of {self.limit} requests in progress; retry later",
                           code="queue_full", headers={"Retry-After": "1"})  # fmt: skip
        generation = Generation(self.loop, jobs, self.llm.decode, req.stop)
        try:
            self.loop.submit(jobs)
        except ServerStopping as e:
            raise APIError(503, str(e), code="server_stopping") from e
        self.metrics.prompt_tokens.inc(prompt_tokens(jobs))
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return EventStream(_events(generation, responder, include_usage), on_close=generation.close)
        return await _whole(request, generation, responder)


async def _events(generation: Generation, responder: Responder, include_usage: bool) -> AsyncIterator[str]:
    """The stream's events: a chunk per piece (usage on the last one, or in a chunk of its own when the
    client asked with stream_options.include_usage, as OpenAI sends it), then [DONE]."""
    jobs, outputs = generation.jobs, generation.outputs
    try:
        async for pieces in generation.batches():
            last = generation.done and not include_usage
            yield "".join(sse(chunk) for chunk in responder.chunks(jobs, outputs, pieces, last))
    except GenerationFailed as e:
        yield error_event(_failure(e).body())
        return
    if include_usage:
        yield sse(responder.usage_chunk(jobs, outputs))
    yield sse("[DONE]")


async def _whole(request: Request, generation: Generation, responder: Responder) -> Response:
    """Wait for every choice, or for the client to go away (then abort them)."""

    async def finish() -> None:
        async for _ in generation.batches():
            pass

    work, gone = asyncio.ensure_future(finish()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return Response(status_code=499)  # no one is left to read it
        work.result()
    except GenerationFailed as e:
        raise _failure(e) from e
    finally:
        work.cancel()
        gone.cancel()
        generation.close()
    return JSONResponse(responder.whole(generation.jobs, generation.outputs))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _failure(e: GenerationFailed) -> APIError:
    if isinstance(e.error, ServerStopping):
        return APIError(503, str(e.error), code="server_stopping")
    return APIError(500, f"the request failed in an engine step ({e}); the server serves on", code="engine_error")


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    too_large = APIError(413, f"the body exceeds this server's limit of {limit} bytes; send less (or start the "
                              "server with a larger --max-body-bytes)")  # fmt: skip
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (finished, client gone, cancelled)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class RequireApiKey:
    """Every route but /health needs `Authorization: Bearer KEY` (compared in constant time); 401 otherwise."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key; send the header Authorization: Bearer KEY",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                await _api_error(None, error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _api_error(request: Request | None, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    return _api_error(request, APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}"))


def _internal_error(request: Request, error: Exception) -> JSONResponse:
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return _api_error(request, APIError(500, f"internal error ({type(error).__name__}); see the server's log"))
