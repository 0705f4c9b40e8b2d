"""Compile a loaded model: trace once, run the passes, split at attention, Inductor-compile every piece.

With `CompileConfig.dump_dir` every stage also writes its dump (see graphkiln.passes.dump).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphkiln.compat import depyf_debug, require_depyf
from graphkiln.models.transformer import CausalLM
from graphkiln.passes.base import Pass, PassRecord, format_records
from graphkiln.passes.dump import Dump
from graphkiln.passes.pipeline import default_passes

from .capture import capture
from .compiled_model import CompiledModel
from .config import CompileConfig
from .counters import Counters
from .inductor import InductorCompiler, structure_key
from .split import split_pieces

if TYPE_CHECKING:
    from graphkiln.passes.manager import PassManager

log = logging.getLogger("graphkiln.compiler")

Progress = Callable[[str, int, int], None]  # (stage, done, total): each stage reports done=0, then done=total


def _silent(stage: str, done: int, total: int) -> None:
    return None


@dataclass
class CompileReport:
    """Seconds per stage (trace, passes, split, inductor, total), counters, each piece's structure key,
    and what every pass did (post-grad passes run only on Inductor cache misses)."""

    timings: dict[str, float] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    piece_keys: dict[str, str] = field(default_factory=dict)
    compiler_hash: str = ""
    passes: list[PassRecord] = field(default_factory=list)

    def summary(self) -> str:
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items())
        c = self.counters
        return (
            f"{c.pieces} pieces ({c.unique_pieces} unique) + {c.attention_pieces} attention; "
            f"{c.inductor_compiles} Inductor compiles ({c.specialized_compiles} specialized); {stages}"
        )


def compile_module(
    model: CausalLM, config: CompileConfig, graph_passes: Sequence[Pass] = (), progress: Progress = _silent
) -> tuple[CompiledModel, CompileReport]:
    """`graph_passes` run after the built-in Dynamo-graph passes, before the split; all obey disabled_passes."""
    from graphkiln.passes.manager import PassManager  # Inductor's CustomGraphPass: loading an artifact never needs it

    dump = Dump(config.dump_dir) if config.dump_dir else None
    manager = PassManager(default_passes(graph_passes), config.disabled_passes, dump.graph if dump else None,
                          config.enabled_passes, config.device)
    if dump is None:
        return _compile(model, config, manager, progress, None)
    require_depyf()
    with dump:  # index.md is written even when the compile fails
        return _compile(model, config, manager, progress, dump)


def _compile(
    model: CausalLM, config: CompileConfig, manager: PassManager, progress: Progress, dump: Dump | None
) -> tuple[CompiledModel, CompileReport]:
    report = CompileReport()
    counters = report.counters
    start = time.perf_counter()
    progress("trace", 0, 1)
    captured = capture(model, depyf_debug(dump.dynamo_dir, dump.depyf_log) if dump else None)
    counters.graphs_traced += 1
    report.timings["trace"] = captured.trace_s
    progress("trace", 1, 1)
    if dump:
        dump.add_dynamo()

    progress("passes", 0, 1)
    t = time.perf_counter()
    manager.run_dynamo(captured.gm)
    report.timings["passes"] = time.perf_counter() - t
    progress("passes", 1, 1)

    progress("split", 0, 1)
    t = time.perf_counter()
    split = split_pieces(captured.gm)
    counters.pieces = len(split.pieces)
    counters.attention_pieces = len(split.submodules) - len(split.pieces)
    keys = {name: structure_key(split.gm.get_submodule(name)) for name in split.pieces}
    report.timings["split"] = time.perf_counter() - t
    if dump:
        dump.split(manager.number("attention_split"), split.gm, dict(split.submodules), keys)
    progress("split", 1, 1)

    t = time.perf_counter()
    device = next(model.parameters()).device
    sizes = config.specialize_sizes
    total = len(set(keys.values())) * (1 + len(sizes))
    progress("inductor", 0, total)
    codes: list[tuple[str, str, str]] = []
    first_piece = {key: name for name, key in reversed(keys.items())}  # what the dumps name a key's files by
    compiler = InductorCompiler(
        device, config.inductor_options, counters, lambda done: progress("inductor", done, total),
        post_grad_pass=manager, on_code=(lambda *code: codes.append(code)) if dump else None,
        around_compile=(lambda key, variant: dump.compiling(first_piece[key], variant)) if dump else None,
    )
    report.compiler_hash = compiler.hash()
    pieces = {}
    for name in split.pieces:
        pieces[name] = compiler.compile_piece(split.gm.get_submodule(name), sizes)
        report.piece_keys[name] = pieces[name].key
    report.timings["inductor"] = time.perf_counter() - t
    report.timings["total"] = time.perf_counter() - start
    report.passes = list(manager.records.values())
    if dump:
        dump.inductor(len(manager.passes) + 1, codes, keys)
        table = format_records(report.passes)
        dump.write("passes.md", f"```\n{table}\n```\n", "what every pass did: runs, matches, nodes removed and added")

    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    compiled = CompiledModel(split, captured.bindings, pieces, tensors)
    log.info("compiled %s: %s", type(model).__name__, report.summary())
    log.info("passes (uuid %s):\n%s", manager.uuid()[:16], format_records(report.passes))
    return compiled, report
