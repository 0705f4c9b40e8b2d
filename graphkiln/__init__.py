"""graphkiln: compile Hugging Face decoder LLMs with torch.compile/Inductor and serve them with CUDA graphs.

Public API: `compile_model`, `load`, `cached_artifact`, `captures_paused`, `LLM`, `SamplingParams`, `CompileConfig`, `EngineConfig`,
`RequestOutput`, `StreamDelta`, `TokenLogprobs`, and the typed errors in `graphkiln.errors`. Names
are imported on first use, so `import graphkiln.errors` (or any one room) does not pull in the rest.
"""

from __future__ import annotations

import importlib
import time
from typing import TYPE_CHECKING

IMPORT_STARTED = time.perf_counter()  # LLM.stats().load.import_s counts from here

from graphkiln.version import __version__

_NAMES = {
    "compile_model": "graphkiln.api",
    "load": "graphkiln.api",
    "cached_artifact": "graphkiln.api",
    "captures_paused": "graphkiln.runtime.capture_pause",
    "LLM": "graphkiln.llm",
    "RequestOutput": "graphkiln.llm",
    "StreamDelta": "graphkiln.llm",
    "TokenLogprobs": "graphkiln.llm",
    "CompileConfig": "graphkiln.compiler.config",
    "EngineConfig": "graphkiln.runtime.config",
    "SamplingParams": "graphkiln.runtime.sampling_params",
}
__all__ = [*_NAMES, "errors", "__version__"]

if TYPE_CHECKING:
    from graphkiln import errors
    from graphkiln.api import cached_artifact, compile_model, load
    from graphkiln.compiler.config import CompileConfig
    from graphkiln.llm import LLM, RequestOutput, StreamDelta, TokenLogprobs
    from graphkiln.runtime.capture_pause import captures_paused
    from graphkiln.runtime.config import EngineConfig
    from graphkiln.runtime.sampling_params import SamplingParams


def __getattr__(name: str):
    if name == "errors":
        return importlib.import_module("graphkiln.errors")
    if name not in _NAMES:
        raise AttributeError(f"module 'graphkiln' has no attribute {name!r}")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value
