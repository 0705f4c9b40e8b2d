"""The model runner: packs a step's chunks, pads them to the plan's bucket, plans attention, runs forward.

The same runner serves the eager reference (forward = the model itself, no padding) and the
compiled model (forward = the CompiledModel, padded to decode batch or prefill token buckets).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphkiln.compiler.plan import GraphPlan
from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.models.transformer import CausalLM

from .attention.metadata import SequenceSlice, build_metadata, pad_decode
from .attention.sdpa import SdpaBackend
from .kv_cache import KVCache
from .scheduler import ScheduledChunk

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_decode(chunks: list[ScheduledChunk]) -> bool:
    """A pure decode step: one new token per sequence, each continuing a cached context."""
    return all(c.num_tokens == 1 and c.seq.num_computed > 0 for c in chunks)


def padded_size(num_tokens: int, plan: GraphPlan | None) -> int:
    """Pad to the plan's smallest bucket that holds the batch; beyond the largest, run unpadded."""
    bucket = plan.bucket(num_tokens) if plan else None
    return bucket or num_tokens


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_cache: KVCache, forward: Forward | None = None, plans: dict[str, GraphPlan] | None = None
    ) -> None:
        self.model = model
        self.forward = forward or model
        self.plans = plans or {}
        self.kv_cache = kv_cache
        self.backend = SdpaBackend(kv_cache)
        self.device = kv_cache.keys.device

    def hidden_states(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Hidden states [T, hidden] of every scheduled token, in chunk order (padding dropped)."""
        ids: list[int] = []
        positions: list[int] = []
        slices = []
        for c in chunks:
            start = c.seq.num_computed
            ids += c.seq.tokens[start : start + c.num_tokens]
            positions += range(start, start + c.num_tokens)
            slices.append(SequenceSlice(c.num_tokens, start + c.num_tokens, tuple(c.seq.blocks)))
        num_tokens = len(ids)
        decode = is_decode(chunks)
        size = padded_size(num_tokens, self.plans.get("decode" if decode else "prefill"))
        pad = [0] * (size - num_tokens)
        if decode:
            slices = pad_decode(slices, size)
        meta = build_metadata(slices, self.kv_cache.block_size, size, self.device)
        input_ids = torch.tensor(ids + pad, dtype=torch.int64).to(self.device)
        pos = torch.tensor(positions + pad, dtype=torch.int64).to(self.device)
        with torch.inference_mode(), forward_context(ForwardContext(self.backend.plan(meta))):
            return self.forward(input_ids, pos)[:num_tokens]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.compute_logits(hidden).float()
