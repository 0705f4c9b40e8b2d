"""CompileConfig: what decides the compiled code `compile-model` produces, validated on construction.

Serving choices (capture sizes, KV cache, batching limits, attention backend) are the engine's
(`graphkiln.runtime.config.EngineConfig`); none of them changes a compiled piece.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from graphkiln.errors import ConfigError
from graphkiln.checks import check_sizes, is_int
from graphkiln.passes import symm_mem_all_reduce

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("fp8", "int8", "int4")


@dataclass(frozen=True)
class CompileConfig:
    """Device and dtype of the artifact, token counts compiled specialized, passes, Inductor options, dumps,
    `quantization` ("fp8", "int8", "int4"): the decoder's projections quantized at compile time, and the number of
    tensor-parallel ranks the model is split over (each rank runs the same compiled code).

    Every piece is compiled once with a dynamic token dim; each size in `specialize_sizes` adds one
    more compile with the token dim fixed to it, used for calls of exactly that many tokens.
    """

    device: str = "cpu"
    dtype: str = "float32"
    specialize_sizes: tuple[int, ...] = ()
    disabled_passes: tuple[str, ...] = ()
    enabled_passes: tuple[str, ...] = ()  # passes that are off by default, turned on
    dump_dir: str | None = None
    tensor_parallel_size: int = 1
    # Inductor config entries; a CUDA compile adds triton.enable_pdl=True unless set here (compiler/inductor.py)
    inductor_options: dict = field(default_factory=dict, hash=False, compare=False)
    quantization: str | None = None

    def __post_init__(self) -> None:
        for name in ("specialize_sizes", "disabled_passes", "enabled_passes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.device not in DEVICES:
            raise ConfigError(f"CompileConfig.device={self.device!r}; use one of {DEVICES}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"CompileConfig.dtype={self.dtype!r}; use one of {DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"CompileConfig.quantization={self.quantization!r}; use one of {QUANTIZATIONS} or None")
        check_sizes("CompileConfig.specialize_sizes", self.specialize_sizes, allow_empty=True)
        if both := sorted(set(self.disabled_passes) & set(self.enabled_passes)):
            raise ConfigError(f"CompileConfig: {', '.join(both)} both in disabled_passes and enabled_passes; keep one")
        if not is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ConfigError(
                f"CompileConfig.tensor_parallel_size={self.tensor_parallel_size!r}: use a positive integer"
            )
        if symm_mem_all_reduce.NAME in self.enabled_passes:
            symm_mem_all_reduce.check_compile_config(self.device, self.dtype, self.tensor_parallel_size,
                                                     self.specialize_sizes)
        if self.dump_dir is not None:
            object.__setattr__(self, "dump_dir", str(self.dump_dir))
        try:  # recorded in the manifest, to recompile a stale artifact with the same options
            json.dumps(self.inductor_options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"CompileConfig.inductor_options must hold JSON values (numbers, strings, ...): {e}") from e
        if self.inductor_options.get("triton.multi_kernel"):
            raise ConfigError(
                "CompileConfig.inductor_options sets triton.multi_kernel: Inductor's saved code calls multi-kernel "
                "launchers it does not define, so the artifact's pieces would fail to load (NameError: "
                "multi_kernel_0); leave it unset"
            )
