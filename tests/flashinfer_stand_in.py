"""A torch stand-in for FlashInfer's paged wrappers (the real ones need a GPU), with the signatures of
flashinfer 0.5.3, and paged batches with their float64 expectations, for the CPU tests of the FlashInfer
backend and of the backends built on it."""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import pytest
import torch
from attention_helpers import CPU, naive_attention
from graphkiln.runtime.attention.metadata import SequenceSlice, build_metadata, pad_decode
from graphkiln.runtime.kv_cache import KVCache


def _stand_in_attention(wrapper, q, paged_kv_cache, q_scale, out) -> None:
    """What FlashInfer computes from a plan: causal attention (aligned to the end) over the listed pages."""
    k_cache, v_cache = paged_kv_cache
    qo, indptr, indices, last = (t.tolist() for t in wrapper.layout())
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    scale = (wrapper.sm_scale or head_dim**-0.5) * (q_scale or 1.0)
    for i in range(len(indptr) - 1):
        pages = torch.tensor(indices[indptr[i] : indptr[i + 1]])
        length = (len(pages) - 1) * page_size + last[i]
        keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:length]
        values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:length]
        out[qo[i] : qo[i + 1]] = naive_attention(q[qo[i] : qo[i + 1]], keys, values, scale).to(out.dtype)


class _StandInDecodeWrapper:
    """FlashInfer 0.5.3's BatchDecodeWithPagedKVCacheWrapper signatures (decode.py), computed with torch."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None) -> None:
        assert kv_layout == "NHD" and use_cuda_graph and use_tensor_cores
        assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans = 0

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None,
             disable_split_kv=False) -> None:
        assert indptr.device.type == last_page_len.device.type == "cpu"  # host arrays: no device read
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert len(indptr) == len(self.buffers[0]) and len(indices) < len(self.buffers[1])
        self.buffers[0].copy_(indptr)
        self.buffers[1][: len(indices)].copy_(indices)
        self.buffers[2].copy_(last_page_len)
        self.sm_scale, self.q_dtype = sm_scale, q_data_type
        self.plans += 1

    def layout(self):  # run reads the persistent buffers, as a captured graph would
        indptr, indices, last = self.buffers
        return torch.arange(len(indptr), dtype=torch.int32), indptr, indices, last

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=1):
        assert out is not None and out.shape == q.shape and out.is_contiguous() and q.dtype == self.q_dtype
        _stand_in_attention(self, q, paged_kv_cache, q_scale, out)
        return out


class _StandInPrefillWrapper:
    """FlashInfer 0.5.3's BatchPrefillWithPagedKVCacheWrapper signatures (prefill.py), computed with torch."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None) -> None:
        assert kv_layout == "NHD" and not use_cuda_graph
        self.plans, self.backend = 0, backend

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
             max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None,
             disable_split_kv=False) -> None:
        assert causal and qo_indptr.device.type == paged_kv_indptr.device.type == "cpu"
        assert paged_kv_last_page_len.device.type == "cpu"
        self.arrays = (qo_indptr.clone(), paged_kv_indptr.clone(), paged_kv_indices, paged_kv_last_page_len.clone())
        self.sm_scale, self.q_dtype = sm_scale, q_data_type
        self.plans += 1

    def layout(self):
        return self.arrays

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None):
        assert out is not None and out.shape == q.shape and out.is_contiguous() and q.dtype == self.q_dtype
        assert q.shape[0] == self.arrays[0][-1]
        _stand_in_attention(self, q, paged_kv_cache, q_scale, out)
        return out


def _cpu_write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    heads, dim = k.shape[1:]
    slots = slot_mapping[: k.shape[0]]
    k_cache.view(-1, heads, dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slots, v.to(v_cache.dtype))


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import flashinfer` give the stand-in, and the KV write (a Triton kernel) a torch copy."""
    fake = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_StandInDecodeWrapper,
        BatchPrefillWithPagedKVCacheWrapper=_StandInPrefillWrapper,
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "graphkiln.kernels.kv_write", SimpleNamespace(write_kv=_cpu_write_kv))


def paged_batch(cache: KVCache, lens, decode: bool, pad: int, seed: int):
    """Slices over shuffled blocks with their cached prefixes written; the new rows' q, k, v; full k/v."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = cache.keys.shape[-2:]
    free = list(range(1, cache.num_blocks))
    random.Random(seed).shuffle(free)
    slices, full_k, full_v = [], [], []
    for q_len, seq_len in lens:
        blocks = tuple(free.pop() for _ in range(-(-seq_len // 16)))
        slices.append(SequenceSlice(q_len, seq_len, blocks))
        full_k.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(cache.keys.dtype))
        full_v.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(cache.keys.dtype))
        for pos in range(seq_len - q_len):
            slot = blocks[pos // 16] * 16 + pos % 16
            cache.keys[1].view(-1, num_kv_heads, head_dim)[slot] = full_k[-1][pos]
            cache.values[1].view(-1, num_kv_heads, head_dim)[slot] = full_v[-1][pos]
    slices = pad_decode(slices, len(slices) + pad) if decode else slices
    rows = sum(s.query_len for s in slices) + (0 if decode else pad)
    meta = build_metadata(slices, 16, rows, CPU)
    new = [(k[s - q :], v[s - q :]) for k, v, (q, s) in zip(full_k, full_v, lens)]
    extra = rows - sum(q for q, _ in lens)
    k = torch.cat([n[0] for n in new] + [torch.zeros(extra, num_kv_heads, head_dim, dtype=cache.keys.dtype)])
    v = torch.cat([n[1] for n in new] + [torch.zeros(extra, num_kv_heads, head_dim, dtype=cache.keys.dtype)])
    return meta, k, v, full_k, full_v


def check_rows(out, q, lens, full_k, full_v, scale) -> None:
    start = 0
    for (q_len, _), keys, values in zip(lens, full_k, full_v):
        expected = naive_attention(q[start : start + q_len].double(), keys.double(), values.double(), scale)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, rtol=2e-2, atol=2e-2)
        start += q_len
