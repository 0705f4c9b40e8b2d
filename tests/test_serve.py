"""`graphkiln serve` on the tiny artifact, through the `openai` client and raw HTTP: completions and chat, whole
and streamed, equal to `LLM.generate` / `LLM.chat` with the same seeds; 64 concurrent streams; disconnects
that free their KV blocks; bad input answered with OpenAI-style errors; the API key.

One server (the session's `server` fixture, a `graphkiln serve` subprocess) answers every test here.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

import graphkiln
from graphkiln import LLM, SamplingParams
from serve_helpers import Server

pytestmark = pytest.mark.slow
PROMPTS: list = ["If the file", "This module provides", list(range(5, 30))]
CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": [{"type": "text", "text": "What does "}, {"type": "text", "text": "open() return?"}]},
]
PLAIN_CONVERSATION = [CONVERSATION[0], {"role": "user", "content": "What does open() return?"}]


@pytest.fixture(scope="module")
def offline(artifact: Path) -> LLM:
    """The same artifact and engine options as the server, in this process: what the server must equal."""
    return graphkiln.load(artifact, kv_cache_tokens=8192, capture="blocking")


@dataclass
class Choice:
    """One choice as a client reads it, whole or put together from its chunks."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[float] = field(default_factory=list)

    def add(self, choice, chat: bool) -> None:
        extra = choice.model_extra or {}
        self.text += (choice.delta.content if chat else choice.text) or ""
        self.token_ids += extra.get("token_ids") or []
        self.finish_reason = choice.finish_reason or self.finish_reason
        self.stop_reason = extra.get("stop_reason", self.stop_reason)
        if choice.logprobs is not None:
            self.logprobs += [e.logprob for e in choice.logprobs.content] if chat else choice.logprobs.token_logprobs


def whole(response, chat: bool) -> tuple[list[Choice], object]:
    choices = []
    for c in response.choices:
        extra = c.model_extra
        logprobs = [] if c.logprobs is None else (
            [e.logprob for e in c.logprobs.content] if chat else c.logprobs.token_logprobs)  # fmt: skip
        text = c.message.content if chat else c.text
        choices.append(Choice(text, extra.get("token_ids") or [], c.finish_reason, extra["stop_reason"], logprobs))
    return choices, response.usage


def gathered(chunks, chat: bool) -> tuple[list[Choice], object]:
    choices, usage = defaultdict(Choice), None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            choices[c.index].add(c, chat)
    return [choices[i] for i in sorted(choices)], usage


def create(server: Server, chat: bool, stream: bool, **request) -> tuple[list[Choice], object]:
    api = server.client().chat.completions if chat else server.client().completions
    response = api.create(model="tiny", stream=stream, **request)
    return gathered(response, chat) if stream else whole(response, chat)


def assert_equal(got: Choice, want: graphkiln.RequestOutput) -> None:
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    if want.logprobs is not None:
        assert got.logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_generate(server: Server, offline: LLM, stream: bool) -> None:
    """Three prompts (text and token ids), two choices each: choice i samples with seed + i."""
    sampling = dict(max_tokens=12, temperature=0.8, top_p=0.9, logprobs=3)
    choices, usage = create(server, False, stream, prompt=PROMPTS, n=2, seed=7, **sampling,
                            extra_body={"top_k": 40, "return_token_ids": True})  # fmt: skip
    params = [SamplingParams(**sampling, top_k=40, seed=7 + c) for _ in PROMPTS for c in range(2)]
    want = offline.generate([p for p in PROMPTS for _ in range(2)], params)
    assert len(choices) == len(want) == 6
    for got, expected in zip(choices, want):
        assert_equal(got, expected)
    prompt_tokens = sum(len(offline.encode(p)) for p in PROMPTS)
    completion_tokens = sum(len(o.token_ids) for o in want)
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert usage.total_tokens == prompt_tokens + completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_llm_chat(server: Server, offline: LLM, stream: bool) -> None:
    """The model's chat template (text parts joined), greedy, with logprobs."""
    choices, usage = create(server, True, stream, messages=CONVERSATION, max_tokens=16, temperature=0, logprobs=True,
                            top_logprobs=2, extra_body={"return_token_ids": True})  # fmt: skip
    want = offline.chat(CONVERSATION, SamplingParams(max_tokens=16, logprobs=2))[0]
    assert want.prompt_token_ids == offline.chat(PLAIN_CONVERSATION, SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert len(choices) == 1 and want.text
    assert_equal(choices[0], want)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))


