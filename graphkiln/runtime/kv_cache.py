"""Paged KV cache: per-layer key and value blocks, and the allocator that hands blocks to sequences.

Block 0 is never handed out: padded rows of a batch write their keys and values there.
"""

from __future__ import annotations

import torch

from graphkiln.errors import CapacityError
from graphkiln.models.config import ModelConfig

from .kv_dtype import SCALE_DTYPE, is_scaled

DUMMY_BLOCK = 0


class KVCache:
    """Keys and values of every layer: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] each.

    An fp8 cache (kv_dtype.py) also holds a float32 scale per row: key_scales and value_scales
    [num_layers, num_blocks, block_size, num_kv_heads]; other caches have none.
    """

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.key_scales = self.value_scales = None
        if is_scaled(dtype):
            self.key_scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
            self.value_scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    def release(self) -> None:
        """Let the cache's memory go: every later use fails."""
        self.keys = self.values = self.key_scales = self.value_scales = None

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]

    def layer_scales(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer's (key, value) row scales [num_blocks, block_size, num_kv_heads], or None when unscaled."""
        if self.key_scales is None:
            return None
        return self.key_scales[index], self.value_scales[index]

    @property
    def nbytes(self) -> int:
        scales = 0 if self.key_scales is None else self.key_scales.nbytes + self.value_scales.nbytes
        return self.keys.nbytes + self.values.nbytes + scales

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Keys and values of every layer for one token, with their row scales where the dtype has them."""
        scales = cfg.num_kv_heads * SCALE_DTYPE.itemsize if is_scaled(dtype) else 0
        return 2 * cfg.num_layers * (cfg.kv_size * dtype.itemsize + scales)


class BlockAllocator:
    """A free list of block ids; block 0 stays reserved as the dummy block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise CapacityError(f"KV cache of {num_blocks} blocks holds no sequence; give it at least 2 blocks")
        self.block_size = block_size
        self.capacity = num_blocks - 1
        self._free = list(range(num_blocks - 1, DUMMY_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Append blocks until `blocks` holds `num_tokens`; False (and no change) if too few are free."""
        needed = self.blocks_for(num_tokens) - len(blocks)
        if needed > len(self._free):
            return False
        for _ in range(max(needed, 0)):
            blocks.append(self._free.pop())
        return True

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()
