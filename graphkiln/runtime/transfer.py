"""Host values to the device without a host-device synchronization.

`torch.tensor(values).to(device)` waits for the stream to drain (a blocking copy); launched after
a graph replay, that wait exposes every later launch's host time. Copies here are queued instead:
the driver stages small pageable buffers at once, so the host list can go away.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` as a tensor on `device`, its copy queued on the current stream."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
