"""CompileConfig: everything that decides what `compile-model` produces, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphkiln.errors import ConfigError

DEFAULT_DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_PREFILL_TOKEN_BUCKETS = tuple(2**i for i in range(4, 13))  # 16 ... 4096
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")


def check_block_size(value, field: str) -> None:
    """KV blocks hold a power-of-two number of tokens (kernels index within a block by bit masks)."""
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ConfigError(f"{field}={value!r}: use a power of two such as 16")


def _check_sizes(name: str, sizes: tuple[int, ...]) -> None:
    if not sizes:
        raise ConfigError(f"CompileConfig.{name} is empty; give at least one size")
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError(f"CompileConfig.{name}={list(sizes)}: every size must be a positive integer")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ConfigError(f"CompileConfig.{name}={list(sizes)}: sizes must be strictly increasing")


@dataclass(frozen=True)
class CompileConfig:
    """device/dtype of the artifact, decode batch and prefill token buckets, context, passes, dumps.

    `specialize` adds one Inductor compile per bucket size next to the dynamic-shape compile. Off
    by default: on an H200 (1B-like model, bench/profile_step.py) the specialized kernels gave the
    same decode step and prefill times as the dynamic ones within 1%, for 6x the compiles.
    `kv_cache_tokens`, when given, bounds the buckets: a decode bucket needs a block per sequence.
    """

    device: str = "cpu"
    dtype: str = "float32"
    decode_batch_sizes: tuple[int, ...] = DEFAULT_DECODE_BATCH_SIZES
    prefill_token_buckets: tuple[int, ...] = DEFAULT_PREFILL_TOKEN_BUCKETS
    max_seq_len: int | None = None
    specialize: bool = False
    disabled_passes: tuple[str, ...] = ()
    dump_dir: str | None = None
    block_size: int = 16
    kv_cache_tokens: int | None = None
    inductor_options: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("decode_batch_sizes", "prefill_token_buckets", "disabled_passes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.device not in DEVICES:
            raise ConfigError(f"CompileConfig.device={self.device!r}; use one of {DEVICES}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"CompileConfig.dtype={self.dtype!r}; use one of {DTYPES}")
        _check_sizes("decode_batch_sizes", self.decode_batch_sizes)
        _check_sizes("prefill_token_buckets", self.prefill_token_buckets)
        check_block_size(self.block_size, "CompileConfig.block_size")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ConfigError(f"CompileConfig.max_seq_len={self.max_seq_len}: must be positive")
        if self.kv_cache_tokens is not None:
            blocks = self.kv_cache_tokens // self.block_size
            if self.decode_batch_sizes[-1] > blocks:
                raise ConfigError(
                    f"CompileConfig.decode_batch_sizes ends at {self.decode_batch_sizes[-1]} sequences but "
                    f"kv_cache_tokens={self.kv_cache_tokens} holds only {blocks} blocks of {self.block_size}"
                )
            if self.max_seq_len is not None and self.max_seq_len > self.kv_cache_tokens:
                raise ConfigError(
                    f"CompileConfig.max_seq_len={self.max_seq_len} exceeds kv_cache_tokens={self.kv_cache_tokens}"
                )
