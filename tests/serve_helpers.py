"""HTTP servers for the serve tests: `graphkiln serve` in a subprocess (the command as users run it) or the
app in a thread of this process (to reach into its engine), both on a free loopback port. Every wait is
bounded; a server that does not come up fails the test with its log."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import openai

from artifact_helpers import graphkiln_cmd, subprocess_env

START_TIMEOUT_S = 240  # a first start with --compile compiles the tiny model (about 15 s here)
STOP_TIMEOUT_S = 30
IDLE_TIMEOUT_S = 20
READY = re.compile(r"graphkiln serve: .* on (http://127\.0\.0\.1:\d+)/v1")


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    api_key: str | None = None
    log: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None  # the server's, when `serve_process` started one

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=60,
                             **options)  # fmt: skip

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=60)

    def http(self, **options) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, **{"timeout": 60, **options})

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its name and labels, as the text shows them: `name{label="v"}`."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                       if line and not line.startswith("#"))}  # fmt: skip

    def wait_idle(self) -> dict[str, float]:
        """Poll /metrics until no request is admitted and no KV block held (what aborts must reach)."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            metrics = self.metrics()
            idle = metrics["graphkiln_requests_admitted"] == 0 and metrics["graphkiln_kv_cache_used_blocks"] == 0
            if idle or time.monotonic() > deadline:
                assert idle, {k: v for k, v in metrics.items() if "request" in k or "kv_cache" in k}
                return metrics
            time.sleep(0.05)


@contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None, api_key: str | None = None) -> Iterator[Server]:
    """`graphkiln serve ARGS --port 0` until the block ends (SIGINT, then a kill if it lingers)."""
    proc = subprocess.Popen(graphkiln_cmd("serve", *args, "--port", "0"), env={**subprocess_env(), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    server, ready = Server("", api_key, process=proc), threading.Event()

    def read() -> None:  # keeps the pipe drained for the server's whole life
        for line in proc.stderr:
            server.log.append(line)
            if match := READY.search(line):
                server.url = match.group(1)
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.2):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(server.log[-40:])
        while not _healthy(server.url):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(server.log[-40:])
            time.sleep(0.1)
        yield server
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        reader.join(STOP_TIMEOUT_S)


@contextmanager
def serve_in_thread(llm, config) -> Iterator[Server]:
    """The app of `llm` on uvicorn in a thread of this process; the caller keeps (and closes) `llm`."""
    import uvicorn

    from graphkiln.serve.app import create_app
    from graphkiln.serve.server import bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(llm, config), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.02)
        yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", config.api_key)
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
