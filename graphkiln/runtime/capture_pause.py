"""One process-wide lock between CUDA graph captures and random draws on the device.

While torch captures a graph it marks the device's default random generator as captured, and a draw
outside that capture (another thread's `torch.randn(..., device="cuda")`) then raises "Offset increment
outside graph capture". Every capture the runtime makes holds this lock, and code that draws CUDA random
numbers while an engine may be preparing in the background holds it too: compile_model does (Inductor's
autotuning draws its inputs), and so may a caller, through `captures_paused()`. A capture is tens of
milliseconds; a background preparation waits out whatever holds the lock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_CAPTURES = threading.RLock()


@contextlib.contextmanager
def captures_paused() -> Iterator[None]:
    """No CUDA graph capture of this process runs inside the block (one running now finishes first). Do not
    step an engine inside it: its step may wait for a capture that waits for this block."""
    with _CAPTURES:
        yield
