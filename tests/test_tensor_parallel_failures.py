"""Tensor parallel when a rank fails, on the CPU (real gloo groups of 2 ranks): a rank that dies, stops or
cannot start, rank 0 dying or interrupted. Each failure is a RankFailedError naming the rank (or why), within a
bounded time, and leaves no process, process group or temporary folder behind."""

from __future__ import annotations

import os
import multiprocessing
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist

import graphkiln
from artifact_helpers import ENGINE, subprocess_env
from graphkiln import SamplingParams
from graphkiln.errors import ModelFileError, RankFailedError
from graphkiln.models import load_model
from graphkiln.models.sharding import Shard
from graphkiln.runtime.runner import ModelRunner
from graphkiln.runtime.tensor_parallel import parallel_engine

if TYPE_CHECKING:
    from conftest import Checkpoint

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = [5, 9, 23, 7, 3, 11, 2, 8, 4]
DEAD_RANK_LIMIT_S = 30  # a killed rank is noticed at the next collective: its sockets close
TIMEOUT_S = 10  # a stopped rank is noticed by the timeout alone, which also bounds the ranks' start on a busy machine
TIMED = {**ENGINE, "collective_timeout_s": TIMEOUT_S}
MANY_SIZES = tuple(range(1, 25))  # 24 decode warm-ups, then prefill 16: long enough to step beside and to stop


def test_dead_rank_fails_the_parent_naming_it(llama: Checkpoint) -> None:
    llm = graphkiln.LLM.eager(llama.path, tensor_parallel_size=2, **ENGINE)
    peers = llm.engine.runner.peers
    stream = llm.generate_stream(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    os.kill(peers.pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=rf"rank 1 \(pid {peers.pids[1]}\) exited with code -9"):
        for _ in stream:
            pass
    assert time.monotonic() - start < DEAD_RANK_LIMIT_S
    with pytest.raises(RankFailedError, match="rank 1"):  # the LLM stays failed, it does not hang
        llm.generate([[1, 2, 3]], GREEDY)
    llm.close()
    assert not dist.is_initialized()


def test_interrupt_inside_a_step_ends_the_group(llama: Checkpoint, monkeypatch) -> None:
    """Ctrl-C while rank 0 is inside a step (its ids sent, rank 1 in the step's collectives): the interrupt
    reaches the caller, and the next request is told the group stopped rather than waiting on rank 1."""
    llm = graphkiln.LLM.eager(llama.path, tensor_parallel_size=2, **ENGINE)
    rank_1 = llm.engine.runner.peers.processes[1]
    run_step, calls = ModelRunner._run, iter(range(100))

    def interrupted(*args, **kwargs):
        if next(calls) == 2:
            raise KeyboardInterrupt
        return run_step(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT], GREEDY)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="a step was interrupted on tensor-parallel rank 0 .KeyboardInterrupt"):
        llm.generate([[1, 2, 3]], GREEDY)
    assert time.monotonic() - start < DEAD_RANK_LIMIT_S
    llm.close()
    assert not dist.is_initialized() and rank_1.exitcode is not None


def test_a_stopped_rank_fails_the_next_step_and_close_ends_it(llama: Checkpoint) -> None:
    """A rank that is alive but takes no message (stopped, hung) holds rank 0 for at most the collective
    timeout: the step fails naming why, and closing ends the group, the stopped rank too."""
    llm = graphkiln.LLM.eager(llama.path, tensor_parallel_size=2, **TIMED)
    rank_1 = llm.engine.runner.peers.processes[1]
    os.kill(rank_1.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=rf"did not take rank 0's next message within {TIMEOUT_S} s .* stopped"):
        llm.generate([[1, 2, 3]], GREEDY)
    assert time.monotonic() - start < DEAD_RANK_LIMIT_S
    llm.close()
    assert not dist.is_initialized() and rank_1.exitcode == -signal.SIGKILL


