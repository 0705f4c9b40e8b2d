"""`graphkiln serve` over HTTP against the offline engine on the same requests (a few minutes on an H200, 1B).

    python -m bench serve --out $OUT [--model 8b]
    python -m bench serve --smoke --out /tmp/bench-smoke        # CPU, tiny shapes, about a minute

The study's random-weight model is compiled once and served by `graphkiln serve` in a child process on a
free loopback port. Client processes drive it with asyncio and httpx: at each concurrency C (1, 16, 64), C
clients in a closed loop, each sending its next streamed completion (a random token-id prompt, greedy,
EOS ignored, return_token_ids) when its last one ended, for each shape (128 prompt tokens / 128 new,
1000 / 200), after one warm-up wave of C requests. The clients are spread over processes of at most
`--clients-per-process` each, as one Python process parsing every stream spends more CPU per token than the
server does and would measure itself. Per cell: requests/s and output tokens/s over the cell's wall time,
time to first token (request sent to first token read) and time per output token (first to last token
over tokens - 1), p50 and p99, and the CPU time per output token of the server (all of it, and its main
thread: HTTP and the event loop) and of the clients. Then the server stops, the artifact loads here and
the same requests run through the engine at the same concurrency (Engine.add_request and step, a
request joining as one finishes; TTFT and TPOT from the sequences' own times). Both sides get the same
KV cache (131072 tokens, smoke 16384: 64 requests of 1200 tokens fit without preemption). Overhead =
offline output tokens/s / server output tokens/s: what HTTP, the event loop and the clients' round trips
cost.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .common import REPO, Study, add_study_arguments, error_text, log, random_prompts
from .models import save_model, shape_of
from .report import text_table

SHAPES = {"128-in/128-out": (128, 128), "1000-in/200-out": (1000, 200)}
SMOKE_SHAPES = {"16-in/8-out": (16, 8), "48-in/16-out": (48, 16)}
READY = re.compile(r"graphkiln serve: .* on (http://127\.0\.0\.1:\d+)/v1")
START_TIMEOUT_S = 300
NAME = "bench"


@dataclass(frozen=True)
class Sample:
    """One request: time to first token, time per output token after it (None for one token), tokens."""

    ttft_s: float
    tpot_s: float | None
    tokens: int


def summary(samples: list[Sample], wall_s: float) -> dict:
    tokens = sum(s.tokens for s in samples)
    return {"requests": len(samples), "wall_s": wall_s, "requests_per_s": len(samples) / wall_s,
            "output_tokens_per_s": tokens / wall_s, "ttft_ms": _percentiles([s.ttft_s for s in samples]),
            "tpot_ms": _percentiles([s.tpot_s for s in samples if s.tpot_s is not None])}  # fmt: skip


def _percentiles(seconds: list[float]) -> dict:
    if len(seconds) < 2:
        return {"p50": seconds[0] * 1e3, "p99": seconds[0] * 1e3} if seconds else {}
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return {"p50": cuts[49] * 1e3, "p99": cuts[98] * 1e3}


# The server side.


@contextmanager
def server_process(artifact: Path, engine: dict, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """`graphkiln serve ARTIFACT --port 0` in a child process until the block ends; yields its URL and pid once
    its /health says ready (every graph captured)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    cmd = [sys.executable, "-m", "graphkiln", "serve", str(artifact), "--port", "0", "--served-model-name", NAME,
           "--max-queued-requests", "4096", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1", **env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    found: list[str] = []
    lines: deque[str] = deque(maxlen=40)

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if not found and (match := READY.search(line)):
                found.append(match.group(1))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.time() + START_TIMEOUT_S
        while not (found and _ready(found[0])):  # what the load prepares in the background is in before any cell
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"graphkiln serve did not start (exit {proc.poll()}): {''.join(lines)[-1500:]}")
            time.sleep(0.2)
        yield found[0], proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)


def _ready(url: str) -> bool:
    import httpx

    try:
        health = httpx.get(url + "/health", timeout=2)
    except httpx.HTTPError:
        return False
    return health.status_code == 200 and health.json()["ready"]


