"""Tensor-parallel serving on torch.distributed: rank 0 schedules and samples, the other ranks follow.

On one machine rank 0 is the caller's process: it spawns the other ranks (torch.multiprocessing,
one per GPU, or per CPU rank on gloo), and they meet through a file store. Under `torchrun` every
process is already a rank: rank 0 returns to serve, the others follow until rank 0 closes.

Each rank loads its own shard (and the compiled pieces) and builds an engine of its own with the
KV cache rank 0 sized. Every step, rank 0 sends the batch, the rows it wants logits of and the
graph it replays to the others (on a gloo control group where they wait without a timeout, so an idle
server keeps its workers, while rank 0 waits at most the collective timeout for them to take it), then
the input ids on the world group, and all ranks run the same forward or graph, whose collectives meet
inside the compiled code. Rank 0 drives the preparation (warm-ups, graph captures) the same way, job by
job, once every rank has built its engine (lockstep.py). The world group's collectives time out after
`EngineConfig.collective_timeout_s`; a rank that dies closes its sockets, so the others fail at their next
collective: rank 0 raises RankFailedError naming the rank and stops the rest.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.process
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphkiln.compat import symm_mem_masked_devices, symm_mem_multicast_off
from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.errors import ConfigError, RankFailedError
from graphkiln.models.sharding import Shard
from graphkiln.models.transformer import CausalLM

from .config import EngineConfig
from .engine import Engine
from .lockstep import Lockstep, Prepare, RankReport, Step, gather, receive, send
from .rank_gpus import check_distinct_gpus, visible_cuda_devices

log = logging.getLogger("graphkiln.runtime")

LoadRank = Callable[[Shard], tuple[CausalLM, CompiledModel | None]]  # picklable: the spawned ranks call it
CONTROL_TIMEOUT = timedelta(days=365)  # waiting for the next step is no failure; a dead peer still fails at once
DEATH_GRACE_S = 5.0  # how long rank 0 waits, after a collective fails, for the failed rank's exit to show
RANK_0_GONE = "rank 0 is gone"
START_TIMEOUT_S = 60.0  # the least a spawned rank gets to start (an interpreter, torch's import) on a busy machine


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or set up as one of its ranks)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


class Peers:
    """Rank 0's side of the group: sends each step to the other ranks and turns a failed step into
    RankFailedError naming the rank that died. Closing tells the others to stop and ends the group."""

    def __init__(self, size: int, control: dist.ProcessGroup, processes: dict[int, multiprocessing.process.BaseProcess],
                 store_dir: str | None, timeout_s: float) -> None:  # fmt: skip
        self.size = size
        self.control = control
        self.timeout_s = timeout_s  # EngineConfig.collective_timeout_s: how long the others may take a message
        self.processes = processes
        self.store_dir = store_dir
        self.failure: RankFailedError | None = None
        self.closed = False
        self.group_ended = False

    @property
    def pids(self) -> dict[int, int]:
        """The process id of every rank this process started (none under torchrun)."""
        return {rank: p.pid for rank, p in self.processes.items()}

    def send(self, message: Step | Prepare | None) -> None:
        """One message to the other ranks (None: stop), which they take within `timeout_s` or it raises."""
        with self._in_time("take rank 0's next message"):
            send(message, self.control, self.timeout_s)

    def gather(self, report: RankReport) -> list[RankReport]:
        """Every rank's report of a preparation job, which the others give within `timeout_s` or it raises."""
        with self._in_time("report on the preparation job"):
            return gather(report, self.control, self.timeout_s)

    @contextlib.contextmanager
    def _in_time(self, what: str) -> Iterator[None]:
        """A control message not exchanged in time is RankFailedError saying why, unless a rank died."""
        try:
            yield
        except RuntimeError as error:
            if _dead_rank(self.processes) is not None:
                raise
            raise RankFailedError(
                f"the other tensor-parallel ranks did not {what} within {self.timeout_s:g} s "
                f"(EngineConfig.collective_timeout_s; {error}): a rank is stopped or hung"
            ) from error

    def publish(self, step: Step, input_ids: torch.Tensor) -> None:
        """Send one step, then its `step.ids` input ids, to the other ranks."""
        self.send(step)
        dist.broadcast(input_ids, src=0)

    @contextlib.contextmanager
    def watch(self, what: str = "a step") -> Iterator[None]:
        """Around one step (or preparation job): any failure inside it ends the group (the others would wait
        in a collective). An interrupt (KeyboardInterrupt) ends it too, since the others may be inside the
        step's collectives: it propagates, and the next request gets the RankFailedError."""
        if self.failure is not None:
            raise RankFailedError(*self.failure.args)  # a new one each time: its traceback holds no earlier call
        try:
            yield
        except BaseException as error:
            failure = self._failure(error, what)
            self.failure = RankFailedError(*failure.args)  # kept without a traceback (which holds the engine)
            self._stop()
            if isinstance(error, Exception):
                raise failure from error
            raise

    def _failure(self, error: BaseException, what: str) -> RankFailedError:
        if isinstance(error, RankFailedError):  # says why already (`_in_time` looked for a dead rank)
            return error
        if (dead := _dead_rank(self.processes)) is not None:
            rank, process = dead
            return RankFailedError(
                f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode} during "
                f"{what} ({type(error).__name__}: {error}); the group of {self.size} ranks stopped: load the "
                "model again"
            )
        failed = "failed" if isinstance(error, Exception) else "was interrupted"
        return RankFailedError(
            f"{what} {failed} on tensor-parallel rank 0 ({type(error).__name__}: {error}); the group of {self.size} "
            "ranks stopped: load the model again"
        )

    def _stop(self) -> None:
        for process in self.processes.values():
            if process.exitcode is None:
                process.terminate()
        for process in self.processes.values():
            process.join(DEATH_GRACE_S)
            if process.exitcode is None:  # a stopped process takes no SIGTERM
                process.kill()
                process.join(DEATH_GRACE_S)
        self._end_group()

    def close(self) -> None:
        """Tell the other ranks to stop, wait for them, end the process group (once; after a failure too)."""
        if self.closed:
            return
        self.closed = True
        if self.failure is None:
            try:
                self.send(None)
            except Exception as error:  # a rank died (or stopped) while idle: it is stopped either way
                log.warning("tensor-parallel ranks did not all take the stop message: %r", error)
            for process in self.processes.values():
                process.join(DEATH_GRACE_S)
        self._stop()

    def _end_group(self) -> None:
        """End this group once: a later call must not end a group another LLM has started since."""
        if self.group_ended:
            return
        self.group_ended = True
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None


