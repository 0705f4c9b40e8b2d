"""Assemble an engine from a loaded model, optionally its compiled form, and an EngineConfig: the one path
`load`, `LLM.eager` and `LLM.compile` build engines through."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.models.sharding import local_config
from graphkiln.models.transformer import CausalLM

from .attention.select import select_backend
from .config import EngineConfig
from .decode_graphs import DecodeGraphs
from .engine import Engine
from .graphs import CaptureSetup, GraphPool, GraphSet
from .kv_cache import BlockAllocator
from .memory import allocate_kv_cache, kv_cache_blocks
from .prefill_graphs import PiecewisePrefillGraphs, PrefillGraphs
from .runner import ModelRunner, Padding
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .tensor_parallel import Peers

log = logging.getLogger("graphkiln.runtime")


def _log_capture(graphs: GraphSet) -> None:
    s = graphs.stats
    log.info("captured %d %s graphs in %.2f s, pool %.1f MiB", s.graphs, graphs.kind, s.seconds, s.pool_bytes / 2**20)


def build_engine(
    model: CausalLM,
    compiled: CompiledModel | None = None,
    config: EngineConfig | None = None,
    peers: Peers | None = None,
) -> Engine:
    """Eager when `compiled` is None; with it, compiled pieces and, on CUDA, CUDA graphs: whole for
    decode, and for prefill where the attention backend can capture it (piecewise otherwise). `peers`:
    the other ranks of a tensor-parallel group, which follow every step (no CUDA graphs yet)."""
    config = config or EngineConfig()
    cfg = model.cfg
    max_context = min(cfg.max_context, config.max_seq_len or cfg.max_context)
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    layers = local_config(cfg, model.shard.size)  # this rank's KV heads
    num_blocks = kv_cache_blocks(layers, dtype, device, config)
    kv = allocate_kv_cache(layers, num_blocks, config.block_size, dtype, device)
    log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, config.block_size, kv.nbytes / 2**20)
    backend = select_backend(config.attention_backend, kv)
    allocator = BlockAllocator(num_blocks, config.block_size)
    padding = Padding(config.decode_batch_sizes, config.prefill_token_buckets) if compiled is not None else None
    runner = ModelRunner(model, kv, backend, forward=compiled, padding=padding, peers=peers)
    if compiled is not None and config.cuda_graphs and device.type == "cuda" and not model.shard.parallel:
        _capture(runner, compiled, config, max_context, allocator.capacity)
    scheduler = Scheduler(allocator, max_context, config.max_num_batched_tokens, config.max_num_seqs)
    return Engine(runner, scheduler, cfg.eos_token_ids, cfg.vocab_size, config)


def _capture(runner: ModelRunner, compiled: CompiledModel, config: EngineConfig, max_context: int, blocks: int) -> None:
    """Capture the prefill graphs, then the decode graphs, into one pool (decode sizes a step can reach only)."""
    setup = CaptureSetup(GraphPool(), runner.backend, config.block_size, -(-max_context // config.block_size),
                         runner.device)  # fmt: skip
    prefill_sizes = tuple(s for s in config.prefill_token_buckets if s <= config.max_num_batched_tokens)
    split_at_attention = any(attn for _, attn in compiled.split.submodules)
    if prefill_sizes and runner.backend.capturable_prefill:
        runner.prefill_graphs = PrefillGraphs(setup, prefill_sizes, compiled, config.max_num_seqs)
    elif prefill_sizes and split_at_attention:
        runner.prefill_graphs = PiecewisePrefillGraphs(setup, prefill_sizes, compiled, config.max_num_seqs)
    if runner.prefill_graphs is not None:
        runner.prefill_graphs.capture()
        _log_capture(runner.prefill_graphs.graphs)
    decode_sizes = tuple(s for s in config.decode_batch_sizes if s <= min(config.max_num_seqs, blocks))
    if runner.backend.capturable_decode and decode_sizes:
        runner.decode_graphs = DecodeGraphs(setup, decode_sizes, compiled, runner.model.compute_logits)
        runner.decode_graphs.capture()
        _log_capture(runner.decode_graphs.graphs)
