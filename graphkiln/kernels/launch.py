"""Every launch of graphkiln's Triton kernels goes through `launch`, so their builds can run ahead, in parallel.

Triton builds a kernel the first time it is launched with a new specialization (constexprs, warps, stages,
which integers are 1 or multiples of 16, which pointers are aligned), and reads it from its disk cache in a
later process: a second or more per build, one at a time, on the launching thread. An engine's buckets need
a dozen or more such builds of its attention and GEMV kernels. Within a `builds_ahead()` block, a launch on
that thread builds its kernel on a pool of threads instead of running it (Triton's `warmup`), and returns
at once: a dry run of the code that will launch them (a capture's step, say) starts every build it needs
together. A launch outside such a block first waits for the builds of its kernel still under way, so it
never builds what the pool is building.

Triton spends most of a build outside the interpreter lock (its compiler passes, ptxas), so builds on
several threads overlap. The module imports no Triton itself: it only calls the kernels it is handed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextvars import ContextVar
from typing import Any

import torch

MAX_BUILDERS = 8

_ahead: ContextVar[ThreadPoolExecutor | None] = ContextVar("graphkiln_builds_ahead", default=None)
_pending: dict[Any, list[Future]] = {}  # kernel -> builds started and not yet waited for
_pending_lock = threading.Lock()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, or, within `builds_ahead()` on this thread, its build started."""
    pool = _ahead.get()
    if pool is not None:
        device = torch.cuda.current_device()
        future = pool.submit(_build, kernel, device, grid, args, kwargs)
        with _pending_lock:
            _pending.setdefault(kernel, []).append(future)
        return
    _wait_for(kernel)
    kernel[grid](*args, **kwargs)


def builders() -> int:
    """Threads that build at once: half the CPUs (the steps served meanwhile keep the rest), at most
    MAX_BUILDERS."""
    return max(1, min(MAX_BUILDERS, (os.cpu_count() or 2) // 2))


@contextlib.contextmanager
def builds_ahead() -> Iterator[None]:
    """Within the block, this thread's launches start their kernels' builds instead of running them; the
    builds go on after it (`wait_for_builds`, or the kernels' next launches, wait for them)."""
    pool = ThreadPoolExecutor(builders(), thread_name_prefix="graphkiln-kernel-build")
    token = _ahead.set(pool)
    try:
        yield
    finally:
        _ahead.reset(token)
        pool.shutdown(wait=False)


def wait_for_builds() -> None:
    """Wait for every build started so far; a build that failed is left to its launch, which builds the kernel
    itself and raises the error where it is called."""
    with _pending_lock:
        futures = [f for builds in _pending.values() for f in builds]
    wait(futures)
    _forget(futures)


def _wait_for(kernel: Any) -> None:
    with _pending_lock:
        futures = _pending.get(kernel)
    if futures:
        wait(futures)
        _forget(futures)


def _forget(futures: list[Future]) -> None:
    done = set(futures)
    with _pending_lock:
        for kernel in list(_pending):
            left = [f for f in _pending[kernel] if f not in done]
            if left:
                _pending[kernel] = left
            else:
                del _pending[kernel]


def _build(kernel: Any, device: int, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
    with torch.cuda.device(device):
        kernel.warmup(*args, grid=grid, **kwargs)
