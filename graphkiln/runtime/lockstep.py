"""What keeps the ranks of a tensor-parallel group in step: the messages rank 0 sends on the control group
(a Step before every forward, a Prepare before every preparation job) and how the input ids travel.

Every forward, warm-up and graph capture runs collectives (the all-reduces and the LM head's gather
inside the compiled pieces), so every rank must run the same one at the same time, with tensors of
the same shapes. Rank 0 decides and the others follow:

- Preparation (warm-ups on the CPU, graph captures on CUDA) runs on rank 0 in its background thread
  under the step lock, one job at a time. Before each job rank 0 announces it (`Prepare`); every rank
  builds the same jobs and runs the one named. After it every rank reports how it went (`RankReport`)
  and all receive every report; a job that failed on any rank is withdrawn on all of them, so a
  bucket is ready everywhere or nowhere. A rank that dies fails the next announcement or report on
  rank 0 (its sockets close), which then raises RankFailedError naming it. A job that fails between
  its collectives leaves the others waiting at most `EngineConfig.collective_timeout_s` and the world
  group out of step, so after a failed job the ranks run one all-reduce on it: where that fails too,
  the group stops (RankFailedError) rather than pair later collectives wrongly.
- Steps: the `Step` says what rank 0 runs: the batch, the logit rows, and the bucket of the graph it
  replays (None: no graph). A worker replays exactly that graph, whatever its own readiness says.

Why a step never mixes a graph on one rank with no graph on another, although a graph replays the very
compiled pieces the eager path calls, in the same order: the shapes differ. The eager path pads a
batch to the smallest capture size, the graph path to the smallest *ready* bucket, which can be larger
while captures are still running; and a decode graph gathers the logits of all its rows and samples
inside, where the eager path gathers only the rows that sample. Collectives in the same order but of
other sizes do not match (gloo raises; with NCCL the result is undefined: a hang or wrong sums), so the
Step carries rank 0's choice and readiness is agreed on after every job.
"""

from __future__ import annotations

import pickle
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .batch import Batch, PendingIds
from .sampler import SamplingBatch

if TYPE_CHECKING:
    from .tensor_parallel import Peers


def send(message: Any, control: dist.ProcessGroup, timeout_s: float | None) -> None:
    """Rank 0: one message to every other rank on the control group. The others wait for the next message
    without a time limit (a server may idle for days), but rank 0 waits at most `timeout_s` (None: no limit)
    for them to take it: a rank that is stopped or hung fails the send (RuntimeError) instead of holding rank 0
    forever."""
    size, data = _packed(message)
    for sent in [dist.broadcast(tensor, src=0, group=control, async_op=True) for tensor in (size, data)]:
        _wait(sent, timeout_s)


def gather(item: Any, control: dist.ProcessGroup, timeout_s: float | None) -> list:
    """Every rank's `item`, on every rank, in rank order; waits at most `timeout_s` (None: without a limit)."""
    size, data = _packed(item)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(control))]
    _wait(dist.all_gather(sizes, size, group=control, async_op=True), timeout_s)
    longest = int(max(sizes))
    padded = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    _wait(dist.all_gather(padded, torch.nn.functional.pad(data, (0, longest - data.numel())), group=control,
                          async_op=True), timeout_s)  # fmt: skip
    return [_unpacked(p[: int(n)]) for p, n in zip(padded, sizes)]


def _packed(item: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`item` pickled into a uint8 tensor, and its length as an int64 tensor of one element."""
    data = torch.frombuffer(bytearray(pickle.dumps(item)), dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.int64), data


def _unpacked(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def _wait(work: dist.Work, timeout_s: float | None) -> None:
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout_s))


def receive(control: dist.ProcessGroup) -> Any:
    """Another rank: the next message rank 0 sends (`send`), however long it takes to come."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=control)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=control)
    return _unpacked(data)


@dataclass(frozen=True)
class Step:
    """What the other ranks need to run rank 0's forward: the batch (padded to the ids sent when no graph
    runs it, as scheduled when one does: the graph pads it), its real token count, the logit rows,
    the bucket of the graph rank 0 replays (decode when the batch is, prefill otherwise; None: none)
    and, for a decode graph, its sampling rows (the sampler runs inside it)."""

    batch: Batch
    num_tokens: int
    rows: list[int] | None
    graph: int | None = None
    sampling: SamplingBatch | None = None

    @property
    def ids(self) -> int:
        """How many input ids rank 0 sends on the world group after the Step."""
        return self.graph if self.graph is not None else self.batch.num_tokens


@dataclass(frozen=True)
class Prepare:
    """Every rank runs its preparation job `kind` / `key` now."""

    kind: str
    key: str


@dataclass(frozen=True)
class RankReport:
    """One rank's account of a preparation job: the jobs it has run so far (this one included), its
    seconds, and the error if the job raised there."""

    rank: int
    done: int
    seconds: float
    error: str | None = None


@dataclass(frozen=True)
class PublishedIds:
    """Rank 0's input ids of one step: filled from the previous step's output where pending, then sent
    to the other ranks with the Step once they are in place (the buffer is the graph's, or the eager
    forward's)."""

    step: Step
    pending: PendingIds | None
    peers: Peers

    def fill(self, input_ids: torch.Tensor) -> None:
        if self.pending is not None:
            self.pending.fill(input_ids)
        self.peers.publish(self.step, input_ids[: self.step.ids])


@dataclass(frozen=True)
class ReceivedIds:
    """A worker's input ids of one step: received from rank 0 straight into the buffer the step reads."""

    count: int

    def fill(self, input_ids: torch.Tensor) -> None:
        dist.broadcast(input_ids[: self.count], src=0)


class Lockstep:
    """One rank's part in running preparation jobs together. Rank 0 (the one with `peers`) announces each
    job before running it; after it every rank reports, and all learn every rank's report. On rank 0 a
    failure of either is the group's: RankFailedError naming the rank, the group stopped."""

    def __init__(self, control: dist.ProcessGroup, peers: Peers | None = None) -> None:
        self.control = control
        self.peers = peers
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def announce(self, kind: str, key: str) -> None:
        if self.peers is not None:
            with self.peers.watch(f"preparing {kind} bucket {key}"):
                self.peers.send(Prepare(kind, key))

    def agree(self, report: RankReport, kind: str, key: str, device: torch.device) -> tuple[RankReport, ...]:
        """Every rank's report of the job; after a failure, also checks that the world group is still in step."""
        with self.peers.watch(f"preparing {kind} bucket {key}") if self.peers is not None else nullcontext():
            reports = gather(report, self.control, None) if self.peers is None else self.peers.gather(report)
            if any(r.error is not None for r in reports):
                dist.all_reduce(torch.zeros(1, device=device))
        return tuple(reports)