def test_closing_with_a_stopped_rank_returns(llama: Checkpoint) -> None:
    llm = graphkiln.LLM.eager(llama.path, tensor_parallel_size=2, **TIMED)
    rank_1 = llm.engine.runner.peers.processes[1]
    os.kill(rank_1.pid, signal.SIGSTOP)
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < DEAD_RANK_LIMIT_S
    assert not dist.is_initialized() and rank_1.exitcode == -signal.SIGKILL


def _rank1_exits(path: Path, shard: Shard):
    if shard.rank == 1:
        os._exit(3)
    return load_model(path, shard=shard), None


def test_rank_dying_while_loading_is_named(llama: Checkpoint) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code 3"):
        parallel_engine(2, "cpu", partial(_rank1_exits, llama.path), graphkiln.EngineConfig(**ENGINE))
    assert time.monotonic() - start < DEAD_RANK_LIMIT_S
    assert not dist.is_initialized()


def test_a_rank_dying_while_the_group_meets_is_named_and_the_group_ended(llama: Checkpoint, monkeypatch) -> None:
    """Rank 1 joins, leaves the meeting before rank 0 is done with it and dies loading: rank 0's meeting fails
    on the closed connection. The error names rank 1's exit, and this process keeps no process group, so the
    next load can start one."""
    from graphkiln.runtime import tensor_parallel

    meet = tensor_parallel._init_groups

    def meeting_broken_after(*args):
        meet(*args)
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(tensor_parallel, "_init_groups", meeting_broken_after)
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code 3 while starting"):
        parallel_engine(2, "cpu", partial(_rank1_exits, llama.path), graphkiln.EngineConfig(**ENGINE))
    assert not dist.is_initialized()


def test_a_rank_that_cannot_be_started_shows_why(llama: Checkpoint, monkeypatch) -> None:
    """The process of rank 1 fails to start (no process can be made): that error reaches the caller, not one from
    cleaning up a process that never ran, and no process group is left."""
    from multiprocessing.context import SpawnProcess

    def refused(self) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(SpawnProcess, "start", refused)
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        parallel_engine(2, "cpu", partial(_rank1_exits, llama.path), graphkiln.EngineConfig(**ENGINE))
    assert not dist.is_initialized()


def test_rank_failing_to_start_is_named(llama: Checkpoint) -> None:
    """A program read from stdin cannot be spawned again (the child re-runs the parent's main file): the
    parent says so at once instead of waiting for the group's timeout."""
    load = f"graphkiln.LLM.eager({str(llama.path)!r}, tensor_parallel_size=2, kv_cache_tokens=2048)"
    script = f"import graphkiln\n{load}\n"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-"], input=script, env=subprocess_env(), capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 1
    assert re.search(r"RankFailedError: tensor-parallel rank 1 \(pid \d+\) exited with code 1 while starting",
                     result.stderr)  # fmt: skip
    assert time.monotonic() - start < 60


def test_rank_0_dying_stops_the_others(llama: Checkpoint, tmp_path: Path) -> None:
    """Rank 0 killed mid-generate: the rank it started exits on its own, saying rank 0 is gone, and removes the
    folder of the group's store, which rank 0 no longer can."""
    script = tmp_path / "die.py"
    script.write_text(
        "import os, signal\nimport graphkiln\n\nif __name__ == '__main__':\n"
        f"    llm = graphkiln.LLM.eager({str(llama.path)!r}, tensor_parallel_size=2, kv_cache_tokens=2048)\n"
        "    stream = llm.generate_stream([1, 2, 3], graphkiln.SamplingParams(max_tokens=200, ignore_eos=True))\n"
        "    next(stream)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    start = time.monotonic()
    (tmp := tmp_path / "tmp").mkdir()
    env = {**subprocess_env(), "PYTHONPATH": str(Path(graphkiln.__file__).parents[1]), "TMPDIR": str(tmp)}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                            timeout=120)  # returns once the orphaned rank closed its stderr too  # fmt: skip
    assert result.returncode == -signal.SIGKILL
    assert "graphkiln: tensor-parallel rank 1 stops: RankFailedError: rank 0 is gone" in result.stderr
    assert time.monotonic() - start < 60
    assert not list(tmp.glob("graphkiln-tp-*"))


