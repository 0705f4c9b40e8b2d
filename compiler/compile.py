"""Compile a loaded model: trace once, run FX passes, split at attention, Inductor-compile every piece."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from graphkiln.models.transformer import CausalLM

from .capture import capture
from .compiled_model import CompiledModel
from .config import CompileConfig
from .counters import Counters
from .inductor import InductorCompiler, structure_key
from .plan import plans_for
from .split import split_at_attention

log = logging.getLogger("graphkiln.compiler")

GraphPass = Callable[[torch.fx.GraphModule], None]
Progress = Callable[[str, int, int], None]  # (stage, done, total)


def _silent(stage: str, done: int, total: int) -> None:
    return None


@dataclass
class CompileReport:
    """Seconds per stage (trace, passes, split, inductor, total), counters, and each piece's structure key."""

    timings: dict[str, float] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    piece_keys: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items())
        c = self.counters
        return (
            f"{c.pieces} pieces ({c.unique_pieces} unique) + {c.attention_pieces} attention; "
            f"{c.inductor_compiles} Inductor compiles ({c.specialized_compiles} specialized); {stages}"
        )


def compile_sizes(config: CompileConfig) -> tuple[int, ...]:
    """Token counts that get a specialized compile: every decode batch size and prefill bucket."""
    if not config.specializes:
        return ()
    return tuple(sorted(set(config.decode_batch_sizes) | set(config.prefill_token_buckets)))


def compile_module(
    model: CausalLM, config: CompileConfig, graph_passes: Sequence[GraphPass] = (), progress: Progress = _silent
) -> tuple[CompiledModel, CompileReport]:
    report = CompileReport()
    counters = report.counters
    start = time.perf_counter()
    progress("trace", 0, 1)
    captured = capture(model)
    counters.graphs_traced += 1
    report.timings["trace"] = captured.trace_s

    t = time.perf_counter()
    for graph_pass in graph_passes:
        graph_pass(captured.gm)
    captured.gm.recompile()
    report.timings["passes"] = time.perf_counter() - t

    t = time.perf_counter()
    split = split_at_attention(captured.gm)
    counters.pieces = len(split.pieces)
    counters.attention_pieces = len(split.submodules) - len(split.pieces)
    report.timings["split"] = time.perf_counter() - t

    t = time.perf_counter()
    device = next(model.parameters()).device
    sizes = compile_sizes(config)
    total = len({structure_key(split.gm.get_submodule(n)) for n in split.pieces}) * (1 + len(sizes))
    compiler = InductorCompiler(device, config.inductor_options, counters, lambda done: progress("inductor", done, total))
    pieces = {}
    for name in split.pieces:
        pieces[name] = compiler.compile_piece(split.gm.get_submodule(name), sizes)
        report.piece_keys[name] = pieces[name].key
    report.timings["inductor"] = time.perf_counter() - t
    report.timings["total"] = time.perf_counter() - start

    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    compiled = CompiledModel(
        split, captured.bindings, pieces, plans_for(config.decode_batch_sizes, config.prefill_token_buckets), tensors
    )
    log.info("compiled %s: %s", type(model).__name__, report.summary())
    return compiled, report
