"""graphkiln::rope off CUDA: the op against transformers' rotary embedding on the model's cos/sin table."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from graphkiln.models.rope import rope, rope_cache
from test_compiler import TOY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_rotates_as_transformers_does(dtype):
    """On the query and key heads of a qkv product (a strided view) at shuffled positions: transformers' rotation in
    float32, rounded once to the model dtype, bit for bit."""
    table = rope_cache(TOY, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = TOY.num_heads, TOY.num_kv_heads, TOY.head_dim
    qkv = torch.randn(9, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    x = qkv[:, : (heads + kv_heads) * head_dim].view(9, heads + kv_heads, head_dim)
    positions = torch.randperm(TOY.max_context, generator=gen)[:9]
    got = rope(x, table, positions)
    assert got.is_contiguous() and got.dtype == dtype
    cos, sin = table[positions].chunk(2, dim=-1)
    q, k = x.float().transpose(0, 1)[:heads], x.float().transpose(0, 1)[heads:]
    want_q, want_k = apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None])
    want = torch.cat((want_q[0], want_k[0])).transpose(0, 1)
    assert torch.equal(got, want.to(dtype))  # the same float32 operations, rounded once to the model dtype

