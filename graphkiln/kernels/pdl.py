"""Programmatic dependent launch: whether graphkiln's own kernels (GEMV, decode attention, RMSNorm) use it.

A kernel launched with it may start while the kernel before it drains: it does what does not
depend on that kernel's output (weight or cache loads), then waits (griddepcontrol.wait) for it
to finish and its writes to land. It works inside CUDA graphs.

Inductor's kernels do the same in a CUDA compile (its `triton.enable_pdl`, on unless GRAPHKILN_PDL=0 or
`CompileConfig(inductor_options={"triton.enable_pdl": False})`; Inductor itself keeps it to sm90 and later):
README says what it saves a decode step and costs a start.
"""

from __future__ import annotations

import functools
import os

import torch


def pdl_wanted() -> bool:
    """False where GRAPHKILN_PDL=0: neither our kernels nor Inductor's (compiled from then on) use it."""
    return os.environ.get("GRAPHKILN_PDL", "1") != "0"


@functools.cache
def pdl(device_index: int) -> bool:
    """On sm90 and later, unless GRAPHKILN_PDL=0."""
    return pdl_wanted() and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """`pdl` for a tensor's device: False off CUDA."""
    if device.type != "cuda":
        return False
    return pdl(device.index if device.index is not None else torch.cuda.current_device())