def test_chat_defaults_to_the_context_left(server: Server, offline: LLM) -> None:
    """No max_tokens: the reply may take what the context leaves; it ends on the end-of-sequence token here."""
    [got], _ = create(server, True, False, messages=PLAIN_CONVERSATION, temperature=0)
    want = offline.chat(PLAIN_CONVERSATION, SamplingParams(max_tokens=offline.max_context - 64))[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason) == (want.text, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_strings_and_stop_token_ids(server: Server, offline: LLM, stream: bool) -> None:
    """A stop string ends the text before it (never sent in part, even split over tokens); its tokens up to
    the match stay in token_ids. A stop token id ends with that token."""
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    base = offline.generate("If the file", greedy)[0]
    stop = base.text[12:17]  # inside the text, across a token boundary
    assert not any(stop in offline.decode([token]) for token in base.token_ids)
    cut = base.text.index(stop)
    through = next(k for k in range(1, len(base.token_ids) + 1) if stop in offline.decode(base.token_ids[:k]))
    [got], _ = create(server, False, stream, prompt="If the file", max_tokens=24, temperature=0, stop=[stop, "@@"],
                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert (got.text, got.finish_reason, got.stop_reason) == (base.text[:cut], "stop", stop)
    assert got.token_ids == base.token_ids[:through]

    stop_id = base.token_ids[6]
    want = offline.generate("If the file", SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    [got], _ = create(server, False, stream, prompt="If the file", max_tokens=24, temperature=0,
                      extra_body={"ignore_eos": True, "return_token_ids": True, "stop_token_ids": [stop_id]})
    assert_equal(got, want)
    assert (got.finish_reason, got.stop_reason, got.token_ids[-1]) == ("stop", stop_id, stop_id)


def test_64_concurrent_streams_each_equal_its_offline_counterpart(server: Server, offline: LLM) -> None:
    """Completions and chats of mixed lengths and parameters, all streaming at once: every stream complete,
    equal to its request run offline, nothing lost or duplicated; the server idle after."""
    rng = random.Random(0)
    words = "the file module returns a value object list string of each".split()
    requests = []
    for i in range(64):
        chat = i % 4 == 0
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 40)))
        sampling = dict(max_tokens=rng.randrange(1, 48), temperature=rng.choice([0.0, 0.7, 1.0]), seed=i,
                        top_p=rng.choice([1.0, 0.9]))  # fmt: skip
        requests.append((chat, text, sampling, rng.choice([0, 20])))

    async def one(client: openai.AsyncOpenAI, chat: bool, text: str, sampling: dict, top_k: int) -> Choice:
        extra = {"top_k": top_k, "return_token_ids": True}
        api = client.chat.completions if chat else client.completions
        prompt = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
        chunks = [c async for c in await api.create(model="tiny", stream=True, extra_body=extra, **prompt, **sampling)]
        [choice], usage = gathered(chunks, chat)
        assert usage.completion_tokens == len(choice.token_ids)
        return choice

    async def all_at_once() -> list[Choice]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, *r) for r in requests))

    got = asyncio.run(all_at_once())
    for (chat, text, sampling, top_k), choice in zip(requests, got):
        params = SamplingParams(**sampling, top_k=top_k)
        [want] = offline.chat([{"role": "user", "content": text}], params) if chat else offline.generate(text, params)
        assert_equal(choice, want)
    server.wait_idle()


def test_disconnects_abort_their_requests_and_free_their_blocks(server: Server) -> None:
    """Streams closed after two chunks, and a plain request whose client stops waiting: each is aborted, and
    the KV blocks gauge returns to zero."""
    long = {"model": "tiny", "prompt": "If the file", "max_tokens": 1500, "ignore_eos": True}
    before = server.wait_idle()
    with server.http() as http:
        streams = []
        for _ in range(4):
            stream = http.stream("POST", "/v1/completions", json={**long, "stream": True})
            lines = stream.__enter__().iter_lines()
            first = [next(line for line in lines if line.startswith("data: ")) for _ in range(2)]
            assert "data: [DONE]" not in first  # two chunks of a stream still running
            streams.append((stream, lines))
        during = server.metrics()
        assert during["graphkiln_requests_admitted"] == 4 and during["graphkiln_kv_cache_used_blocks"] > 0
        for stream, _ in streams:
            stream.__exit__(None, None, None)  # the connection closes mid-stream
    server.wait_idle()
    with pytest.raises(httpx.ReadTimeout), server.http(timeout=httpx.Timeout(10, read=0.5)) as impatient:
        impatient.post("/v1/completions", json=long)
    after = server.wait_idle()
    aborted = 'graphkiln_requests_total{finish_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 5


