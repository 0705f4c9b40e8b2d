"""The one decoder implementation for Llama, Mistral, Qwen2 and Qwen3, read top to bottom.

Tokens of all sequences in a batch are packed along one dimension (no padding, no batch dim):
`forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]`. q/k/v and gate/up are
fused projections; the loader fills their slices from the separate checkpoint tensors.
Built for one rank of a tensor-parallel group (`Shard`), the layers hold that rank's heads and MLP
width and sum the o and down projections over the ranks (models/sharding.py); at one rank no
collective is traced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention
from .config import ModelConfig
from .linear import linear
from .rope import rope
from .sharding import Shard, VocabParallelEmbedding, gather_vocab, local_config, reduce_across


class RMSNorm(nn.Module):
    """Normalizes in float32 and casts back before scaling, exactly as transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, shard: Shard) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.layer_index = layer_index
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope_table: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        tokens = x.shape[0]
        heads = cfg.num_heads + cfg.num_kv_heads
        qk, v = self.qkv_proj(x).split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = qk.view(tokens, heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = rope(qk, rope_table, positions).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        out = q.new_empty(tokens, cfg.num_heads, cfg.head_dim)
        attention(q, k, v, out, self.layer_index, self.scale)
        return reduce_across(self.o_proj(out.view(tokens, cfg.q_size)), self.shard)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return reduce_across(self.down_proj(F.silu(gate) * up), self.shard)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope_table: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope_table)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Embedding):
    """nn.Embedding that draws no initial values on the meta device, where a model is built before its
    weights are read: a meta `normal_` runs torch's Python reference, which imports Dynamo."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard) -> None:
        super().__init__()
        if shard.parallel:
            self.embed_tokens = VocabParallelEmbedding(cfg, shard)
        else:
            self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        local = local_config(cfg, shard.size)
        self.layers = nn.ModuleList(DecoderLayer(local, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("rope_cache", torch.empty(cfg.max_context, 2 * cfg.head_dim), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope_cache)
        return self.norm(x)


class CausalLM(nn.Module):
    """Decoder plus LM head. `forward` returns hidden states; `compute_logits` maps chosen rows to logits
    (of the whole vocabulary on every rank). `cfg` is the whole model's config, also on one rank of several."""

    def __init__(self, cfg: ModelConfig, shard: Shard = Shard()) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.model = DecoderModel(cfg, shard)
        self.lm_head = nn.Linear(cfg.hidden_size, self.model.embed_tokens.weight.shape[0], bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_vocab(linear(hidden, self.lm_head.weight), self.cfg, self.shard)
