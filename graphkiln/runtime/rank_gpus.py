"""The GPUs of a tensor-parallel group on one machine: one per rank, and never one shared by two ranks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from graphkiln.errors import ConfigError


def check_distinct_gpus(size: int, control: dist.ProcessGroup) -> None:
    """A ConfigError on every rank when two ranks hold the same physical GPU (by UUID): their all-reduces would
    run, slowly, on one device, and symmetric memory would read one rank's buffer as another's."""
    uuids: list[str] = [""] * size
    dist.all_gather_object(uuids, str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid), control)
    if shared := shared_gpus(uuids):
        named = "; ".join(f"ranks {ranks} on GPU {uuid}" for uuid, ranks in shared.items())
        raise ConfigError(f"tensor-parallel ranks share a GPU ({named}): give each rank its own GPU "
                          "(CUDA_VISIBLE_DEVICES, or torchrun's LOCAL_RANK per GPU)")  # fmt: skip


def shared_gpus(uuids: list[str]) -> dict[str, list[int]]:
    """Each GPU UUID held by more than one rank, with those ranks (`uuids[r]`: rank r's GPU)."""
    return {u: [r for r, v in enumerate(uuids) if v == u] for u in dict.fromkeys(uuids) if uuids.count(u) > 1}


def visible_cuda_devices(size: int) -> list[str]:
    """The GPUs of this process, one per rank; fewer than `size` is a ConfigError."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = devices[:count] if devices else [str(i) for i in range(count)]
    if len(devices) < size:
        raise ConfigError(f"the artifact is compiled for tensor_parallel_size={size} but this machine shows "
                          f"{len(devices)} CUDA device(s); run it on {size} GPUs")  # fmt: skip
    return devices
