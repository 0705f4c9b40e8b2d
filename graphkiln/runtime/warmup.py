"""Warm-up jobs for a compiled engine without CUDA graphs (the CPU, or `cuda_graphs=False`): each padded
size a step can run once on a dummy batch in the KV cache's dummy block, so the first request of
each size does not pay for the compiled code's first call. They are what the background
preparation (preparation.py) runs where there is nothing to capture. Prefill buckets larger than
the largest decode batch are left out: each job then costs at most a step of that batch, which is
what a request arriving meanwhile may wait."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from graphkiln.kernels.launch import builds_ahead
from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.models.kernel_loads import LAUNCH_ON
from graphkiln.models.weights_reader import indexed

from .attention.metadata import SequenceSlice, build_metadata
from .config import EngineConfig
from .kv_cache import DUMMY_BLOCK
from .preparation import WarmupJob
from .prefill_graphs import dummy_slices
from .runner import ModelRunner
from .sampler import MODES, SamplingTensors, sample

log = logging.getLogger("graphkiln.runtime")

SAMPLED_ROWS = 2  # the sampler's first calls: on more than one row, as a first step serving several requests
AHEAD_VOCAB_LIMIT = 1 << 22  # sampler_ahead: the widest row it allocates for a manifest not yet checked
FIRST_PROMPT_TOKENS = 64  # the first calls' prefill: a prompt this long or longer takes the prefill kernel's
# tallest tiles (runtime/attention/triton_backend.py), as most prompts do; a shorter one builds its own


def warmup_jobs(runner: ModelRunner, decode_sizes: tuple[int, ...], prefill_sizes: tuple[int, ...],
                max_blocks: int) -> list[WarmupJob]:  # fmt: skip
    """Decode sizes, then prefill sizes up to the largest decode size, each smallest first."""
    block = runner.kv_cache.block_size
    prefill_sizes = tuple(n for n in prefill_sizes if n <= max(decode_sizes, default=0))
    decode = [WarmupJob("decode-warmup", str(n), partial(_run, runner, _decode_slices(n), n)) for n in decode_sizes]
    prefill = [WarmupJob("prefill-warmup", str(n), partial(_run, runner, dummy_slices(n, block, max_blocks), n))
               for n in prefill_sizes]  # fmt: skip
    return decode + prefill


def first_call_sizes(config: EngineConfig) -> tuple[tuple[int, ...], int]:
    """The decode batch sizes and the prefill token count of an engine's first calls (`first_calls`)."""
    decode, prefill = config.reachable_sizes()
    return decode[:2], min(max(prefill[:1] + (FIRST_PROMPT_TOKENS,)), config.max_num_batched_tokens)


def first_calls(runner: ModelRunner, decode_sizes: tuple[int, ...], prefill_size: int, max_blocks: int,
                forward: Callable[..., torch.Tensor] | None = None) -> None:  # fmt: skip
    """A decode forward of `forward` (default: the runner's) at each of `decode_sizes` and one prefill forward,
    on dummy batches, now; for the runner's own forward also the logits and the sampler, in each mode, of
    SAMPLED_ROWS rows and of one (a single request's first token). Before the engine serves beside a background job, the
    model's kernels' first calls (launchers, lazy loading; the projections' GEMV at one row and cuBLAS at
    several) and the lazy imports they make happen here, not in a request's first step and not beside that
    job's imports (two threads importing the same modules can hand one of them a half-initialized module). The
    background job calls it for the compiled pieces, off the step lock, before the runner switches to them:
    their first calls then stall no step. On CUDA the runner's own first calls run once as builds first, on
    the builders' pool, with the attention kernels that prompts of other lengths launch (`prompt_lengths`):
    where Triton's cache lacks them (a first start after a compile) they build at once rather than one after
    another on this thread, and a short first prompt finds its kernel built too."""
    if forward is None and runner.device.type == "cuda":
        with builds_ahead():  # launches start builds instead of running (kernels/launch.py)
            for n in runner.backend.prompt_lengths:
                if n != prefill_size:
                    _run(runner, dummy_slices(n, runner.kv_cache.block_size, max_blocks), n)
            _calls(runner, decode_sizes, prefill_size, max_blocks, forward)
    _calls(runner, decode_sizes, prefill_size, max_blocks, forward)


