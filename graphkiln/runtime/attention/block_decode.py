"""Which decode kernel the Triton backend runs, and the plan of the block kernel.

EngineConfig.decode_kernel: "rows" (kernels/decode_attention.py, one head a program, the cache
gathered row by row; the default) or "blocks" (kernels/block_decode_attention.py, whole blocks
of several KV heads by bulk copies). Caches the block kernel cannot read (fp8, blocks of fewer
than 16 rows, rows not 16-byte aligned) keep the row kernel: `effective_decode_kernel` says so
once, when the backend is built.

The plan is static for a captured graph (batch size, block table width, head shapes): heads a
program, so a box holds at most BOX_BYTES of each block row (4 heads of 64 bf16 lanes, 2 of
128), which bounds the registers of the accumulators (a GQA group padded to 16 rows each); splits
so the grid has BLOCK_PROGRAMS_PER_SM programs on every SM, never fewer than MIN_SPLIT_BLOCKS
blocks of the longest context a split; NUM_STAGES of loop pipelining, which keeps two blocks
of keys and values in flight per program (Triton spends the other stages on the block-table
load each copy waits for).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from graphkiln.errors import ConfigError
from graphkiln.runtime.config import DECODE_KERNELS

log = logging.getLogger(__name__)

BLOCK_PROGRAMS_PER_SM = 3  # what fits beside each other at the default plan (registers, then shared memory)
MIN_SPLIT_BLOCKS = 8
MAX_SPLITS = 64
BOX_BYTES = 512  # one block row's bytes of the heads a program reads
NUM_STAGES = 5


@dataclass(frozen=True)
class BlockDecodeTiles:
    num_splits: int
    heads: int
    num_warps: int
    num_stages: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_decode_tiles(
    num_seqs: int, num_kv_heads: int, max_context: int, block_size: int, padded_head_dim: int, itemsize: int,
    num_sms: int,
) -> BlockDecodeTiles:
    """The block kernel's plan for `num_seqs` rows whose block tables hold `max_context` tokens."""
    heads = 1
    while heads * 2 <= num_kv_heads and heads * 2 * padded_head_dim * itemsize <= BOX_BYTES:
        heads *= 2
    tiles = _cdiv(num_kv_heads, heads)
    wanted = _cdiv(BLOCK_PROGRAMS_PER_SM * num_sms, num_seqs * tiles)
    splits = max(1, min(wanted, _cdiv(max_context, MIN_SPLIT_BLOCKS * block_size), MAX_SPLITS))
    return BlockDecodeTiles(splits, heads, 8 if padded_head_dim * itemsize > 256 else 4, NUM_STAGES)


def check_decode_kernel(decode_kernel: str, backend: str) -> None:
    """A ConfigError unless `decode_kernel` is known and, other than "rows", served by `backend`."""
    if decode_kernel not in DECODE_KERNELS:
        raise ConfigError(f"EngineConfig.decode_kernel={decode_kernel!r}; use one of {DECODE_KERNELS}")
    if decode_kernel != "rows" and backend != "triton":
        raise ConfigError(
            f"EngineConfig.decode_kernel={decode_kernel!r} is a Triton kernel, but the attention backend is "
            f"{backend!r}; use attention_backend='triton' (or 'auto' on CUDA), or decode_kernel='rows'"
        )


def effective_decode_kernel(decode_kernel: str, keys: torch.Tensor) -> str:
    """The kernel that serves a cache of `keys` [num_layers, num_blocks, block_size, Hkv, D]: the one asked
    for, or "rows" where the block kernel cannot read the cache (logged)."""
    if decode_kernel == "rows":
        return "rows"
    from graphkiln.kernels.block_decode_attention import block_decode_unsupported

    reason = block_decode_unsupported(keys[0])
    if reason:
        log.info("decode_kernel='blocks' cannot read this KV cache (%s); decoding with the row kernel", reason)
        return "rows"
    return decode_kernel
