"""Assemble an engine from a loaded model and, optionally, its compiled form."""

from __future__ import annotations

from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.models.transformer import CausalLM

from .engine import Engine
from .kv_cache import BlockAllocator, KVCache
from .memory import kv_cache_blocks
from .runner import ModelRunner
from .scheduler import Scheduler


def build_engine(
    model: CausalLM,
    compiled: CompiledModel | None = None,
    *,
    block_size: int = 16,
    kv_cache_tokens: int | None = None,
    gpu_memory_fraction: float = 0.9,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
) -> Engine:
    cfg = model.cfg
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    num_blocks = kv_cache_blocks(cfg, dtype, device, block_size, kv_cache_tokens, gpu_memory_fraction)
    kv = KVCache(cfg, num_blocks, block_size, dtype, device)
    if compiled is None:
        runner = ModelRunner(model, kv)
    else:
        runner = ModelRunner(model, kv, compiled, compiled.plans)
    scheduler = Scheduler(BlockAllocator(num_blocks, block_size), cfg.max_context, max_num_batched_tokens, max_num_seqs)
    return Engine(runner, scheduler, cfg.eos_token_ids, cfg.vocab_size)

