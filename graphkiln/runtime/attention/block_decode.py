"""Which decode kernel the Triton backend runs, and the plan of the block kernel.

EngineConfig.decode_kernel: "rows" (kernels/decode_attention.py, one head a program, the cache
gathered row by row), "blocks" (kernels/block_decode_attention.py, whole blocks of several KV
heads by bulk copies) or "auto", the default, which is the row kernel: timed in whole decode steps on the H200
(`python -m bench serving --backends triton:rows,triton:blocks,triton:rows`, README "Attention at
serving shapes"), it was as fast as the block kernel or faster at the batched long-context shapes where
the block kernel had led in isolation, on both bench models. Both kernels read the same
cache, so each decode graph takes its own. Caches the block kernel cannot read (blocks of fewer than
16 rows, rows not 16-byte aligned: for fp8 a head_dim not a multiple of 16) keep the row kernel:
`effective_decode_kernel` says so once, when the backend is built.

The plan is static for a captured graph (batch size, block table width, head shapes): heads a
program, so a box holds at most BOX_BYTES of each block row (4 heads of 64 bf16 lanes, 2 of
128), which bounds the registers of the accumulators (a GQA group padded to 16 rows each); splits
so the grid has BLOCK_PROGRAMS_PER_SM programs on every SM, never fewer than MIN_SPLIT_BLOCKS
blocks of the longest context a split: one program an SM, since each split's partial results,
their merge and its own pipeline fill cost more than the loads a second wave would add in flight
(`bench attention --decode-ab` on the H200: 64 x 2000, 128 x 1000 and the 8B-like 32 x 4000 in
two runs); NUM_STAGES of loop pipelining, which keeps two blocks
of keys and values in flight per program (Triton spends the other stages on the block-table
load each copy waits for). An fp8 cache is planned at the lanes of a 16-bit one (`lane_bytes`):
its tiles are converted to the query's dtype in registers, and the accumulators, which bound the
heads a program, do not shrink with the cache's bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from graphkiln.errors import ConfigError
from graphkiln.runtime.config import DECODE_KERNELS

from .long_prefill import NAME as LONG_PREFILL

log = logging.getLogger(__name__)

BLOCK_PROGRAMS_PER_SM = 1  # one wave: more splits measured slower at the batched shapes it serves (README)
MIN_SPLIT_BLOCKS = 8
MAX_SPLITS = 64
BOX_BYTES = 512  # one block row's bytes of the heads a program reads
NUM_STAGES = 5
MIN_BLOCK_ROWS = 16  # tl.dot's smallest dimension: a block is one tile of keys
MAX_BOX = 256  # the copy engine's largest box dimension


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


def lane_bytes(cache_dtype: torch.dtype) -> int:
    """The bytes of a head lane the block kernel's plan counts: the cache's, or 2 for an fp8 cache, whose
    tiles are converted to the (16-bit) query dtype in registers."""
    return 2 if cache_dtype == torch.float8_e4m3fn else cache_dtype.itemsize


def check_decode_kernel(decode_kernel: str, backend: str) -> None:
    """A ConfigError unless `decode_kernel` is known and, if "blocks", served by `backend` ("auto" means the
    row kernel, or none, elsewhere)."""
    if decode_kernel not in DECODE_KERNELS:
        raise ConfigError(f"EngineConfig.decode_kernel={decode_kernel!r}; use one of {DECODE_KERNELS}")
    if decode_kernel == "blocks" and backend not in ("triton", LONG_PREFILL):
        raise ConfigError(
            f"EngineConfig.decode_kernel={decode_kernel!r} is a Triton kernel, but the attention backend is "
            f"{backend!r}; use attention_backend='triton' (or 'auto' on CUDA), or decode_kernel='rows'"
        )


def block_decode_unsupported(cache: torch.Tensor) -> str | None:
    """Why a layer's cache [num_blocks, block_size, Hkv, D] cannot be read by block copies, or None."""
    _, block_size, _, head_dim = cache.shape
    if cache.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        return f"cache dtype {cache.dtype}"
    if not MIN_BLOCK_ROWS <= block_size <= MAX_BOX:
        return f"block_size {block_size}: block copies need {MIN_BLOCK_ROWS} to {MAX_BOX} rows"
    if (head_dim * cache.element_size()) % 16:
        return f"head_dim {head_dim}: a head's row of {head_dim * cache.element_size()} bytes is not a multiple of 16"
    if cache.stride(3) != 1 or cache.stride(2) != head_dim or cache.stride(0) != block_size * cache.stride(1):
        return "a cache that is not contiguous"
    return None


def effective_decode_kernel(decode_kernel: str, keys: torch.Tensor) -> str:
    """The kernel that serves a cache of `keys` [num_layers, num_blocks, block_size, Hkv, D]: "blocks" where it
    was asked for and can read the cache, else "rows" (logged when "blocks" was asked for but cannot be)."""
    if decode_kernel != "blocks":
        return "rows"
    reason = block_decode_unsupported(keys[0])
    if reason:
        log.info("decode_kernel='blocks' cannot read this KV cache (%s); decoding with the row kernel", reason)
        return "rows"
    return "blocks"
