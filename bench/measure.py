"""The one timing helper (`time_ms`), the hardware rates results are set against (`copy_rate`,
`matmul_rate`), and `in_graph`, which captures a function in a CUDA graph to time it as the engine
replays it.

On the GPU, CUDA events bracket each sample; on the CPU the host clock does (after a sync that is
a no-op there), so every caller runs unchanged in the CPU smoke mode.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and mean over the samples, and the samples."""

    median_ms: float
    mean_ms: float
    samples_ms: list[float]

    @property
    def us(self) -> float:
        return self.median_ms * 1e3


def sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def now(device) -> float:
    """The host clock once the device has caught up."""
    sync(device)
    return time.perf_counter()


def time_ms(fn: Callable[[], object], device, reps: int = 10, calls: int = 1, warmup: int = 3,
            before: Callable[[], object] | None = None) -> Timing:
    """`warmup` calls of fn(), then `reps` samples of `calls` back-to-back calls each, per call.

    `before` runs ahead of each sample, outside the timed span (flush_l2: every sample starts cold).
    """
    import torch

    cuda = str(device).startswith("cuda")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t) * 1e3 / calls)
    return Timing(statistics.median(samples), statistics.fmean(samples), samples)


def flush_l2(device) -> None:
    """Overwrite 256 MiB (more than any GPU's L2), so the next kernel reads its inputs from memory."""
    import torch

    if str(device).startswith("cuda"):
        torch.empty(256 << 20, dtype=torch.uint8, device=device).zero_()


def in_graph(fn: Callable[[], object], device) -> Callable[[], None]:
    """fn captured in a CUDA graph (after a warm-up call on a side stream): the graph's replay. On the
    CPU, fn itself."""
    import torch

    if not str(device).startswith("cuda"):
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def copy_rate(device, nbytes: int, warm_s: float = 0.25) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and written (median of 20), after
    `warm_s` seconds of the same copies: a GPU idle before clocks up under load, and a floor taken from a cold
    copy would be low."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    until = now(device) + warm_s
    while now(device) < until:
        dst.copy_(src)
    timing = time_ms(lambda: dst.copy_(src), device, reps=20)
    if not torch.equal(dst, src):
        raise RuntimeError("copy check failed: the destination differs from the source")
    return 2 * nbytes / (timing.median_ms / 1e3)


def matmul_rate(device, dtype, n: int) -> float:
    """FLOP per second of an n×n×n product in `dtype` on random data (median of 10)."""
    import torch

    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n**3 / (time_ms(lambda: torch.mm(a, b), device).median_ms / 1e3)
