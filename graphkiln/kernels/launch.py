"""Every launch of graphkiln's Triton kernels goes through `launch`, so their builds can run ahead, in parallel.

Triton builds a kernel the first time it is launched with a new specialization (constexprs, warps, stages,
which integers are 1 or multiples of 16, which pointers are aligned), and reads it from its disk cache in a
later process: a second or more per build, one at a time, on the launching thread. An engine's buckets need
a dozen or more such builds of its attention and GEMV kernels. Within a `builds_ahead()` block, a launch on
that thread builds its kernel on a pool of threads instead of running it (Triton's `warmup`), and returns
at once: a dry run of the code that will launch them (a capture's step, say) starts every build it needs
together, and a launch that specializes as one already started (every layer's, which differ in their
pointers only) starts none. A launch outside such a block first waits for the builds of its kernel still
under way, so it never builds what the pool is building.

Triton spends most of a build outside the interpreter lock (its compiler passes, ptxas), so builds on
several threads overlap. The module imports no Triton itself: it only calls the kernels it is handed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextvars import ContextVar
from typing import Any

import torch

MAX_BUILDERS = 8

_ahead: ContextVar[ThreadPoolExecutor | None] = ContextVar("graphkiln_builds_ahead", default=None)
_pending: list[tuple[Any, Future]] = []  # (kernel, build) of the builds started and not yet seen done
_started: set[tuple] = set()  # the builds started, by what they specialize on (`_specialized`)
_pending_lock = threading.Lock()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, or, within `builds_ahead()` on this thread, its build started."""
    pool = _ahead.get()
    if pool is not None:
        key = (kernel, build_key(kernel, args), tuple(sorted(kwargs.items())))
        with _pending_lock:
            if key in _started:
                return
            _started.add(key)
        future = pool.submit(_build, kernel, torch.cuda.current_device(), grid, args, kwargs)
        with _pending_lock:
            _pending.append((kernel, future))
        return
    if _pending:  # (empty once every build was waited for: a launch then takes no lock)
        wait_for_builds(kernel)
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


def wait_for_builds(kernel: Any = None) -> None:
    """Wait for every build started so far (of `kernel` only, if given); a build that failed is left to its
    launch, which builds the kernel itself and raises the error where it is called."""
    with _pending_lock:
        futures = [future for k, future in _pending if kernel is None or k is kernel]
    wait(futures)
    with _pending_lock:
        _pending[:] = [(k, future) for k, future in _pending if not future.done()]


def build_key(kernel: Any, args: tuple) -> tuple:
    """What a build of `kernel` specializes on of its positional arguments (`_specialized`); an integer the
    kernel names in `do_not_specialize` (its `params` say which) by its width alone, as Triton compiles it."""
    params = getattr(kernel, "params", ())
    return tuple(_specialized(a, i < len(params) and params[i].do_not_specialize) for i, a in enumerate(args))


def _specialized(arg: Any, fixed: bool = False) -> Hashable:
    """What a build specializes on of a runtime argument, as Triton does: a tensor's dtype and 16-byte alignment,
    an integer's width and whether it is 1 or a multiple of 16 (its width alone where `fixed`: a parameter not
    specialized), a float's type; a host-side tensor descriptor by its element type and block shape alone (its
    shape and strides are runtime values, so launches on x of 2, 4 or 8 rows share a build). So the launches of
    every layer, which differ only in their pointers, start one build. Constexprs and options, passed by keyword,
    count by value."""
    if isinstance(arg, int) and not isinstance(arg, bool) and fixed:
        return int, -(2**31) <= arg < 2**31
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, (bool, str)) or arg is None:
        return arg
    if isinstance(arg, int):
        return int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31
    if isinstance(arg, float):
        return float
    if isinstance(arg, (tuple, list)):
        return tuple(_specialized(a) for a in arg)
    if dataclasses.is_dataclass(arg) and hasattr(arg, "block_shape"):
        return type(arg), arg.base.dtype, tuple(arg.block_shape)
    return id(arg)  # unknown: a build of its own


def _build(kernel: Any, device: int, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
    with torch.cuda.device(device):
        kernel.warmup(*args, grid=grid, **kwargs)