def test_rank_killed_during_preparation_is_named(tiny_tp: Path) -> None:
    llm = graphkiln.load(tiny_tp, decode_batch_sizes=MANY_SIZES, **ENGINE)
    pid = llm.engine.runner.peers.pids[1]
    with llm.engine.lock():  # between two warm-ups
        assert not llm.engine.preparation.ready
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=rf"rank 1 \(pid {pid}\) exited with code -9 during preparing"):
        llm.wait_ready(DEAD_RANK_LIMIT_S)
    assert time.monotonic() - start < DEAD_RANK_LIMIT_S
    with pytest.raises(RankFailedError, match="rank 1"):  # the LLM stays failed, it does not hang
        llm.generate([[1, 2, 3]], GREEDY)
    llm.close()
    assert not dist.is_initialized()


def _rank1_stops_in_its_third_job(artifact: Path, shard: Shard):
    """Rank 1 of `artifact` stops itself (SIGSTOP: a debugger, a hung lock) before its third preparation report."""
    from graphkiln.api import _artifact_rank
    from graphkiln.models.tiny import tiny_model_dir
    from graphkiln.runtime.lockstep import Lockstep

    if shard.rank == 1:
        agree, calls = Lockstep.agree, iter(range(1, 100))

        def stopping(self, *args):
            if next(calls) == 3:
                os.kill(os.getpid(), signal.SIGSTOP)
            return agree(self, *args)

        Lockstep.agree = stopping
    return _artifact_rank(artifact, tiny_model_dir(), "cpu", torch.float32, (), shard)


def test_a_rank_stopped_inside_a_preparation_job_fails_it_in_time(tiny_tp: Path) -> None:
    config = graphkiln.EngineConfig(decode_batch_sizes=MANY_SIZES, **TIMED)
    engine = parallel_engine(2, "cpu", partial(_rank1_stops_in_its_third_job, tiny_tp), config)
    rank_1 = engine.runner.peers.processes[1]
    with pytest.raises(RankFailedError, match=rf"did not report on the preparation job within {TIMEOUT_S} s"):
        engine.preparation.wait(DEAD_RANK_LIMIT_S)
    engine.close()
    assert not dist.is_initialized() and rank_1.exitcode == -signal.SIGKILL


def test_ctrl_c_in_the_terminal_leaves_the_ranks_to_rank_0(llama: Checkpoint) -> None:
    """SIGINT reaches every process of the terminal: the spawned rank leaves it to rank 0, which decides."""
    with graphkiln.LLM.eager(llama.path, tensor_parallel_size=2, **ENGINE) as llm:
        expected = llm.generate([PROMPT], GREEDY)[0].token_ids
        os.kill(llm.engine.runner.peers.pids[1], signal.SIGINT)
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected


def test_a_failed_llm_keeps_nothing_and_its_close_ends_only_its_group(llama: Checkpoint) -> None:
    """After its group failed, an LLM holds no traceback (which would hold it, its KV cache and every failed
    call's frames), and closing it later leaves alone the group another LLM has started since."""
    failed = graphkiln.LLM.eager(llama.path, tensor_parallel_size=2, **ENGINE)
    peers = failed.engine.runner.peers
    os.kill(peers.pids[1], signal.SIGKILL)
    for _ in range(3):
        with pytest.raises(RankFailedError, match="rank 1"):
            failed.generate([PROMPT], GREEDY)
    assert peers.failure.__traceback__ is None and peers.failure.__cause__ is None
    with graphkiln.LLM.eager(llama.path, tensor_parallel_size=2, **ENGINE) as other:
        failed.close()
        assert len(other.generate([PROMPT], GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert not dist.is_initialized()


def test_a_bad_tokenizer_leaves_no_rank_behind(llama: Checkpoint, tmp_path: Path) -> None:
    broken = tmp_path / "model"
    shutil.copytree(llama.path, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer"):
        graphkiln.LLM.eager(broken, tensor_parallel_size=2, **ENGINE)
    assert not dist.is_initialized() and not multiprocessing.active_children()
