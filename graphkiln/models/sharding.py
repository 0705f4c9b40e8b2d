"""Megatron-style tensor parallel: which slice of each checkpoint tensor a rank holds, and the collectives.

q/k/v and gate/up are split by output rows (column parallel), o and down by input columns (row
parallel, their outputs summed across ranks), the embedding and the LM head by vocabulary rows
(the vocabulary padded to a multiple of the ranks). KV heads fewer than ranks are replicated: each
group of `size // num_kv_heads` ranks holds one KV head, as vLLM does. A row-parallel bias is held
by rank 0 alone (zeros elsewhere), so the sum adds it once. Every rank's module has the same
shapes, and the vocabulary offset is a buffer, so every rank traces the same graph. A quantized
checkpoint's tensors are sliced per format (quantized_shards.py).

The collectives are functional collectives on the default process group (`graphkiln.compat`), so a
Dynamo trace keeps them as graph ops that Inductor compiles with the pieces around them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphkiln.compat import all_gather_last_dim, all_reduce_sum
from graphkiln.errors import UnsupportedModelError

from .config import ModelConfig

Part = tuple[int, int, int]  # (dim, start, stop) of a checkpoint tensor


@dataclass(frozen=True)
class Shard:
    """This process's rank among `size` tensor-parallel ranks; Shard() is the single-rank model."""

    rank: int = 0
    size: int = 1

    @property
    def parallel(self) -> bool:
        return self.size > 1


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Heads, KV heads and the MLP width must split evenly over `size` ranks (KV heads may be replicated)."""
    kv = cfg.num_kv_heads
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if (kv % size) if kv >= size else (size % kv):
        problems.append(f"num_key_value_heads={kv}")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if problems:
        raise UnsupportedModelError(
            f"{cfg.architecture}: {', '.join(problems)} cannot be split over tensor_parallel_size={size} "
            "(heads and the MLP width must be multiples of it; KV heads a multiple or a divisor); "
            "pick a tensor-parallel size that divides them"
        )


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The per-rank shapes of the layers: heads, KV heads and MLP width divided by `size`."""
    if size == 1:
        return cfg
    check_shardable(cfg, size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,
    )


def vocab_rows(cfg: ModelConfig, size: int) -> int:
    """Embedding and LM-head rows per rank: the vocabulary padded to a multiple of `size`, divided."""
    return -(-cfg.vocab_size // size)


def checkpoint_part(cfg: ModelConfig, shard: Shard, name: str) -> Part | None:
    """Which part of checkpoint tensor `name` this rank holds; None: all of it (replicated, or one rank)."""
    if not shard.parallel:
        return None
    local = local_config(cfg, shard.size)
    module, kind = name.split(".")[-2:]
    rows = {
        "q_proj": (shard.rank * local.q_size, local.q_size),
        "k_proj": (_kv_head(cfg, shard) * cfg.head_dim, local.kv_size),
        "v_proj": (_kv_head(cfg, shard) * cfg.head_dim, local.kv_size),
        "gate_proj": (shard.rank * local.intermediate_size, local.intermediate_size),
        "up_proj": (shard.rank * local.intermediate_size, local.intermediate_size),
    }
    if module in rows:
        start, length = rows[module]
        return 0, start, start + length
    if module in ("o_proj", "down_proj") and kind == "weight":
        length = local.q_size if module == "o_proj" else local.intermediate_size
        return 1, shard.rank * length, (shard.rank + 1) * length
    if module in ("embed_tokens", "lm_head"):
        per_rank = vocab_rows(cfg, shard.size)
        return 0, min(shard.rank * per_rank, cfg.vocab_size), min((shard.rank + 1) * per_rank, cfg.vocab_size)
    return None


def held_by_rank0_only(name: str) -> bool:
    """A row-parallel bias: added once, after the sum over ranks."""
    return name.endswith(("o_proj.bias", "down_proj.bias"))


def _kv_head(cfg: ModelConfig, shard: Shard) -> int:
    """The first KV head of this rank (replicated: the one head its group of ranks shares)."""
    if cfg.num_kv_heads >= shard.size:
        return shard.rank * (cfg.num_kv_heads // shard.size)
    return shard.rank // (shard.size // cfg.num_kv_heads)


def read_part(f, name: str, part: Part | None) -> torch.Tensor:
    """Tensor `name` of an open safetensors file, or only `part` of it: a slice read, never the whole tensor."""
    if part is None:
        return f.get_tensor(name)
    dim, start, stop = part
    view = f.get_slice(name)
    return view[start:stop] if dim == 0 else view[:, start:stop]


def reduce_across(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The sum over ranks of a row-parallel output (nothing at one rank)."""
    return all_reduce_sum(x) if shard.parallel else x


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding: ids outside them look up zeros, and the ranks' lookups are summed."""

    def __init__(self, cfg: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.rows = vocab_rows(cfg, shard.size)
        self.weight = nn.Parameter(torch.empty(self.rows, cfg.hidden_size))
        start = torch.tensor(shard.rank * self.rows, dtype=torch.int64)
        self.register_buffer("vocab_start", start, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.rows)
        x = F.embedding(torch.where(inside, local, 0), self.weight)
        return all_reduce_sum(x * inside.unsqueeze(-1).to(x.dtype))


def gather_vocab(logits: torch.Tensor, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """The full vocabulary's logits from every rank's rows (padding dropped)."""
    if not shard.parallel:
        return logits
    return all_gather_last_dim(logits.contiguous())[:, : cfg.vocab_size]
