"""Assemble an engine from a loaded model and, optionally, its compiled form."""

from __future__ import annotations

import logging

from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.compiler.counters import Counters
from graphkiln.models.transformer import CausalLM

from .attention.select import select_backend
from .cuda_graph import DecodeGraphs
from .engine import Engine
from .kv_cache import BlockAllocator, KVCache
from .memory import kv_cache_blocks
from .runner import ModelRunner
from .scheduler import Scheduler

log = logging.getLogger("graphkiln.runtime")


def build_engine(
    model: CausalLM,
    compiled: CompiledModel | None = None,
    *,
    attention_backend: str = "auto",
    cuda_graphs: bool = True,
    max_seq_len: int | None = None,
    block_size: int = 16,
    kv_cache_tokens: int | None = None,
    gpu_memory_fraction: float = 0.9,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
) -> Engine:
    """Eager when `compiled` is None; with it, compiled pieces and, on CUDA, decode CUDA graphs."""
    cfg = model.cfg
    max_context = min(cfg.max_context, max_seq_len or cfg.max_context)
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    num_blocks = kv_cache_blocks(cfg, dtype, device, block_size, kv_cache_tokens, gpu_memory_fraction)
    kv = KVCache(cfg, num_blocks, block_size, dtype, device)
    log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, block_size, kv.nbytes / 2**20)
    backend = select_backend(attention_backend, kv)
    graphs = None
    if compiled is not None and cuda_graphs and device.type == "cuda" and backend.capturable:
        sizes = tuple(s for s in compiled.plans["decode"].sizes if s <= max_num_seqs)
        max_blocks = -(-max_context // block_size)
        graphs = DecodeGraphs(compiled, model, backend, sizes, block_size, max_blocks, Counters())
        stats = graphs.capture()
        log.info("captured %d decode graphs in %.2f s, pool %.1f MiB", stats.graphs, stats.seconds, stats.pool_bytes / 2**20)
    plans = compiled.plans if compiled is not None else None
    runner = ModelRunner(model, kv, backend, compiled, plans, graphs)
    scheduler = Scheduler(BlockAllocator(num_blocks, block_size), max_context, max_num_batched_tokens, max_num_seqs)
    return Engine(runner, scheduler, cfg.eos_token_ids, cfg.vocab_size)
