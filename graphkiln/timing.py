"""A stopwatch for start-up stages: seconds per named stage in the order they ran, and what a stage counted
(bytes read). Load passes one through its rooms; `LLM.stats().load` shows the result."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Stopwatch:
    stages: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Add the seconds the block takes to stage `name` (stages are listed in the order they start; blocks
        on different threads may overlap)."""
        self.stages.setdefault(name, 0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - start
