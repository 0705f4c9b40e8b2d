"""Assemble an engine from a loaded model and, optionally, its compiled form."""

from __future__ import annotations

import logging

import torch

from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.compiler.counters import Counters
from graphkiln.models.transformer import CausalLM

from .attention.select import select_backend
from .cuda_graph import CaptureStats, DecodeGraphs
from .engine import Engine
from .kv_cache import BlockAllocator, KVCache
from .memory import kv_cache_blocks
from .piecewise_graph import PiecewiseGraphs
from .prefill_graph import PrefillGraphs
from .runner import ModelRunner
from .scheduler import Scheduler

log = logging.getLogger("graphkiln.runtime")


def _log_capture(kind: str, stats: CaptureStats) -> None:
    log.info("captured %d %s graphs in %.2f s, pool %.1f MiB", stats.graphs, kind, stats.seconds, stats.pool_bytes / 2**20)


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
    """Eager when `compiled` is None; with it, compiled pieces and, on CUDA, CUDA graphs: whole for
    decode, and for prefill where the attention backend can capture it (piecewise otherwise)."""
    cfg = model.cfg
    max_context = min(cfg.max_context, max_seq_len or cfg.max_context)
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    num_blocks = kv_cache_blocks(cfg, dtype, device, block_size, kv_cache_tokens, gpu_memory_fraction)
    kv = KVCache(cfg, num_blocks, block_size, dtype, device)
    log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, block_size, kv.nbytes / 2**20)
    backend = select_backend(attention_backend, kv)
    graphs = prefill_graphs = None
    counters = Counters()
    if compiled is not None and cuda_graphs and device.type == "cuda":
        pool = torch.cuda.graph_pool_handle()
        max_blocks = -(-max_context // block_size)
        prefill_sizes = tuple(s for s in compiled.plans["prefill"].sizes if s <= max_num_batched_tokens)
        split_at_attention = any(attn for _, attn in compiled.split.submodules)
        if prefill_sizes and backend.capturable_prefill:
            prefill_graphs = PrefillGraphs(
                compiled, backend, prefill_sizes, block_size, max_num_seqs, max_blocks, counters, pool, device
            )
            _log_capture("prefill full", prefill_graphs.capture())
        elif prefill_sizes and split_at_attention:
            prefill_graphs = PiecewiseGraphs(compiled, backend, prefill_sizes, block_size, counters, pool)
            _log_capture("prefill piecewise", prefill_graphs.capture())
        decode_sizes = tuple(s for s in compiled.plans["decode"].sizes if s <= max_num_seqs)
        if backend.capturable_decode and decode_sizes:
            graphs = DecodeGraphs(compiled, model, backend, decode_sizes, block_size, max_blocks, counters, pool)
            _log_capture("decode full", graphs.capture())
    plans = compiled.plans if compiled is not None else None
    runner = ModelRunner(model, kv, backend, compiled, plans, graphs, prefill_graphs, counters)
    scheduler = Scheduler(BlockAllocator(num_blocks, block_size), max_context, max_num_batched_tokens, max_num_seqs)
    return Engine(runner, scheduler, cfg.eos_token_ids, cfg.vocab_size)
