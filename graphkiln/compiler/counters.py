"""Compile and capture counters that tests and logs read, in the style of vLLM's compilation_counter.

`Counters` is owned by one compile. `torch_compile_events()` reads torch's own
process-wide counters, so a test can prove that a process never traced or compiled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from graphkiln.compat import dynamo_counters


@dataclass
class Counters:
    graphs_traced: int = 0
    pieces: int = 0
    attention_pieces: int = 0
    unique_pieces: int = 0
    inductor_compiles: int = 0
    specialized_compiles: int = 0
    cache_hits: int = 0

    def expect(self, **expected: int) -> None:
        """Assert the named counters; the message lists every mismatch."""
        actual = asdict(self)
        unknown = set(expected) - set(actual)
        if unknown:
            raise KeyError(f"unknown counters {sorted(unknown)}")
        wrong = {k: (actual[k], v) for k, v in expected.items() if actual[k] != v}
        if wrong:
            raise AssertionError("counters differ (actual, expected): " + repr(wrong))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def torch_compile_events() -> dict[str, int]:
    """Process-wide counts from torch itself: Dynamo graphs traced, Inductor graphs compiled (cache
    misses) and Inductor graphs served from a cache (what loading an artifact does)."""
    counters = dynamo_counters()
    return {
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "inductor_compiles": counters["inductor"]["fxgraph_cache_miss"],
        "inductor_cache_loads": counters["inductor"]["fxgraph_cache_hit"],
    }
