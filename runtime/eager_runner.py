"""The eager reference runner: packs a step's chunks, plans attention and calls the model directly."""

from __future__ import annotations

import torch

from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.models.transformer import CausalLM

from .attention.metadata import SequenceSlice, build_metadata
from .attention.sdpa import SdpaBackend
from .kv_cache import KVCache
from .scheduler import ScheduledChunk


class EagerRunner:
    """Runs a batch of scheduled chunks through the model without compiling anything."""

    def __init__(self, model: CausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = SdpaBackend(kv_cache)
        self.device = kv_cache.keys.device

    def hidden_states(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Hidden states [T, hidden] of every scheduled token, in chunk order."""
        ids: list[int] = []
        positions: list[int] = []
        slices = []
        for c in chunks:
            start = c.seq.num_computed
            ids += c.seq.tokens[start : start + c.num_tokens]
            positions += range(start, start + c.num_tokens)
            slices.append(SequenceSlice(c.num_tokens, start + c.num_tokens, tuple(c.seq.blocks)))
        meta = build_metadata(slices, self.kv_cache.block_size, len(ids), self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device)
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device)
        with torch.inference_mode(), forward_context(ForwardContext(self.backend.plan(meta))):
            return self.model(input_ids, pos)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.compute_logits(hidden).float()
