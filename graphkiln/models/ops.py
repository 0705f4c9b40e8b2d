"""Where graphkiln's custom ops are registered: `torch.library.Library` definitions with a fake kernel.

`torch.library.custom_op` does the same in one decorator, but the kernel it registers imports Dynamo
at its first call (torch._disable_dynamo wraps it) and its registration reads the function's source
file. A process that only serves, or an engine that answers its first request before the compiled
pieces (and with them Inductor and Dynamo) are loaded, should pay neither. An op defined here is a
plain dispatcher kernel: calling it imports nothing, and tracing sees it through its fake kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIBRARY = torch.library.Library("graphkiln", "DEF")


def define(schema: str, kernel: Callable, fake: Callable) -> torch._ops.OpOverloadPacket:
    """Define `graphkiln::<schema>` with `kernel` for every device and `fake` for tracing; return the op."""
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema)
    LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"graphkiln::{name}", fake, lib=LIBRARY)
    return getattr(torch.ops.graphkiln, name)
