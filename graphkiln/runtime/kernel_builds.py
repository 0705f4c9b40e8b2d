"""A job that builds, before the captures, every graphkiln kernel they will launch: all at once, on a pool of
threads (kernels/launch.py), where each capture would otherwise build its own, one after another.

Its part off the step lock runs each bucket's step once without a graph, its kernels' launches turned into
builds (the steps the engine serves meanwhile go on), and waits for them; in a fresh process with Triton's
cache empty the builds are seconds each, and otherwise reads of that cache. A tensor-parallel rank other
than the first runs only the part under the lock (preparation.py), so there it does the same under the lock.
"""

from __future__ import annotations

from collections.abc import Callable

from graphkiln.kernels.launch import builds_ahead, wait_for_builds


class KernelBuildsJob:
    kind = "kernels"
    key = "built"

    def __init__(self, steps: list[Callable[[], object]]) -> None:
        self.steps = steps
        self.built = False

    def unlocked(self) -> None:
        with builds_ahead():
            for step in self.steps:
                step()
        wait_for_builds()
        self.built = True

    def run(self) -> None:
        if not self.built:
            self.unlocked()

    def withdraw(self) -> None:
        """Nothing to undo: the builds ready no bucket."""
