"""Programmatic dependent launch: whether graphkiln's own kernels (GEMV, decode attention, RMSNorm) use it.

A kernel launched with it may start while the kernel before it drains: it does what does not
depend on that kernel's output (weight or cache loads), then waits (griddepcontrol.wait) for it
to finish and its writes to land. It works inside CUDA graphs.

Inductor's kernels can do the same (`CompileConfig(inductor_options={"triton.enable_pdl": True})`),
but not by default: Inductor cannot launch such kernels statically, so a fresh process loading
the artifact compiles them again (README says what that costs and saves).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def pdl(device_index: int) -> bool:
    """On sm90 and later, unless GRAPHKILN_PDL=0."""
    return os.environ.get("GRAPHKILN_PDL", "1") != "0" and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """`pdl` for a tensor's device: False off CUDA."""
    if device.type != "cuda":
        return False
    return pdl(device.index if device.index is not None else torch.cuda.current_device())