BIG_PROMPT = list(range(3, 2100))  # 2097 token ids, past the 2048-token context
BAD_INPUTS = [  # (route, body, status, field, words the message must hold)
    ("completions", b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("completions", b"[1, 2]", 400, None, "JSON object"),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "'gpt-4' does not exist"),
    ("completions", {"prompt": BIG_PROMPT, "max_tokens": 1}, 400, "prompt", "2097 tokens", "context of 2048"),
    ("completions", {"prompt": "x", "max_tokens": 2048}, 400, "prompt", "max_tokens=2048", "context of 2048"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 2100}]}, 400, "messages", "leave no room",
     "context of 2048"),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "1.5"),
    ("completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "-2"),
    ("completions", {"prompt": "x", "top_k": 2**70}, 400, "top_k", "less than 9223372036854775808"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("completions", {"prompt": "x", "max_tokens": "16"}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "21"),
    ("completions", {"prompt": "x", "seed": 2**63}, 400, "seed", "less than"),
    ("completions", {"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed", "seed + n - 1", "below 2**63"),
    ("completions", {"prompt": [5, 99999]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": [[5], []]}, 400, "prompt", "token ids"),
    ("completions", {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids", "outside the vocabulary"),
    ("completions", {"prompt": "x", "stop": ""}, 400, "stop", "non-empty"),
    ("completions", {"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty", "no penalties"),
    ("completions", {"prompt": "x", "echo": True}, 400, "echo", "echo"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                          "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("completions", {"prompt": "x", "bogus": 1}, 400, "bogus", "unknown field", "graphkiln serve takes best_of, echo"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"x": 1}}, 400, "stream_options",
     "stream_options.x: unknown field; stream_options takes include_usage"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "messages.0.role",
     "system, user, assistant, developer, tool"),
    ("chat/completions", {"messages": [{"role": "", "content": "hi"}]}, 400, "messages", "messages.0.role"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages", "messages.0.role: missing"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", "messages.0.content: missing"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, 400, "messages",
     "messages.0.tool_calls: unknown field", "role, content, name"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs",
     "logprobs=true"),
    ("completions", {"prompt": "x" * 70_000}, 413, None, "65536 bytes"),
]


def test_bad_input_gets_an_openai_error_naming_the_field(server: Server) -> None:
    """Each bad request answered with its status and an OpenAI-style error; none reached the engine or
    changed what the next request gets."""
    before = server.wait_idle()
    with server.http() as http:
        want = http.post("/v1/completions", json={"prompt": "If the file", "max_tokens": 6, "temperature": 0}).json()
        for route, body, status, param, *words in BAD_INPUTS:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = http.post(f"/v1/{route}", **kwargs)
            error = response.json()["error"]
            assert (response.status_code, error["param"]) == (status, param), (body, error)
            assert all(word in error["message"] for word in words), (words, error["message"])
            assert error["type"] and set(error) == {"message", "type", "param", "code"}
        chunked = http.post("/v1/completions", content=iter([b'{"prompt": "' + b"x" * 40_000] * 2))  # no length
        assert chunked.status_code == 413
        got = http.post("/v1/completions", json={"prompt": "If the file", "max_tokens": 6, "temperature": 0}).json()
    assert got["choices"] == want["choices"]
    after = server.wait_idle()
    assert after["graphkiln_prompt_tokens_total"] - before["graphkiln_prompt_tokens_total"] == 2 * 4  # the good two


def test_api_key_guards_every_route_but_health(server: Server) -> None:
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("GET", "/x")):
            response = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"}, timeout=10)
            assert response.status_code == 401, (key, path)
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    with pytest.raises(openai.AuthenticationError):
        Server(server.url, "wrong").client().models.list()


def test_models_routes_and_metrics(server: Server, offline: LLM) -> None:
    [model] = server.client().models.list().data
    assert (model.id, model.owned_by, model.model_extra["max_model_len"]) == ("tiny", "graphkiln", offline.max_context)
    with server.http() as http:
        missing = http.get("/v1/nothing")
        assert missing.status_code == 404 and "/v1/nothing" in missing.json()["error"]["message"]
        http.post("/v1/completions", json={"prompt": "If the file", "max_tokens": 4})
        text = http.get("/metrics").text
    metrics = server.wait_idle()
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "request_latency_seconds"):
        assert metrics[f"graphkiln_{name}_count"] >= 1
    assert metrics['graphkiln_steps_without_graph_total{kind="decode"}'] > 0  # no CUDA graphs on the CPU
    assert metrics["graphkiln_kv_cache_blocks"] > 0 and metrics["graphkiln_kv_cache_usage_ratio"] == 0
    for family in ("requests_running", "requests_waiting", "graph_replays", "generation_tokens"):
        assert f"# TYPE graphkiln_{family}" in text
    assert json.loads(httpx.get(server.url + "/health", timeout=10).text)["status"] == "ok"


def test_connections_to_the_listening_socket_send_small_chunks_at_once() -> None:
    """asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of an IPPROTO_TCP socket; with it
    on, each streamed chunk waited for the client's delayed ACK (40 ms to a first token)."""
    from graphkiln.serve.server import bind

    async def accepted_nodelay() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        with bind("127.0.0.1", 0) as sock:
            server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
            _, writer = await asyncio.open_connection(*sock.getsockname())
            result = await asyncio.wait_for(seen, 10)
            writer.close()
            server.close()
            return result

    assert asyncio.run(accepted_nodelay()) != 0
