"""The reference attention backend: torch SDPA per sequence, on any device.

Writes the batch's keys and values through the slot mapping, gathers each sequence's context
from its block table and attends with a causal mask aligned to the end of the context (so a
prefill that continues a cached prefix sees the prefix). An fp8 cache is quantized on write and
dequantized on read (kv_dtype.py). Not capturable in a CUDA graph: it loops over sequences on
the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphkiln.models.attention import AttentionFn
from graphkiln.runtime.kv_cache import KVCache
from graphkiln.runtime.kv_dtype import dequantize, quantize

from .metadata import BatchMetadata


class SdpaBackend:
    name = "sdpa"
    capturable_decode = False
    capturable_prefill = False
    concurrent_plans = True
    prompt_lengths = ()  # torch's kernels
    eager_prefill_work = None

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache

    def release(self) -> None:
        """Nothing of its own on the device: torch's kernels allocate per call."""

    def plan(self, meta: BatchMetadata) -> AttentionFn:
        def run(layer: int, q, k, v, out, scale: float) -> None:
            self._run(meta, layer, q, k, v, out, scale)

        return run

    def _run(self, meta: BatchMetadata, layer: int, q, k, v, out, scale: float) -> None:
        k_cache, v_cache = self.kv_cache.layer(layer)
        scales = self.kv_cache.layer_scales(layer)
        heads, dim = k_cache.shape[-2:]
        rows = k.shape[0]
        slots = meta.slot_mapping[:rows]
        if scales is None:
            k_cache.view(-1, heads, dim).index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.view(-1, heads, dim).index_copy_(0, slots, v.to(v_cache.dtype))
        else:
            _write_fp8(k, k_cache, scales[0], slots)
            _write_fp8(v, v_cache, scales[1], slots)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
            blocks = meta.block_tables[i, : -(-seq_len // meta.block_size)]
            keys = k_cache[blocks].reshape(-1, heads, dim)[:seq_len]
            values = v_cache[blocks].reshape(-1, heads, dim)[:seq_len]
            if scales is not None:
                keys = dequantize(keys, scales[0][blocks].reshape(-1, heads)[:seq_len], q.dtype)
                values = dequantize(values, scales[1][blocks].reshape(-1, heads)[:seq_len], q.dtype)
            query = q[start : start + q_len]
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            result = F.scaled_dot_product_attention(
                query.transpose(0, 1),
                keys.transpose(0, 1).to(query.dtype),
                values.transpose(0, 1).to(query.dtype),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[start : start + q_len] = result.transpose(0, 1)
            start += q_len
        out[start:] = 0


def _write_fp8(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows x [T, Hkv, D] quantized into an fp8 cache's slots (as bytes: index_copy_ has no fp8 kernel) and
    their scales."""
    heads, dim = cache.shape[-2:]
    rows, row_scales = quantize(x)
    cache.view(-1, heads, dim).view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    scales.view(-1, heads).index_copy_(0, slots, row_scales)
