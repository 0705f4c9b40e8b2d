"""One capture skeleton for every CUDA graph the runtime replays: decode steps, whole prefills, prefill pieces.

A `GraphSet` is one kind of graph keyed by bucket size (with a sampling mode or a piece name
beside it): the sizes and the bucket lookup, warm-up and capture into the engine's one memory
pool on one side stream, replay counts and capture stats. What a graph runs, and how a batch
reaches its static buffers, is the strategy's (decode_graphs.py, prefill_graphs.py). Each strategy
lists its captures as jobs, one bucket each, smallest first (the most used buckets); captured all
at once they run largest first, so smaller graphs reuse the pool's memory, and captured in the
background (preparation.py) smallest first. A bucket serves replays once it is `ready`: a step
whose bucket is not ready yet takes the smallest ready bucket that holds it, or runs without a graph.
Captures use `capture_error_mode="thread_local"`: they may run on a thread of their own; each holds the
process's capture lock (capture_pause.py). Unlike `torch.cuda.graph`, a capture neither synchronizes the
device nor empties the allocator's cache first: under a background preparation's step lock that would make a
step wait for the GPU work queued before it (a large bucket's warm-up, say) as well as for the capture.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .attention.base import AttentionBackend
from .capture_pause import captures_paused


def smallest_bucket(sizes: tuple[int, ...], count: int) -> int | None:
    """The smallest of the increasing `sizes` that holds `count`, or None beyond the largest."""
    i = bisect.bisect_left(sizes, count)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class CaptureStats:
    graphs: int = 0
    seconds: float = 0.0
    pool_bytes: int = 0


class GraphPool:
    """The engine's one graph memory pool and the side stream every capture runs on."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()


@dataclass(frozen=True)
class CaptureSetup:
    """What every kind of graph is built with: the engine's pool, its attention backend, the KV block geometry."""

    pool: GraphPool
    backend: AttentionBackend
    block_size: int
    max_blocks_per_seq: int
    device: torch.device


@dataclass(frozen=True)
class CaptureJob:
    """One bucket's capture: `run()` captures it and marks `bucket` ready in `graphs`; `withdraw()` drops it.
    With `warm`, its warm-up can run on its own first (then `run()` does not warm up again): a background
    preparation holds the step lock for each of the two, so that a step waits for one of them at most."""

    graphs: GraphSet
    key: str
    run: Callable[[], None]
    bucket: Hashable
    warm: Callable[[], None] | None = None

    @property
    def kind(self) -> str:
        return self.graphs.kind

    def withdraw(self) -> None:
        self.graphs.withdraw(self.bucket)


def capture_all(jobs: list[CaptureJob]) -> None:
    """Run every job now, largest first (jobs come smallest first)."""
    with torch.inference_mode():
        for job in reversed(jobs):
            job.run()


class GraphSet:
    """Captured graphs of one kind, each with the outputs its replay refreshes."""

    def __init__(self, kind: str, sizes: tuple[int, ...], pool: GraphPool) -> None:
        self.kind = kind
        self.sizes = tuple(sorted(sizes))
        self.pool = pool
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.replays: Counter[Hashable] = Counter()
        self.ready: set[Hashable] = set()  # buckets whose graphs are all captured (strategies say what a key is)
        self.bucket_keys: dict[Hashable, set[Hashable]] = {}  # the graphs each bucket's capture added
        self.warmed: set[Hashable] = set()  # graphs whose warm-up ran apart from their capture
        self.stats = CaptureStats()
        self._captured_bytes = 0  # device memory the captures since the last `capturing` block reserved

    def ready_bucket(self, count: int, key: Callable[[int], Hashable] = lambda size: size) -> int | None:
        """The smallest size holding `count` whose bucket `key(size)` is ready, or None."""
        i = bisect.bisect_left(self.sizes, count)
        return next((size for size in self.sizes[i:] if key(size) in self.ready), None)

    @contextlib.contextmanager
    def capturing(self, bucket: Hashable) -> Iterator[None]:
        """Around capturing one bucket's graph(s): its seconds and the pool memory it added count in the stats,
        and the bucket is ready once the block ends without raising."""
        start = time.perf_counter()
        keys = set(self.graphs)
        self._captured_bytes = 0
        yield
        self.bucket_keys[bucket] = set(self.graphs) - keys
        self.ready.add(bucket)
        self.stats = CaptureStats(len(self.graphs), self.stats.seconds + time.perf_counter() - start,
                                  self.stats.pool_bytes + self._captured_bytes)  # fmt: skip

    def warm(self, fn: Callable[[], Any], key: Hashable | None = None) -> None:
        """Run `fn` once on the side stream: its lazy initialisation and autotuning, before a capture. With
        `key`, the capture of `key` that follows does not warm up again."""
        stream = self.pool.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        if key is not None:
            self.warmed.add(key)

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """Run `fn` once on the side stream (unless `warm` ran it for `key`), then capture it into the shared
        pool under `key`; return the outputs its replays will refresh."""
        if key in self.warmed:
            self.warmed.discard(key)  # a later capture of it (`recapture`) warms up again
        else:
            self.warm(fn)
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_reserved()  # the step lock keeps other allocations out meanwhile
        with captures_paused(), torch.cuda.stream(self.pool.stream):  # (capture_pause.py: no random draw beside it)
            graph.capture_begin(pool=self.pool.handle, capture_error_mode="thread_local")
            try:
                outputs = fn()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # (the capture is invalid: its end raises too)
                    graph.capture_end()
                raise
            graph.capture_end()
        self._captured_bytes += torch.cuda.memory_reserved() - before
        self.graphs[key] = (graph, outputs)
        return outputs

    def replay(self, key: Hashable) -> Any:
        graph, outputs = self.graphs[key]
        graph.replay()
        self.replays[key] += 1
        return outputs

    def withdraw(self, bucket: Hashable) -> None:
        """Make a captured bucket unready and drop its graphs (a tensor-parallel peer failed to capture it)."""
        self.ready.discard(bucket)
        for key in self.bucket_keys.pop(bucket, ()):
            del self.graphs[key]
        self.stats = CaptureStats(len(self.graphs), self.stats.seconds, self.stats.pool_bytes)

    def release(self) -> None:
        """Drop every graph and its outputs, so the pool's memory can go back to the device."""
        self.ready.clear()
        self.warmed.clear()
        self.bucket_keys.clear()
        self.graphs.clear()
        self.stats = CaptureStats()
