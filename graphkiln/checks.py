"""Validation shared by the compile and the engine configs (a bottom module: it imports only the errors)."""

from __future__ import annotations

from graphkiln.errors import ConfigError


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def torch_device(device):
    """`device` as a torch.device, or a ConfigError naming it (torch imported here only: this module stays light)."""
    import torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device ({e}); use 'cpu' or 'cuda'") from None


def check_sizes(field: str, sizes: tuple[int, ...], allow_empty: bool = False) -> None:
    """Capture or compile sizes: positive integers, strictly increasing."""
    if not sizes and not allow_empty:
        raise ConfigError(f"{field} is empty; give at least one size")
    if any(not is_int(s) or s < 1 for s in sizes):
        raise ConfigError(f"{field}={list(sizes)}: every size must be a positive integer")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ConfigError(f"{field}={list(sizes)}: sizes must be strictly increasing")
