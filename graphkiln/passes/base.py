"""What a pass is: a name, a stage, an optional frozen config, and a uuid hashed from source contents.

`GraphPass` rewrites the Dynamo FX graph in place before the split; `PostGradPass` rewrites
Inductor's post-grad ATen graph from inside the pass manager (Inductor's one custom post pass).
Both return how many places they matched. The uuid hashes the bytes of the pass's source files
(never their paths, so it survives folder moves) plus its name and config.
"""

from __future__ import annotations

import hashlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

DYNAMO = "dynamo"
POST_GRAD = "post_grad"


def content_hash(files: Iterable[str | Path], extra: str = "") -> str:
    """sha256 of the files' bytes, in the given order, then `extra`; paths are not hashed."""
    digest = hashlib.sha256()
    for path in files:
        data = Path(path).read_bytes()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    digest.update(extra.encode())
    return digest.hexdigest()


def source_files(cls: type) -> list[str]:
    """Source files of `cls` and of its bases defined outside torch and the standard library."""
    files = []
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("builtins", "abc", "torch"):
            continue
        path = inspect.getsourcefile(klass)
        if path and path not in files:
            files.append(path)
    return files


class Pass(ABC):
    """A named graph rewrite; `config` (a frozen dataclass or None) is part of its uuid. In a compile for a
    device outside `default_devices` the pass runs only when `CompileConfig.enabled_passes` names it."""

    name: ClassVar[str]
    stage: ClassVar[str]
    default_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    config: Any = None

    def uuid(self) -> str | None:
        return content_hash(source_files(type(self)), f"{self.name}|{self.stage}|{self.config!r}")


class GraphPass(Pass):
    """Rewrites the Dynamo graph (torch-level call_function/call_method nodes) in place."""

    stage = DYNAMO

    @abstractmethod
    def __call__(self, gm: torch.fx.GraphModule) -> int:
        """Rewrite `gm` in place; return the number of matches."""


class PostGradPass(Pass):
    """Rewrites Inductor's post-grad ATen graph in place; runs only when Inductor misses its cache."""

    stage = POST_GRAD

    @abstractmethod
    def __call__(self, graph: torch.fx.Graph) -> int:
        """Rewrite `graph` in place; return the number of matches."""


@dataclass
class PassRecord:
    """What one pass did during a compile, summed over its runs; `enabled` False means it never ran."""

    name: str
    stage: str
    uuid: str
    enabled: bool
    runs: int = 0
    matches: int = 0
    nodes_removed: int = 0
    nodes_added: int = 0
    seconds: float = 0.0


def format_records(records: Iterable[PassRecord]) -> str:
    """A plain-text table, one row per pass in pipeline order."""
    rows = [("pass", "stage", "runs", "matches", "removed", "added", "ms")]
    for r in records:
        if r.enabled:
            rows.append((r.name, r.stage, str(r.runs), str(r.matches), str(r.nodes_removed), str(r.nodes_added),
                         f"{r.seconds * 1e3:.1f}"))
        else:
            rows.append((r.name, r.stage, "disabled", "", "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)