def _init_groups(
    rank: int, size: int, store: dist.Store | None, device_type: str, timeout_s: float
) -> dist.ProcessGroup:
    """The world group (NCCL on CUDA, gloo on the CPU) and the gloo control group; returns the control group.
    Without a store the group meets as torchrun says (env://)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    meet = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s), **meet)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    if device_type == "cuda":
        check_distinct_gpus(size, control)
    return control


def _dead_rank(processes: dict[int, multiprocessing.process.BaseProcess]
               ) -> tuple[int, multiprocessing.process.BaseProcess] | None:  # fmt: skip
    """The lowest rank among `processes` that exited, waiting up to DEATH_GRACE_S for one to; None if none did."""
    deadline = time.monotonic() + DEATH_GRACE_S
    while processes:
        dead = {rank: process for rank, process in processes.items() if process.exitcode is not None}
        if dead:
            return min(dead.items())
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return None


def _started_rank_died(processes: dict[int, multiprocessing.process.BaseProcess]) -> RankFailedError | None:
    """A RankFailedError naming the spawned rank that exited while the group started, if one did."""
    if (dead := _dead_rank(processes)) is None:
        return None
    rank, process = dead
    return RankFailedError(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode} "
                           "while starting; its error is printed above")  # fmt: skip


def _joining_key(rank: int) -> str:
    return f"graphkiln/joining/{rank}"


def _wait_for_ranks(
    store: dist.Store, processes: dict[int, multiprocessing.process.BaseProcess], timeout_s: float
) -> None:
    """Until every spawned rank says it is joining the group; one that exits first (or never says it) is a
    RankFailedError naming it, instead of a wait for the whole timeout."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(processes)
    while waiting:
        for rank, process in list(waiting.items()):
            if store.check([_joining_key(rank)]):
                del waiting[rank]
            elif process.exitcode is not None:
                raise _started_rank_died({rank: process})
        if waiting and time.monotonic() > deadline:
            raise RankFailedError(f"tensor-parallel ranks {sorted(waiting)} did not start within {timeout_s:.0f} s "
                                  f"(EngineConfig.collective_timeout_s, at least {START_TIMEOUT_S:.0f})")  # fmt: skip
        time.sleep(0.02)


def follow(shard: Shard, load_rank: LoadRank, control: dist.ProcessGroup) -> None:
    """A rank other than 0: load this rank's model, build its engine as rank 0 sized it, and run every step
    and preparation job rank 0 sends until it sends None."""
    from .builder import build_engine

    net, compiled = load_rank(shard)
    config: EngineConfig | None = receive(control)
    if config is None:  # rank 0 failed before its engine was built
        return
    engine = build_engine(net, compiled, config, lockstep=Lockstep(control))
    dist.barrier(group=control)
    while (message := _next_message(control)) is not None:
        try:
            if isinstance(message, Prepare):
                engine.preparation.run_one(message.kind, message.key)
            else:
                engine.runner.follow(message)
        except RankFailedError:
            raise
        except Exception as error:
            raise RankFailedError(f"a step's collective failed: rank 0 or another rank is gone ({error})") from None


def _next_message(control: dist.ProcessGroup) -> Step | Prepare | None:
    try:
        return receive(control)
    except Exception as error:
        raise RankFailedError(f"{RANK_0_GONE}: waiting for its next step failed ({error})") from None


