"""EngineConfig: every serving choice, validated once; `load`, `LLM.eager` and `LLM.compile` build engines from it.

Nothing here changes compiled code. An artifact records the EngineConfig given at compile time
as its defaults (manifest section "engine"); `load` starts from those and applies what its
caller overrides, so capture sizes, the KV cache and batching limits are chosen at load time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphkiln.checks import check_sizes, is_int
from graphkiln.errors import ConfigError

DEFAULT_DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_PREFILL_TOKEN_BUCKETS = tuple(2**i for i in range(4, 13))  # 16 ... 4096
ATTENTION_BACKENDS = ("auto", "sdpa", "triton", "flashinfer", "triton+flashinfer")
DECODE_KERNELS = ("auto", "rows", "blocks")  # the Triton backend's decode kernels (attention/block_decode.py)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # the model's dtype, or float8_e4m3fn with row scales (kv_dtype.py)
MAX_TIMEOUT_S = 365 * 24 * 3600  # torch.distributed keeps timeouts in int64 nanoseconds: about 292 years at most
CAPTURE_MODES = ("background", "blocking")
DEFAULT_CPU_KV_TOKENS = 16384


def _positive_int(field: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not is_int(value) or value < 1:
        raise ConfigError(f"EngineConfig.{field}={value!r}: it must be a positive integer")


@dataclass(frozen=True)
class EngineConfig:
    """How an engine serves: attention backend, CUDA graphs and their capture sizes, KV cache, batching.

    `kv_cache_tokens` sizes the KV cache exactly; without it the cache takes `gpu_memory_fraction`
    of the device's memory on CUDA (less what is already used) and DEFAULT_CPU_KV_TOKENS on the CPU.
    `max_seq_len` caps prompt plus output below the model's own context. Decode steps of up to the
    largest decode batch size and prefill steps of up to the largest token bucket replay captured
    CUDA graphs (padded to the next size); larger ones run the compiled pieces without a graph.
    `kv_cache_dtype` "fp8_e4m3" stores keys and values in one byte an element (plus a float32
    scale per token and KV head), so about twice the tokens fit; "auto" keeps the model's dtype.
    `capture`: "background" (the engine serves while its graphs are captured, a step whose graph is
    not captured yet running without it; `LLM.wait_ready()` waits for them) or "blocking" (every
    graph captured before `load` returns). Without graphs the same happens to one warm-up run per size.
    `attention_backend`: "auto" (runtime/attention/select.py), "sdpa", "triton", "flashinfer", or
    "triton+flashinfer" (Triton's kernels, FlashInfer's for long prefill steps: attention/long_prefill.py).
    `decode_kernel` picks the Triton backend's decode kernel: "rows" (each head's cache rows gathered
    one by one), "blocks" (whole cache blocks of several heads by bulk copies) or "auto" (the one that
    measured faster in whole decode steps: rows, today; runtime/attention/block_decode.py).
    `collective_timeout_s` bounds how long a tensor-parallel rank waits inside a step for the others.
    """

    attention_backend: str = "auto"
    cuda_graphs: bool = True
    decode_batch_sizes: tuple[int, ...] = DEFAULT_DECODE_BATCH_SIZES
    prefill_token_buckets: tuple[int, ...] = DEFAULT_PREFILL_TOKEN_BUCKETS
    block_size: int = 16
    kv_cache_tokens: int | None = None
    gpu_memory_fraction: float = 0.9
    max_seq_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_cache_dtype: str = "auto"
    capture: str = "background"
    collective_timeout_s: float = 300.0
    decode_kernel: str = "auto"

    def __post_init__(self) -> None:
        for name in ("decode_batch_sizes", "prefill_token_buckets"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ConfigError(f"EngineConfig.{name}={value!r}: give a sequence of sizes such as (1, 2, 4)")
            object.__setattr__(self, name, tuple(value))
            check_sizes(f"EngineConfig.{name}", getattr(self, name))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"EngineConfig.attention_backend={self.attention_backend!r}; use one of {ATTENTION_BACKENDS}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}; use one of {KV_CACHE_DTYPES}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ConfigError(f"EngineConfig.decode_kernel={self.decode_kernel!r}; use one of {DECODE_KERNELS}")
        if self.capture not in CAPTURE_MODES:
            raise ConfigError(f"EngineConfig.capture={self.capture!r}; use one of {CAPTURE_MODES}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"EngineConfig.cuda_graphs={self.cuda_graphs!r}: use True or False")
        if not is_int(self.block_size) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"EngineConfig.block_size={self.block_size!r}: use a power of two such as 16")
        _positive_int("kv_cache_tokens", self.kv_cache_tokens, optional=True)
        _positive_int("max_seq_len", self.max_seq_len, optional=True)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        fraction = self.gpu_memory_fraction
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 < fraction <= 1:
            raise ConfigError(f"EngineConfig.gpu_memory_fraction={fraction!r}: it must be in (0, 1]")
        timeout = self.collective_timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise ConfigError(f"EngineConfig.collective_timeout_s={timeout!r}: give a positive number of seconds, "
                              f"at most {MAX_TIMEOUT_S} (a year)")  # fmt: skip
        if self.kv_cache_tokens is not None:
            self._check_cache_holds_the_limits()

    def _check_cache_holds_the_limits(self) -> None:
        """An explicit KV cache must hold one block and one sequence of max_seq_len tokens (decode graphs
        larger than the cache has blocks are not captured: no step can reach them)."""
        blocks = self.kv_cache_tokens // self.block_size
        if blocks < 1:
            raise ConfigError(
                f"EngineConfig.kv_cache_tokens={self.kv_cache_tokens} is smaller than one block of "
                f"{self.block_size} tokens; raise it, or lower block_size"
            )
        if self.max_seq_len is not None and self.max_seq_len > self.kv_cache_tokens:
            raise ConfigError(
                f"EngineConfig.max_seq_len={self.max_seq_len} exceeds kv_cache_tokens={self.kv_cache_tokens}"
            )

    def reachable_sizes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The decode batch sizes and prefill token buckets a step can reach (at most max_num_seqs sequences and
        max_num_batched_tokens tokens): the others are never captured, padded to or called first."""
        return (tuple(s for s in self.decode_batch_sizes if s <= self.max_num_seqs),
                tuple(s for s in self.prefill_token_buckets if s <= self.max_num_batched_tokens))

    def replace(self, **options) -> EngineConfig:
        """A copy with `options` changed; an unknown name is a ConfigError listing the known ones."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return dataclasses.replace(self, **options)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> EngineConfig:
        """Rebuild from `to_dict` after a JSON round trip (an artifact's recorded defaults)."""
        return cls().replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def engine_config(base: EngineConfig | None = None, **options) -> EngineConfig:
    """`base` (default: EngineConfig()) with `options` applied: the one way callers build an engine's config."""
    if base is not None and not isinstance(base, EngineConfig):
        raise ConfigError(f"engine={base!r:.80}: give an EngineConfig, or its fields as keyword arguments "
                          "(max_num_seqs=8, ...)")  # fmt: skip
    return (base or EngineConfig()).replace(**options)
