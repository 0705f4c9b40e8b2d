"""Assemble an engine from a loaded model, optionally its compiled form, and an EngineConfig: the one path
`load`, `LLM.eager` and `LLM.compile` build engines through."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.kernels.launch import builds_ahead
from graphkiln.models.sharding import local_config
from graphkiln.models.switch_interval import load_switch_interval
from graphkiln.models.transformer import CausalLM

from .attention.select import select_backend
from .config import EngineConfig
from .decode_graphs import DecodeGraphs
from .engine import Engine
from .graphs import CaptureSetup, GraphPool, capture_all
from .kernel_builds import KernelBuildsJob
from .kv_cache import BlockAllocator
from .kv_dtype import cache_dtype
from .lockstep import Lockstep
from .memory import allocate_kv_cache, kv_cache_blocks
from .prefill_graphs import PiecewisePrefillGraphs, PrefillGraphs
from .preparation import Job, PiecesJob, Preparation, WarmupJob
from .runner import ModelRunner, Padding
from .scheduler import Scheduler
from .step_lock import StepLock
from .warmup import first_call_sizes, first_calls, warmup_jobs

if TYPE_CHECKING:
    from .tensor_parallel import Peers

log = logging.getLogger("graphkiln.runtime")
EAGER_GRAPH_MAX_BATCH = 8  # the eager model's decode graph, served while the pieces load: the first seconds' batches
EAGER_GRAPH_MAX_TOKENS = 512  # and its prefill graph: the first seconds' prompts, padded to it


def build_engine(
    model: CausalLM,
    compiled: CompiledModel | None = None,
    config: EngineConfig | None = None,
    peers: Peers | None = None,
    lockstep: Lockstep | None = None,
    pieces: Callable[[], CompiledModel] | None = None,
) -> Engine:
    """Eager when `compiled` is None; with it, compiled pieces and, on CUDA, CUDA graphs: whole for
    decode, and for prefill where the attention backend can capture it (piecewise otherwise). The
    graphs (without them, warm-up runs) are prepared as `config.capture` says: in the background
    (the engine serves meanwhile) or before this returns. On a rank of a tensor-parallel group they
    are not started here: rank 0 (`peers`: the other ranks, which follow every step) starts them once
    every rank has built its engine (`prepare`), and each rank runs them together (`lockstep`).
    `pieces` (with `compiled` None) loads the compiled model later: the engine serves eagerly until the first
    background job has loaded it and switched the runner over, then prepares its graphs; on CUDA the eager
    model's decode step of the first seconds' batches and its prefill of their prompts are captured here first
    (`_eager_graphs`)."""
    config = config or EngineConfig()
    cfg = model.cfg
    max_context = min(cfg.max_context, config.max_seq_len or cfg.max_context)
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    layers = local_config(cfg, model.shard.size)  # this rank's KV heads
    kv_dtype = cache_dtype(config.kv_cache_dtype, dtype)
    num_blocks = kv_cache_blocks(layers, kv_dtype, device, config)
    kv = allocate_kv_cache(layers, num_blocks, config.block_size, kv_dtype, device)
    log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, config.block_size, kv.nbytes / 2**20)
    backend = select_backend(config.attention_backend, kv, config.decode_kernel)
    allocator = BlockAllocator(num_blocks, config.block_size)
    compiling = compiled is not None or pieces is not None  # (pieces: served eagerly until they are in)
    padding = Padding(*config.reachable_sizes()) if compiling else None  # capture sizes
    runner = ModelRunner(model, kv, backend, padding=padding, peers=peers)
    max_blocks = -(-max_context // config.block_size)
    use = partial(_use_compiled, runner, config, max_blocks, allocator.capacity)
    jobs: list[Job] = []
    if compiled is not None:
        jobs = use(compiled)
    elif pieces is not None:
        sizes = (*first_call_sizes(config), max_blocks)
        eager = [] if model.shard.parallel else _eager_graphs(runner, config, max_blocks, allocator.capacity)
        with torch.inference_mode():
            first_calls(runner, *sizes)
            if eager:  # kernels the first calls did not build, built at once
                KernelBuildsJob([step for strategy in eager for step in strategy.dry_steps()]).run()
                capture_all([job for strategy in eager for job in strategy.jobs()])
            for strategy in eager:
                if isinstance(strategy, DecodeGraphs):
                    runner.eager_graphs = strategy
                else:
                    runner.eager_prefill_graphs = strategy
        jobs = [PiecesJob(partial(_first_called, pieces, runner, sizes), use)]
    scheduler = Scheduler(allocator, max_context, config.max_num_batched_tokens, config.max_num_seqs)
    lock = StepLock()
    preparation = Preparation(jobs, lock, device, lockstep, load_switch_interval())
    engine = Engine(runner, scheduler, cfg.eos_token_ids, cfg.vocab_size, config, lock, preparation)
    if not model.shard.parallel:
        prepare(engine, config)
    return engine


def prepare(engine: Engine, config: EngineConfig) -> None:
    """Start the engine's preparation: in the background, or all of it now (the kernels' builds, then the
    captures largest first: smaller graphs reuse the pool's memory)."""
    preparation = engine.preparation
    if not preparation.jobs:
        preparation.skip()
    elif config.capture == "blocking":
        builds = [job for job in preparation.jobs if isinstance(job, KernelBuildsJob)]
        preparation.jobs = builds + [job for job in reversed(preparation.jobs) if job not in builds]
        preparation.run_now()
        log.info("prepared %d buckets in %.2f s", preparation.planned, sum(d.seconds for d in preparation.done))
    else:
        preparation.start()


