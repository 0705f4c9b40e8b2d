"""The pass manager: every graph pass, in order, switchable by name, under one uuid.

One `PassManager` runs the Dynamo-graph passes before the split (`run_dynamo`) and is itself
the `CustomGraphPass` that Inductor calls as `post_grad_custom_post_pass` for every piece it
compiles (torch 2.11/2.12 take exactly one object there). Its `uuid()` goes into Inductor's
cache key: it hashes the contents of this package's files and of every enabled pass's source
files, each pass's config, and which passes are enabled, in order. Per-pass uuids go into the
artifact manifest.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from graphkiln.compat import CustomGraphPass
from graphkiln.errors import ConfigError

from .base import DYNAMO, POST_GRAD, GraphPass, Pass, PassRecord, PostGradPass, content_hash
from .pipeline import passes_off

log = logging.getLogger("graphkiln.passes")

# (number, pass name, "before"|"after", graph) -> None: writes one dump file
GraphDump = Callable[[int, str, str, torch.fx.GraphModule | torch.fx.Graph], None]


def _ops(target: torch.fx.GraphModule | torch.fx.Graph) -> Counter:
    """(op, target, name) of every call node, in submodules too: a node moved into a piece is not new."""
    graphs = [target]
    if isinstance(target, torch.fx.GraphModule):
        graphs = [m.graph for m in target.modules() if isinstance(m, torch.fx.GraphModule)]
    return Counter((n.op, str(n.target), n.name) for g in graphs for n in g.nodes if n.op.startswith("call"))


class PassManager(CustomGraphPass):
    """Ordered passes; `disabled` names, and passes off by default on `device` unless `enabled` names them, are
    registered but never run. Unknown names are a ConfigError."""

    def __init__(
        self, passes: Sequence[Pass], disabled: Iterable[str] = (), dump: GraphDump | None = None,
        enabled: Iterable[str] = (), device: str = "cpu",
    ) -> None:
        self.passes: list[Pass] = []
        for p in passes:
            self.register(p)
        self.disabled = passes_off(self.passes, disabled, enabled, device)
        self.dump = dump
        self.records = {p.name: PassRecord(p.name, p.stage, p.uuid(), p.name not in self.disabled) for p in self.passes}

    def register(self, p: Pass) -> None:
        """Append a pass; refuse anything that would make Inductor's cache bypass (no uuid)."""
        if not isinstance(p, (GraphPass, PostGradPass)) or p.uuid() is None:
            raise ConfigError(
                f"pass {p!r} has no uuid: a graph pass must subclass graphkiln.passes.base.GraphPass or "
                "PostGradPass with a uuid(), or Inductor's cache would be bypassed"
            )
        if any(q.name == p.name for q in self.passes):
            raise ConfigError(f"pass name {p.name!r} is registered twice")
        self.passes.append(p)

    def number(self, name: str) -> int:
        """A pass's place in the pipeline, from 1: the NN of its dump files."""
        return 1 + [p.name for p in self.passes].index(name)

    def enabled(self, stage: str) -> list[Pass]:
        return [p for p in self.passes if p.stage == stage and p.name not in self.disabled]

    def uuid(self) -> str:
        """Every file of this package (helpers too, by contents, in name order), then each enabled pass's uuid."""
        enabled = [p for p in self.passes if p.name not in self.disabled]
        files = sorted(Path(__file__).parent.glob("*.py"), key=lambda path: path.name)
        return content_hash(files, "|".join(f"{p.name}:{self.records[p.name].uuid}" for p in enabled))

    def run_dynamo(self, gm: torch.fx.GraphModule) -> None:
        """Run the enabled Dynamo-graph passes on `gm` in place, recording and dumping each."""
        for p in self.enabled(DYNAMO):
            self._run(p, gm)
        gm.recompile()

    def __call__(self, graph: torch.fx.Graph) -> None:
        """Inductor's post-grad custom pass: run the enabled post-grad passes on `graph`."""
        for p in self.enabled(POST_GRAD):
            self._run(p, graph)

    def _run(self, p: Pass, target: torch.fx.GraphModule | torch.fx.Graph) -> None:
        number = self.number(p.name)
        if self.dump:
            self.dump(number, p.name, "before", target)
        before = _ops(target)
        start = time.perf_counter()
        matches = p(target)
        record = self.records[p.name]
        record.seconds += time.perf_counter() - start
        after = _ops(target)
        record.runs += 1
        record.matches += matches
        record.nodes_removed += sum((before - after).values())
        record.nodes_added += sum((after - before).values())
        if self.dump:
            self.dump(number, p.name, "after", target)
        log.debug("pass %s: %d matches", p.name, matches)
