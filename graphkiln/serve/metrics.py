"""Prometheus metrics of one server (`GET /metrics`), in a registry of its own.

Per request, as its handler saw it: time to first token, time per output token after the first, end to
end latency, requests by finish reason, prompt and generated tokens, requests refused for a full queue.
Of the engine, read at scrape time from the snapshot its thread keeps: requests running and waiting,
requests admitted by the server (what the queue bound counts), KV cache blocks used and their share,
CUDA graph replays and steps run without a graph, by kind of step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .loop import EngineSnapshot, Job

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], admitted: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("graphkiln_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("graphkiln_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.latency = Histogram("graphkiln_request_latency_seconds", "Time from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.requests = Counter("graphkiln_requests", "Finished requests (one per choice)", ["finish_reason"],
                                registry=r)  # fmt: skip
        self.prompt_tokens = Counter("graphkiln_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("graphkiln_generation_tokens", "Tokens generated", registry=r)
        self.rejected = Counter("graphkiln_requests_rejected", "Requests refused with 503 for a full queue", registry=r)
        r.register(_EngineCollector(snapshot, admitted))

    def job_finished(self, job: Job) -> None:
        self.requests.labels(job.finish_reason).inc()
        self.generation_tokens.inc(job.num_tokens)
        self.latency.observe(job.finished - job.submitted)
        if job.first_token is not None:
            self.ttft.observe(job.first_token - job.submitted)
            if job.num_tokens > 1:
                self.tpot.observe((job.finished - job.first_token) / (job.num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot], admitted: Callable[[], int]) -> None:
        self.snapshot = snapshot
        self.admitted = admitted

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        yield GaugeMetricFamily("graphkiln_requests_running", "Requests in the running batch", s.running)
        yield GaugeMetricFamily("graphkiln_requests_waiting", "Requests waiting for the running batch", s.waiting)
        yield GaugeMetricFamily("graphkiln_requests_admitted", "Requests the server admitted and has not finished",
                                self.admitted())  # fmt: skip
        yield GaugeMetricFamily("graphkiln_kv_cache_blocks", "KV cache blocks requests can hold", s.kv_blocks)
        yield GaugeMetricFamily("graphkiln_kv_cache_used_blocks", "KV cache blocks held by requests", s.kv_blocks_used)
        yield GaugeMetricFamily("graphkiln_kv_cache_usage_ratio", "Share of the KV cache blocks held",
                                s.kv_blocks_used / s.kv_blocks if s.kv_blocks else 0.0)  # fmt: skip
        replays = CounterMetricFamily("graphkiln_graph_replays", "CUDA graph replays", labels=["kind"])
        for kind, count in sorted(s.graph_replays.items()):
            replays.add_metric([kind], count)
        yield replays
        eager = CounterMetricFamily("graphkiln_steps_without_graph", "Steps run without a CUDA graph", labels=["kind"])
        for kind, count in sorted(s.steps_without_graph.items()):
            eager.add_metric([kind], count)
        yield eager