def _first_called(pieces: Callable[[], CompiledModel], runner: ModelRunner, sizes: tuple[tuple[int, ...], int, int]
                  ) -> CompiledModel:  # fmt: skip
    """The compiled model `pieces` loads, after its first calls where the attention backend lets them run beside
    the eager steps (off the step lock)."""
    compiled = pieces()
    if runner.backend.concurrent_plans:
        if runner.device.type == "cuda":
            with builds_ahead():  # the kernels they launch, built at once (kernels/launch.py)
                first_calls(runner, *sizes, forward=compiled)
        first_calls(runner, *sizes, forward=compiled)
    return compiled


def _decode_sizes(config: EngineConfig, capacity: int) -> tuple[int, ...]:
    return tuple(s for s in config.reachable_sizes()[0] if s <= capacity)


def _eager_graphs(runner: ModelRunner, config: EngineConfig, max_blocks: int, capacity: int
                  ) -> list[DecodeGraphs | PrefillGraphs]:  # fmt: skip
    """Where the backend can capture them: the eager model's decode step of the largest decode bucket of up to
    EAGER_GRAPH_MAX_BATCH rows, as a graph ending at the logits (sampled after each replay), and its prefill of
    the largest prefill bucket of up to EAGER_GRAPH_MAX_TOKENS tokens, for `build_engine` to capture before it
    returns; smaller batches replay them padded. While the pieces load beside the steps (Inductor's import:
    seconds of Python), an eager step's hundreds of ops each hand the interpreter lock to that job and wait to
    get it back, where a replay takes it once; captured in the background, a graph would hold the step lock for
    one eager forward (tens of milliseconds on an 8B-like model), which a step arriving then waits for. Each
    serves until the compiled model's graphs of its kind are captured (`_graphs`)."""
    if not (config.cuda_graphs and runner.device.type == "cuda"):
        return []
    setup = CaptureSetup(GraphPool(), runner.backend, config.block_size, max_blocks, runner.device)
    graphs: list[DecodeGraphs | PrefillGraphs] = []
    sizes = [s for s in _decode_sizes(config, capacity) if s <= EAGER_GRAPH_MAX_BATCH]
    if sizes and runner.backend.capturable_decode:
        graphs.append(DecodeGraphs(setup, (sizes[-1],), runner.model, runner.model.compute_logits,
                                   sampler_inside=False))  # fmt: skip
    tokens = [s for s in _prefill_sizes(config) if s <= EAGER_GRAPH_MAX_TOKENS]
    if tokens and runner.backend.capturable_prefill:
        graphs.append(PrefillGraphs(setup, (tokens[-1],), runner.model, config.max_num_seqs))
    return graphs


def _prefill_sizes(config: EngineConfig) -> tuple[int, ...]:
    return config.reachable_sizes()[1]


def _use_compiled(runner: ModelRunner, config: EngineConfig, max_blocks: int, capacity: int,
                  compiled: CompiledModel) -> list[Job]:  # fmt: skip
    """Make the runner run `compiled`; return the jobs that capture its graphs (on CUDA) or warm each bucket up."""
    runner.forward = compiled
    prefill_sizes = _prefill_sizes(config)
    decode_sizes = _decode_sizes(config, capacity)
    if config.cuda_graphs and runner.device.type == "cuda":
        return _graphs(runner, compiled, config, max_blocks, prefill_sizes, decode_sizes)
    return list(warmup_jobs(runner, decode_sizes, prefill_sizes, max_blocks))


def _graphs(runner: ModelRunner, compiled: CompiledModel, config: EngineConfig, max_blocks: int,
            prefill_sizes: tuple[int, ...], decode_sizes: tuple[int, ...]) -> list[Job]:  # fmt: skip
    """The graph strategies, in one pool, and their jobs: the kernels' builds (kernel_builds.py), then the
    captures of decode buckets (a step's most common kind) and of prefill buckets, each smallest first. Where
    the eager model's graphs serve the first steps meanwhile, the prefill buckets come first (a prompt longer
    than the eager prefill graph's runs the model's every op from Python: tens of milliseconds on an 8B-like
    model, more beside a job), and each eager graph is released once the compiled model's of its kind are in."""
    setup = CaptureSetup(GraphPool(), runner.backend, config.block_size, max_blocks, runner.device)
    split_at_attention = any(attn for _, attn in compiled.split.submodules)
    if prefill_sizes and runner.backend.capturable_prefill:
        runner.prefill_graphs = PrefillGraphs(setup, prefill_sizes, compiled, config.max_num_seqs)
    elif prefill_sizes and split_at_attention:
        runner.prefill_graphs = PiecewisePrefillGraphs(setup, prefill_sizes, compiled, config.max_num_seqs)
    if runner.backend.capturable_decode and decode_sizes:
        runner.decode_graphs = DecodeGraphs(setup, decode_sizes, compiled, runner.model.compute_logits)
    strategies = [strategy for strategy in (runner.decode_graphs, runner.prefill_graphs) if strategy]
    eager = {"decode": runner.eager_graphs, "prefill": runner.eager_prefill_graphs}
    if any(eager.values()):
        strategies.reverse()
    captures: list[Job] = []
    for strategy in strategies:
        captures += strategy.jobs()
        kind = "decode" if strategy is runner.decode_graphs else "prefill"
        if eager[kind] is not None:  # replayed until the compiled model's graphs of its kind are all captured
            captures.append(WarmupJob(kind, "eager graph released", partial(runner.release_eager_graphs, kind)))
    if not captures or not runner.backend.concurrent_plans:  # (the builds' dry steps plan off the step lock)
        return captures
    dry = [strategy for strategy in strategies if isinstance(strategy, (DecodeGraphs, PrefillGraphs))]
    return [KernelBuildsJob([step for strategy in dry for step in strategy.dry_steps()]), *captures]
