"""CompileConfig: what decides the compiled code `compile-model` produces, validated on construction.

Serving choices (capture sizes, KV cache, batching limits, attention backend) are the engine's
(`graphkiln.runtime.config.EngineConfig`); none of them changes a compiled piece.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from graphkiln.errors import ConfigError
from graphkiln.checks import check_sizes

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("fp8", "int4")


@dataclass(frozen=True)
class CompileConfig:
    """Device and dtype of the artifact, token counts compiled specialized, passes, Inductor options, dumps,
    and `quantization` ("fp8", "int4"): the decoder's projections quantized at compile time.

    Every piece is compiled once with a dynamic token dim; each size in `specialize_sizes` adds one
    more compile with the token dim fixed to it, used for calls of exactly that many tokens.
    """

    device: str = "cpu"
    dtype: str = "float32"
    specialize_sizes: tuple[int, ...] = ()
    disabled_passes: tuple[str, ...] = ()
    dump_dir: str | None = None
    inductor_options: dict = field(default_factory=dict, hash=False, compare=False)
    quantization: str | None = None

    def __post_init__(self) -> None:
        for name in ("specialize_sizes", "disabled_passes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.device not in DEVICES:
            raise ConfigError(f"CompileConfig.device={self.device!r}; use one of {DEVICES}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"CompileConfig.dtype={self.dtype!r}; use one of {DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"CompileConfig.quantization={self.quantization!r}; use one of {QUANTIZATIONS} or None")
        check_sizes("CompileConfig.specialize_sizes", self.specialize_sizes, allow_empty=True)
        if self.dump_dir is not None:
            object.__setattr__(self, "dump_dir", str(self.dump_dir))
        try:  # recorded in the manifest, to recompile a stale artifact with the same options
            json.dumps(self.inductor_options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"CompileConfig.inductor_options must hold JSON values (numbers, strings, ...): {e}") from e
