"""One process-wide lock between CUDA graph captures and random draws on the device.

While torch captures a graph it marks the device's default random generator as captured, and a draw
outside that capture (another thread's `torch.randn(..., device="cuda")`) then raises "Offset increment
outside graph capture". Every capture the runtime makes holds this lock, and code that draws CUDA random
numbers while an engine may be preparing in the background holds it too: compile_model does (Inductor's
autotuning draws its inputs), and so may a caller, through `captures_paused()`. A background preparation
takes it before each job and before the engine's step lock, so that while something else holds it the
preparation waits and the steps go on; a job is tens of milliseconds, which is what that holder waits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_CAPTURES = threading.RLock()
_held = threading.local()  # depth: how many captures_paused blocks this thread is inside


@contextlib.contextmanager
def captures_paused() -> Iterator[None]:
    """No CUDA graph capture (no background preparation job) of this process runs inside the block; one running
    now finishes first. Steps go on. Waiting inside it for an engine's preparation to finish (`wait_ready`
    without a timeout) never returns."""
    with _CAPTURES:
        _held.depth = getattr(_held, "depth", 0) + 1
        try:
            yield
        finally:
            _held.depth -= 1


def paused_here() -> bool:
    """This thread is inside `captures_paused()`: a preparation thread waiting for it cannot be joined from here."""
    return getattr(_held, "depth", 0) > 0
