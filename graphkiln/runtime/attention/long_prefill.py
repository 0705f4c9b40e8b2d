"""Two backends in one engine: long prefill steps on one, every other step on the other.

On Hopper, FlashInfer's "fa3" prefill kernels ran paged causal prefill faster than graphkiln's
Triton kernel at every shape measured of 2048 query tokens or more (fresh prompts, chunks over up
to 32k tokens of context), while Triton's decode was the faster one and its prefill can be
captured in CUDA graphs (README, "Attention at serving shapes"). The "triton+flashinfer" backend
serves each step with the one that measured faster: a prefill or mixed step whose attention work
(metadata.attention_work: query tokens x context tokens, summed over its sequences) reaches
LONG_PREFILL_WORK runs on FlashInfer, every other step on Triton.

FlashInfer's prefill plans on the host each step and cannot be captured, so the runner runs such a
step outside the prefill graphs (`eager_prefill_work`), as it runs a step larger than the largest
bucket, and marks its metadata `long_prefill`; a step of that much attention keeps the GPU busy for
milliseconds, which hides its launches. Only the runner's own steps are marked, never a warm-up, a
dry step or a capture, and the step lock runs those steps one at a time: FlashInfer's wrapper, which
holds its last plan, is never planned by two threads at once, so the pair plans concurrently where
Triton does.
"""

from __future__ import annotations

import torch

from graphkiln.errors import ConfigError
from graphkiln.models.attention import AttentionFn
from graphkiln.runtime.kv_cache import KVCache

from .base import AttentionBackend
from .metadata import BatchMetadata

NAME = "triton+flashinfer"
LONG_PREFILL_WORK = 4096 * 4096  # one fresh 4096-token prompt's work; less was no faster in whole prefills (README)


class LongPrefillBackend:
    """`short`'s kernels for every step but those the runner marks `long_prefill` (prefill steps of at least
    `min_work`, `attention_work`, run outside its graphs): those are `long`'s."""

    def __init__(self, short: AttentionBackend, long: AttentionBackend, min_work: int) -> None:
        self.name = f"{short.name}+{long.name}"
        self.capturable_decode = short.capturable_decode
        self.capturable_prefill = short.capturable_prefill
        self.concurrent_plans = short.concurrent_plans  # long plans marked steps only (module docstring)
        self.prompt_lengths = short.prompt_lengths
        self.eager_prefill_work = min_work
        self.short, self.long = short, long

    def release(self) -> None:
        self.short.release()
        self.long.release()

    def plan(self, meta: BatchMetadata) -> AttentionFn:
        return self.long.plan(meta) if meta.long_prefill else self.short.plan(meta)


def triton_with_flashinfer(kv_cache: KVCache, decode_kernel: str) -> LongPrefillBackend:
    """The "triton+flashinfer" backend for this cache, FlashInfer's prefill kernels built (or loaded) already.
    Only where FlashInfer runs fa3: its fa2 kernels were slower than Triton's at every prefill measured."""
    from .flashinfer_backend import FlashInferBackend, prefill_kernels
    from .triton_backend import TritonBackend

    capability = torch.cuda.get_device_capability(kv_cache.keys.device)
    if prefill_kernels(capability) != "fa3":
        raise ConfigError(
            f"attention backend {NAME!r} runs long prefills on FlashInfer's Hopper kernels (compute capability 9.x); "
            f"this GPU has {capability[0]}.{capability[1]}, where FlashInfer's prefill is slower than Triton's: "
            "use 'triton'"
        )
    long = FlashInferBackend(kv_cache)
    long.build_prefill_kernels()
    return LongPrefillBackend(TritonBackend(kv_cache, decode_kernel), long, LONG_PREFILL_WORK)
