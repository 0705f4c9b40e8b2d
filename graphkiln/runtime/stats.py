"""A public look inside a running engine (`LLM.stats()`): its KV cache, its captured graphs, its steps.

Benchmarks and users read these instead of reaching into the engine's private state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import EngineConfig
from .graphs import GraphSet
from .preparation import PreparedBucket
from .step_lock import StepWaits


@dataclass(frozen=True)
class GraphStats:
    """One kind of captured graph: "decode", "prefill" (whole) or "prefill-piecewise"."""

    kind: str
    sizes: tuple[int, ...]
    graphs: int
    capture_s: float
    pool_bytes: int
    replays: dict[str, int]  # "<size>" or "<size>/<mode or piece>" -> replays

    @classmethod
    def of(cls, graphs: GraphSet) -> GraphStats:
        def name(key) -> str:
            return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)

        return cls(graphs.kind, graphs.sizes, graphs.stats.graphs, graphs.stats.seconds, graphs.stats.pool_bytes,
                   {name(k): n for k, n in sorted(graphs.replays.items(), key=lambda kv: name(kv[0]))})  # fmt: skip

    @property
    def replayed_sizes(self) -> set[int]:
        return {int(key.split("/")[0]) for key in self.replays}


@dataclass(frozen=True)
class EngineStats:
    device: str
    attention_backend: str
    config: EngineConfig
    max_context: int
    kv_cache_blocks: int
    kv_cache_bytes: int
    free_blocks: int
    running: int
    waiting: int
    graphs: dict[str, GraphStats] = field(default_factory=dict)
    steps_without_graph: dict[str, int] = field(default_factory=dict)
    compile_counters: dict[str, int] | None = None
    prepared: tuple[PreparedBucket, ...] = ()  # graphs captured (or sizes warmed up) so far, in order
    ready: bool = True  # every one of them is done
    load: LoadStats | None = None
    step_waits: StepWaits = field(default_factory=StepWaits)  # steps held up by a capture (or another call)

    @property
    def graphs_captured(self) -> int:
        return sum(g.graphs for g in self.graphs.values())

    @property
    def graph_pool_bytes(self) -> int:
        return sum(g.pool_bytes for g in self.graphs.values())


@dataclass(frozen=True)
class LoadStats:
    """Where `load` spent its time, in seconds: `import` (from `import graphkiln` to its API loaded; torch
    included unless imported before), then `stages` in the order they started (checks, weights and
    pieces, which overlap, tokenizer, engine); `weight_bytes` read from the checkpoint; `load_s` the
    whole call. After it returned: `prepare_s` (load's start until every graph or warm-up was done, None while some are owed; what
    each took and when is `EngineStats.prepared`) and `first_token_s` (load's start to the first
    token read back, None before)."""

    import_s: float | None
    stages: dict[str, float]
    weight_bytes: int
    load_s: float
    started: float = field(default=0.0, repr=False)  # time.perf_counter() at load's start
    prepare_s: float | None = None
    first_token_s: float | None = None

    @property
    def weights_gb_per_s(self) -> float:
        seconds = self.stages.get("weights", 0.0)
        return self.weight_bytes / seconds / 1e9 if seconds > 0 else 0.0
