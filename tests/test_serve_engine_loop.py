"""The server's engine thread and queue bound, with the app in this process so a test can fault its engine:
a full queue answers 503 with Retry-After; a request that fails in an engine step gets an error, alone; an
engine step that raises for another reason fails the requests then running and the server serves on; /health
says whether the engine's background preparation is done."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

import graphkiln
from graphkiln import LLM, SamplingParams
from graphkiln.runtime.preparation import Preparation
from graphkiln.runtime.step_lock import StepLock
from serve_helpers import Server, serve_in_thread

pytestmark = pytest.mark.slow
MARK = 4000  # a prompt ending in this token id fails in every step that runs it
PROMPT = "If the file"
GREEDY = SamplingParams(max_tokens=8)
LONG = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def llm(artifact: Path) -> Iterator[LLM]:
    with graphkiln.load(artifact, kv_cache_tokens=4096, max_num_seqs=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(llm: LLM) -> graphkiln.RequestOutput:
    """What a plain greedy request gets (before the server owns the engine)."""
    return llm.generate(PROMPT, GREEDY)[0]


@pytest.fixture(scope="module")
def server(llm: LLM, expected: graphkiln.RequestOutput) -> Iterator[Server]:
    from graphkiln.serve.app import ServerConfig

    with serve_in_thread(llm, ServerConfig("tiny", max_queued_requests=1)) as running:
        yield running


def test_a_full_queue_answers_503_with_retry_after(server: Server, expected: graphkiln.RequestOutput) -> None:
    """max_num_seqs 2 + 1 queued: a fourth request is refused while three run, and served once they are gone."""
    with server.http() as http:
        streams = []
        for _ in range(3):
            stream = http.stream("POST", "/v1/completions", json=LONG)
            lines = stream.__enter__().iter_lines()
            streams.append((stream, lines))
        refused = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert "limit of 3 requests" in refused.json()["error"]["message"]
        for stream, _ in streams:
            stream.__exit__(None, None, None)
    metrics = server.wait_idle()
    assert metrics["graphkiln_requests_rejected_total"] == 1
    got = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == expected.text


def test_a_request_failing_in_a_step_fails_alone(server: Server, llm: LLM, expected: graphkiln.RequestOutput,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The engine runs a failed step's requests alone to find the one at fault: its client gets an error
    (500 whole, an error event in a stream), the request beside it gets its tokens."""
    sample = llm.engine.runner.sample

    def faulty(chunks, *args):
        if any(c.seq.prompt_ids[-1] == MARK for c in chunks):
            raise RuntimeError("injected device fault")
        return sample(chunks, *args)

    monkeypatch.setattr(llm.engine.runner, "sample", faulty)
    client = server.client()
    results: dict[str, object] = {}

    def good() -> None:
        results["good"] = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)

    def bad_stream() -> None:
        with pytest.raises(openai.APIError, match="injected device fault"):
            for _ in client.completions.create(model="tiny", prompt=[5, MARK], max_tokens=8, stream=True):
                pass
        results["bad_stream"] = True

    threads = [threading.Thread(target=f) for f in (good, bad_stream)]
    for t in threads:
        t.start()
    whole = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, MARK], "max_tokens": 8}, timeout=60)
    for t in threads:
        t.join(60)
    error = whole.json()["error"]
    assert whole.status_code == 500 and error["code"] == "engine_error" and "injected device fault" in error["message"]
    assert results["bad_stream"] and results["good"].choices[0].text == expected.text
    metrics = server.wait_idle()
    assert metrics['graphkiln_requests_total{finish_reason="error"}'] == 2


def test_an_engine_fault_outside_any_request_fails_the_running_ones_and_serving_goes_on(
    server: Server, llm: LLM, expected: graphkiln.RequestOutput, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedule, calls = llm.engine.scheduler.schedule, iter(range(10**6))

    def broken_once():
        if next(calls) == 1:  # the running request's second step
            raise RuntimeError("scheduler broke")
        return schedule()

    monkeypatch.setattr(llm.engine.scheduler, "schedule", broken_once)
    failed = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, timeout=60)
    assert failed.status_code == 500 and "scheduler broke" in failed.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    got = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == expected.text
    server.wait_idle()


def test_health_says_whether_the_background_preparation_is_done(server: Server, llm: LLM, monkeypatch) -> None:
    """`ready` follows the engine's preparation: false while a job of it runs, true once all are done; the
    status is ok throughout (requests are served meanwhile)."""
    release = threading.Event()

    class Held:
        kind, key = "held", "until released"

        def unlocked(self) -> None:
            release.wait(60)

        def run(self) -> None:
            """Nothing under the step lock."""

        def withdraw(self) -> None:
            """Nothing to undo."""

    def health() -> dict:
        return httpx.get(server.url + "/health", timeout=10).json()

    llm.wait_ready()
    assert health() == {"status": "ok", "ready": True}
    held = Preparation([Held()], StepLock(), torch.device("cpu"))
    monkeypatch.setattr(llm.engine, "preparation", held)
    held.start()
    try:
        assert health() == {"status": "ok", "ready": False}
    finally:
        release.set()
    assert held.wait(60)
    assert health() == {"status": "ok", "ready": True}