def _calls(runner: ModelRunner, decode_sizes: tuple[int, ...], prefill_size: int, max_blocks: int,
           forward: Callable[..., torch.Tensor] | None) -> None:  # fmt: skip
    """`first_calls`' forwards, and for the runner's own forward its logits and sampler."""
    for n in decode_sizes:
        _run(runner, _decode_slices(n), n, forward)
    hidden = _run(runner, dummy_slices(prefill_size, runner.kv_cache.block_size, max_blocks), prefill_size, forward)
    if forward is None:
        for rows in sorted({1, min(SAMPLED_ROWS, hidden.shape[0])}):  # one row's LM head is our GEMV, more cuBLAS
            _sample_each_mode(runner.model.compute_logits(hidden[:rows]).float())


def sampler_first_calls(vocab_size: int, device: torch.device) -> None:
    """The sampler's first calls of `first_calls`, on zero logits `vocab_size` wide on `device` (with its index),
    where it is of LAUNCH_ON: there they load the sampler's kernels (lazy loading; the sort and top-k of a
    vocabulary-wide row among them), which needs no model, so `load` runs them on a thread of their own while it
    checks the artifact and reads the weights (`sampler_ahead`). A failure is logged, not raised: the engine's
    first calls then load what these did not."""
    if device.type not in LAUNCH_ON:
        return
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with torch.inference_mode():
            for rows in sorted({1, SAMPLED_ROWS}):
                _sample_each_mode(torch.zeros(rows, vocab_size, device=device))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    except Exception as e:  # noqa: BLE001  (an optimisation: the load goes on without it)
        log.warning("the sampler's first calls ahead of the model failed (%s: %s); the engine's first calls make "
                    "them instead", type(e).__name__, e)


def sampler_ahead(manifest: dict, device: str | None) -> Callable[[], None] | None:
    """`sampler_first_calls` for the model an artifact's manifest names, to start before the load has checked the
    artifact or built the model; None where the manifest, not yet checked, names no vocabulary size up to
    AHEAD_VOCAB_LIMIT or no device of LAUNCH_ON, or one the caller's `device` or the machine rules out (the
    checks then say what is wrong). A bare "cuda" becomes the device a model built now would be on (`indexed`, which
    leaves CUDA uninitialised: the thread may initialise it while the checks run)."""
    try:
        vocab_size = int(manifest["model"]["config"]["vocab_size"])
        recorded = torch.device(manifest["config"]["device"])
        asked = torch.device(device) if device is not None else recorded
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None
    if recorded.type not in LAUNCH_ON or asked.type != recorded.type or not 0 < vocab_size <= AHEAD_VOCAB_LIMIT:
        return None
    if recorded.type == "cuda" and not torch.cuda.is_available():
        return None
    return partial(sampler_first_calls, vocab_size, indexed(recorded))


def _sample_each_mode(logits: torch.Tensor) -> None:
    """Sample `logits` once in each mode: a mode's first call loads its kernels, which beside the steps of a
    background job would stall them."""
    for mode in MODES:
        sample(logits, SamplingTensors.empty(logits.shape[0], logits.device), mode)


def _decode_slices(n: int) -> list[SequenceSlice]:
    """A dummy decode batch of `n` rows, each one token in the KV cache's dummy block."""
    return [SequenceSlice(1, 1, (DUMMY_BLOCK,))] * n


def _run(runner: ModelRunner, slices: list[SequenceSlice], num_tokens: int,
         forward: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    meta = build_metadata(slices, runner.kv_cache.block_size, num_tokens, runner.device)
    zeros = torch.zeros(num_tokens, dtype=torch.int64, device=runner.device)
    with forward_context(ForwardContext(runner.backend.plan(meta))):
        return (forward or runner.forward)(zeros, zeros)