def _spawned_rank(rank: int, size: int, store_path: str, device: str, cuda_device: str | None, threads: int,
                  timeout_s: float, load_rank: LoadRank) -> None:  # fmt: skip
    """The entry point of a rank spawned by rank 0 (it sees only its own GPU, as cuda:0)."""
    if cuda_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_device
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole terminal: rank 0 decides when this ends
    try:
        store = dist.FileStore(store_path, size)
        store.set(_joining_key(rank), "1")
        control = _init_groups(rank, size, store, device, timeout_s)
        follow(Shard(rank, size), load_rank, control)
    except Exception as error:
        print(f"graphkiln: tensor-parallel rank {rank} stops: {type(error).__name__}: {error}", file=sys.stderr)
        if isinstance(error, RankFailedError) and error.args[0].startswith(RANK_0_GONE):
            shutil.rmtree(os.path.dirname(store_path), ignore_errors=True)  # rank 0 cannot any more
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Group:
    """Rank 0's membership of a started group: its shard and the Peers its engine publishes steps to."""

    shard: Shard
    peers: Peers

    def ready(self, config: EngineConfig) -> None:
        """After rank 0 built its engine: the others build theirs with `config`; returns once all have."""
        with self.peers.watch():
            send(config, self.peers.control, None)  # the others may still be loading: no time limit
            dist.barrier(group=self.peers.control)


def start_group(size: int, device: str, load_rank: LoadRank, config: EngineConfig) -> Group:
    """Make this process rank 0 of `size` ranks and return its Group. Under torchrun the group's ranks are
    its processes: rank 0 returns, every other rank follows rank 0's steps and then exits this program.
    Otherwise the other ranks are spawned here, each calling `load_rank` for its shard. On CUDA, symmetric
    memory (the symm_mem_all_reduce pass) never sets up NVLink multicast, here or in the spawned ranks, and
    meets ranks that each see their GPU as cuda:0, whose GPUs `_init_groups` checks are distinct."""
    if device == "cuda":
        symm_mem_multicast_off()
        symm_mem_masked_devices()
    launched = torchrun_rank()
    if dist.is_initialized():
        raise ConfigError("this process already has a torch.distributed process group (an LLM with tensor "
                          "parallel still open?); close it before loading another")  # fmt: skip
    if launched is not None:
        return _join_torchrun(size, device, load_rank, config, *launched)
    cuda_devices = visible_cuda_devices(size) if device == "cuda" else None
    store_dir = tempfile.mkdtemp(prefix="graphkiln-tp-")
    store_path = f"{store_dir}/store"
    context = mp.get_context("spawn")
    processes = {}
    try:
        store = dist.FileStore(store_path, size)
        for rank in range(1, size):
            args = (rank, size, store_path, device, cuda_devices[rank] if cuda_devices else None,
                    torch.get_num_threads(), config.collective_timeout_s, load_rank)  # fmt: skip
            processes[rank] = context.Process(target=_spawned_rank, args=args, daemon=True,
                                              name=f"graphkiln-tp-rank{rank}")  # fmt: skip
            processes[rank].start()
        _wait_for_ranks(store, processes, max(config.collective_timeout_s, START_TIMEOUT_S))
        control = _init_groups(0, size, store, device, config.collective_timeout_s)
    except BaseException as error:
        # A rank that dies while the group meets (a failed load right after, say) breaks the meeting itself:
        # the error to show is that rank's exit, not the connection it closed.
        died = _started_rank_died(processes) if isinstance(error, RuntimeError) else None
        for process in processes.values():
            if process.pid is not None:  # (one whose start raised was never started)
                process.terminate()
        if dist.is_initialized():  # the next load in this process starts a group of its own
            dist.destroy_process_group()
        shutil.rmtree(store_dir, ignore_errors=True)
        if died is not None:
            raise died from error
        raise
    return Group(Shard(0, size), Peers(size, control, processes, store_dir, config.collective_timeout_s))


def _join_torchrun(size: int, device: str, load_rank: LoadRank, config: EngineConfig, rank: int, world: int) -> Group:
    if world != size:
        raise ConfigError(f"torchrun started {world} processes but the artifact is compiled for "
                          f"tensor_parallel_size={size}; start exactly {size} (nnodes x nproc-per-node)")  # fmt: skip
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    control = _init_groups(rank, size, None, device, config.collective_timeout_s)
    if rank == 0:
        return Group(Shard(0, size), Peers(size, control, {}, None, config.collective_timeout_s))
    try:
        follow(Shard(rank, size), load_rank, control)
    finally:
        dist.destroy_process_group()
    raise SystemExit(0)


def parallel_engine(size: int, device: str, load_rank: LoadRank, config: EngineConfig) -> Engine:
    """Rank 0's engine of a group of `size` ranks (see `start_group`), once every rank has built its own; its
    preparation then runs on every rank, as `config.capture` says."""
    from .builder import build_engine, prepare

    group = start_group(size, device, load_rank, config)
    try:
        net, compiled = load_rank(group.shard)  # its errors are the user's to see as they are
        engine = build_engine(net, compiled, config, group.peers, Lockstep(group.peers.control, group.peers))
        kv = engine.runner.kv_cache
        group.ready(config.replace(kv_cache_tokens=(kv.num_blocks - 1) * kv.block_size))
        prepare(engine, config)
    except BaseException:
        group.peers.close()
        raise
    return engine
