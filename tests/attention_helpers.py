"""Helpers shared by the CPU attention tests: a model config of given head shape and float64 attention."""

from __future__ import annotations

import torch
from graphkiln.models.config import ModelConfig

CPU = torch.device("cpu")


def model_config(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", family="llama", vocab_size=8, hidden_size=num_heads * head_dim,
        intermediate_size=8, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=1e-5, max_context=4096, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
        mlp_bias=False, qk_norm=False, rope_type="default", rope_inv_freq=(), rope_scaling=1.0, bos_token_id=None,
        eos_token_ids=(),
    )


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of q [n, Hq, D] at the last n positions of unpaged keys/values [L, Hkv, D]."""
    n, num_heads, _ = q.shape
    length, num_kv_heads, _ = keys.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(n):
        visible = length - n + j + 1
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            scores = keys[:visible, kv].double() @ q[j, h].double() * scale
            weights = torch.exp(scores - scores.max())
            out[j, h] = weights @ values[:visible, kv].double() / weights.sum()
    return out