async def _request(client, prompt: list[int], new_tokens: int) -> Sample:
    body = {"model": NAME, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    sent, first, last, tokens = time.perf_counter(), None, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                count = sum(len(c.get("token_ids") or ()) for c in json.loads(line[6:])["choices"])
                if count:
                    last = time.perf_counter()
                    first = first or last
                    tokens += count
    if tokens != new_tokens:
        raise RuntimeError(f"a stream ended after {tokens} of {new_tokens} tokens")
    return Sample(first - sent, (last - first) / (tokens - 1) if tokens > 1 else None, tokens)


async def _closed_loop(url: str, prompts: list[list[int]], new_tokens: int, concurrency: int,
                       start_at: float) -> tuple[list, float, float]:
    """`concurrency` clients, each sending its next prompt when its last request ended, from `start_at` (a
    time.time(), so that the client processes of one cell start together). Returns the samples, the
    time.time() the last one ended and this process's CPU seconds over the cell."""
    import httpx

    todo, samples = iter(prompts), []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as client:

        async def client_loop() -> None:
            for prompt in todo:
                samples.append(await _request(client, prompt, new_tokens))

        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu = time.process_time()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return samples, time.time(), time.process_time() - cpu


def _client_share(url: str, prompts: list[list[int]], new_tokens: int, concurrency: int,
                  start_at: float) -> tuple[list, float, float]:
    """One client process's part of a cell (a spawned process: this module's top level is all it needs)."""
    return asyncio.run(_closed_loop(url, prompts, new_tokens, concurrency, start_at))


def http_cell(url: str, server_pid: int, prompts: list[list[int]], warmup: list[list[int]], new_tokens: int,
              concurrency: int, clients_per_process: int) -> dict:
    """The cell's clients spread over client processes of at most `clients_per_process` clients, each a closed
    loop of its share of the clients over its share of the prompts. The clients' CPU seconds and the server's
    (all its threads, and its main thread alone: HTTP and the event loop) are counted over the cell, per
    output token: a client process near one CPU second a second limits what the cell can measure."""
    processes = -(-concurrency // clients_per_process)
    clients = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=spawn) as pool:
        for share in (warmup, prompts):
            start_at = time.time() + 1.0  # every process started and connected by then
            server_before = _cpu_seconds(server_pid)
            futures = [pool.submit(_client_share, url, share[i::processes], new_tokens, c, start_at)
                       for i, c in enumerate(clients)]  # fmt: skip
            parts = [f.result() for f in futures]
            server_after = _cpu_seconds(server_pid)
    samples = [s for part in parts for s in part[0]]
    result = summary(samples, max(part[1] for part in parts) - start_at)
    tokens = sum(s.tokens for s in samples)
    cpu = {"client_processes": processes, "clients_us_per_token": sum(part[2] for part in parts) / tokens * 1e6,
           "busiest_client_cpu_share": max(part[2] for part in parts) / result["wall_s"]}  # fmt: skip
    if server_before and server_after:
        cpu |= {"server_us_per_token": (server_after[0] - server_before[0]) / tokens * 1e6,
                "server_main_thread_us_per_token": (server_after[1] - server_before[1]) / tokens * 1e6}
    return result | {"cpu": cpu}


def _cpu_seconds(pid: int) -> tuple[float, float] | None:
    """CPU seconds (user + system) of process `pid`, all threads and its main thread, from Linux's /proc; None
    elsewhere."""
    tick = os.sysconf("SC_CLK_TCK")

    def read(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    try:
        return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")
    except OSError:
        return None


# The offline side.


def offline_cell(llm, prompts: list[list[int]], warmup: list[list[int]], new_tokens: int, concurrency: int) -> dict:
    import graphkiln

    params = graphkiln.SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    _closed_loop_offline(llm.engine, warmup, params, concurrency)
    return summary(*_closed_loop_offline(llm.engine, prompts, params, concurrency))


def _closed_loop_offline(engine, prompts: list[list[int]], params, concurrency: int) -> tuple[list, float]:
    """The engine with at most `concurrency` requests in it, the next one added as one finishes."""
    todo, running, samples = deque(prompts), [], []
    start = time.perf_counter()
    while todo or running:
        while todo and len(running) < concurrency:
            running.append(engine.add_request(todo.popleft(), params))
        engine.step()
        for seq in [s for s in running if s.finish_reason is not None]:
            running.remove(seq)
            n = len(seq.output_ids)
            tpot = (seq.finish_time - seq.first_token_time) / (n - 1) if n > 1 else None
            samples.append(Sample(seq.first_token_time - seq.arrival, tpot, n))
    return samples, time.perf_counter() - start


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="clients at once (smoke: 1 4 8)")
    p.add_argument("--rounds", type=int, default=4, help="requests per client in a cell (at least 16 per cell)")
    p.add_argument("--clients-per-process", type=int, default=8,
                   help="clients one client process drives at most (the cell's clients spread over processes)")
    p.add_argument("--server-switch-interval", default=None, metavar="SECONDS",
                   help="the server's GRAPHKILN_SERVE_SWITCH_INTERVAL (seconds or off; default: its own default)")


def main(a: argparse.Namespace) -> int:
    import torch

    import graphkiln
    from graphkiln.errors import ConfigError
    from graphkiln.models.switch_interval import SERVE_SWITCH_INTERVAL_ENV, parse_switch_interval

    if a.clients_per_process < 1:
        raise SystemExit(f"bench serve: --clients-per-process {a.clients_per_process}; give 1 or more")
    if a.server_switch_interval is not None:
        try:
            parse_switch_interval("--server-switch-interval", a.server_switch_interval)
        except ConfigError as e:
            raise SystemExit(f"bench serve: {e}") from None
    study = Study.of("serve", a)
    shapes, levels = (SMOKE_SHAPES, [1, 4, 8]) if study.smoke else (SHAPES, a.concurrency)
    engine = {"kv_cache_tokens": 16384 if study.smoke else 131072}  # the same cache both sides; 64 x 1200 fit
    child_env = {} if a.server_switch_interval is None else {SERVE_SWITCH_INTERVAL_ENV: a.server_switch_interval}
    if study.smoke:  # CPU: one intra-op thread on each side, or the server's threads and the clients' fight
        torch.set_num_threads(1)
        child_env["OMP_NUM_THREADS"] = "1"
    vocab = shape_of(study.model)["vocab_size"]
    cells = [(shape, c) for shape in shapes for c in levels]
    prompts = {(shape, c): random_prompts(max(16, a.rounds * c), shapes[shape][0], vocab, seed=i)
               for i, (shape, c) in enumerate(cells)}  # fmt: skip
    warmups = {(shape, c): random_prompts(c, shapes[shape][0], vocab, seed=1000 + i)
               for i, (shape, c) in enumerate(cells)}  # fmt: skip
    results: dict = {"settings": {"shapes": shapes, "concurrency": levels, "rounds": a.rounds, "engine": engine,
                                  "clients_per_process": a.clients_per_process,
                                  "server_switch_interval": a.server_switch_interval},
                     "cells": {shape: {} for shape in shapes}, "errors": []}  # fmt: skip
    with study.scratch() as work:
        model = save_model(study.model, work / "model", study.device, study.dtype, study.layers)
        config = graphkiln.CompileConfig(device=study.device, dtype=study.dtype_name)
        graphkiln.compile_model(model, work / "art", config)
        gc.collect()
        if study.cuda:  # what the compile held goes back to the device before the server sizes its cache
            torch.cuda.empty_cache()
        log("compiled; starting graphkiln serve")
        with server_process(work / "art", engine, child_env) as (url, pid):
            for shape, c in cells:
                results["cells"][shape][str(c)] = cell = {}
                try:
                    cell["server"] = http_cell(url, pid, prompts[shape, c], warmups[shape, c], shapes[shape][1], c,
                                               a.clients_per_process)
                    log(f"server {shape} c={c}: {cell['server']['output_tokens_per_s']:.0f} tokens/s")
                except Exception as e:  # the cell records why; the others still run
                    results["errors"].append({"where": f"server {shape} c={c}", "error": error_text(e)})
            results["server_metrics"] = _metrics(url)
        with graphkiln.load(work / "art", **engine) as llm:
            llm.wait_ready()
            for shape, c in cells:
                cell = results["cells"][shape][str(c)]
                cell["offline"] = offline_cell(llm, prompts[shape, c], warmups[shape, c], shapes[shape][1], c)
                if "server" in cell:
                    cell["overhead"] = cell["offline"]["output_tokens_per_s"] / cell["server"]["output_tokens_per_s"]
                log(f"offline {shape} c={c}: {cell['offline']['output_tokens_per_s']:.0f} tokens/s")
                study.save(results)
    print(text_table(table(results)))
    log(f"wrote {study.save(results)}")
    return 1 if results["errors"] else 0


def _metrics(url: str) -> dict:
    """The server's counters after the run: graph replays and steps without a graph, tokens, requests."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    keep = ("graphkiln_graph_replays", "graphkiln_steps_without_graph", "graphkiln_generation_tokens",
            "graphkiln_requests_total")  # fmt: skip
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                   if line.startswith(keep) and "_created" not in line)}


def table(results: dict) -> list[list]:
    """One row per shape and concurrency: output tokens/s both ways, the overhead, TTFT and TPOT p50/p99."""
    rows = [["shape", "C", "server tok/s", "offline tok/s", "overhead", "server req/s", "TTFT p50/p99 ms server",
             "offline", "TPOT p50/p99 ms server", "offline", "server CPU us/token (main thread)",
             "clients CPU us/token (busiest process's CPU share)"]]  # fmt: skip
    for shape, by_level in results["cells"].items():
        for c, cell in by_level.items():
            server, offline = cell.get("server") or {}, cell.get("offline") or {}

            def pair(side: dict, key: str) -> str:
                p = side.get(key) or {}
                return f"{p['p50']:.3g} / {p['p99']:.3g}" if p else "—"

            rows.append([shape, c, server.get("output_tokens_per_s"), offline.get("output_tokens_per_s"),
                         f"{cell['overhead']:.2f}x" if "overhead" in cell else "—", server.get("requests_per_s"),
                         pair(server, "ttft_ms"), pair(offline, "ttft_ms"), pair(server, "tpot_ms"),
                         pair(offline, "tpot_ms"), _server_cpu(server.get("cpu", {})),
                         _clients_cpu(server.get("cpu", {}))])  # fmt: skip
    return rows


def _server_cpu(cpu: dict) -> str:
    if "server_us_per_token" not in cpu:
        return "—"
    return f"{cpu['server_us_per_token']:.0f} ({cpu['server_main_thread_us_per_token']:.0f})"


def _clients_cpu(cpu: dict) -> str:
    if not cpu:
        return "—"
    return f"{cpu['clients_us_per_token']:.0f} ({cpu['busiest_client_cpu_share']:.0%} in {cpu['client_processes']})"
