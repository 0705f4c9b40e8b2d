"""Start-up: the load breakdown, a warm load that neither traces nor compiles, and requests served while the
engine's background preparation (on the CPU: one warm-up run per bucket) is still running."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

import graphkiln
from artifact_helpers import (ENGINE, GREEDY, PROMPTS, RESULT_PREFIX, SUBPROCESS_TIMEOUT_S, flip_piece_byte_and_rehash,
                              greedy_tokens, run, run_python_json)
from graphkiln import EngineConfig
from graphkiln.errors import ConfigError
from graphkiln.models import kernel_loads
from graphkiln.models.tiny import tiny_model_dir
from graphkiln.models.safetensors_header import read_header
from graphkiln.compiler.artifact_load import read_weights
from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.runtime.builder import build_engine
from graphkiln.runtime.preparation import Preparation, WarmupJob
from graphkiln.runtime.late_steps import LATE_S, MAX_WAIT_S, SHARE, late_steps_first
from graphkiln.runtime.step_lock import StepLock

MANY_SIZES = tuple(range(1, 97))  # 96 decode warm-ups (and prefill 16..64): long enough to step beside
LOAD_STAGES = ["checks", "weights", "tokenizer", "engine"]  # before load returns; weights beside the tokenizer
PIECES_STAGES = ["inductor", "pieces"]  # the background job that loads the compiled pieces


def test_fresh_warm_load_breakdown_without_tracing_or_compiling(artifact: Path, eager_tokens: list[list[int]]) -> None:
    """In a fresh process: the breakdown is filled in order, the weight bytes are the checkpoint's (tied head
    not read), and nothing is traced or compiled by the load, the background warm-ups or the requests."""
    code = f"""
import json, dataclasses, torch
torch.set_num_threads(1)
import graphkiln
from graphkiln.compiler.counters import torch_compile_events
llm = graphkiln.load({str(artifact)!r}, **{ENGINE!r})
outs = llm.generate({PROMPTS!r}, graphkiln.{GREEDY!r})
assert llm.wait_ready(120)
stats = llm.stats()
print({RESULT_PREFIX!r} + json.dumps({{"load": dataclasses.asdict(stats.load), "events": torch_compile_events(),
      "prepared": [dataclasses.asdict(p) for p in stats.prepared], "ready": stats.ready,
      "tokens": [o.token_ids for o in outs]}}))
"""
    result = run_python_json(code)
    load = result["load"]
    stages = load["stages"]
    assert sorted(stages) == sorted(LOAD_STAGES + PIECES_STAGES) and list(stages)[0] == "checks"
    assert list(stages)[-3:] == ["engine"] + PIECES_STAGES  # the pieces job's stages come after load's
    assert all(seconds >= 0 for seconds in stages.values())
    besides_weights = sum(stages[name] for name in LOAD_STAGES if name != "weights")  # the weights overlap them
    assert 0 < load["import_s"] and besides_weights <= load["load_s"] and stages["weights"] <= load["load_s"]
    entries = read_header(tiny_model_dir() / "model.safetensors")
    assert load["weight_bytes"] == sum(e.end - e.start for name, e in entries.items() if name != "lm_head.weight")
    assert load["load_s"] <= load["first_token_s"] and load["load_s"] <= load["prepare_s"]
    assert result["events"]["dynamo_graphs"] == 0 and result["events"]["inductor_compiles"] == 0
    assert result["ready"] and result["prepared"] and not [p for p in result["prepared"] if p["error"]]
    kinds = [(p["kind"], p["key"]) for p in result["prepared"]]
    decode = [("decode-warmup", str(n)) for n in (1, 2, 4)]
    assert kinds == [("pieces", "compiled")] + decode  # prefill buckets above max_num_batched_tokens: left out
    assert result["tokens"] == eager_tokens


def test_import_leaves_inductor_to_load_and_serving_imports_nothing(artifact: Path) -> None:
    """In a fresh process: `import graphkiln` and its API names import no part of Inductor or Dynamo (nor
    transformers), and neither does building the model a load reads the weights into (not even sympy, so the
    read starts at once); a blocking `load` imports Inductor itself (its "inductor" stage, while the weights
    are read) and still not transformers (the artifact keeps a tokenizer snapshot); after it returns, the
    warm-ups and the first requests import nothing more. (A background load imports Inductor in its first
    job, after it returns: test_an_engine_serves_eagerly_until_its_pieces_are_in.)"""
    heavy = ("torch._inductor", "torch._dynamo", "sympy", "transformers", "huggingface_hub")
    code = f"""
import json, sys, torch
from pathlib import Path
torch.set_num_threads(1)
import graphkiln
graphkiln.load, graphkiln.SamplingParams, graphkiln.LLM, graphkiln.EngineConfig, graphkiln.CompileConfig
heavy = {heavy!r}
at_import = [m for m in heavy if m in sys.modules]
from graphkiln.compiler.artifact_load import recorded_config
from graphkiln.compiler.manifest import read_manifest
from graphkiln.models.loader import empty_model
from graphkiln.models import kernel_loads
from graphkiln.models.tiny import tiny_model_dir
artifact = Path({str(artifact)!r})
empty_model(tiny_model_dir(), cfg=recorded_config(read_manifest(artifact), artifact))
at_model = [m for m in heavy if m in sys.modules]
llm = graphkiln.load(artifact, capture="blocking", **{ENGINE!r})
loaded = set(sys.modules)
llm.generate({PROMPTS!r}, graphkiln.{GREEDY!r})
assert llm.wait_ready(120)
print({RESULT_PREFIX!r} + json.dumps({{"at_import": at_import, "at_model": at_model,
      "at_load": [m for m in heavy if m in loaded], "after_load": sorted(set(sys.modules) - loaded),
      "stages": list(llm.stats().load.stages)}}))
"""
    result = run_python_json(code)
    assert result["at_import"] == [] and result["at_model"] == []
    assert result["at_load"] == ["torch._inductor", "torch._dynamo", "sympy"]  # what Inductor's artifacts need
    assert "inductor" in result["stages"]
    assert result["after_load"] == []


def test_an_engine_serves_eagerly_until_its_pieces_are_in(artifact: Path, eager_tokens: list[list[int]]) -> None:
    """A background load returns with the weights in and the compiled pieces still to come: requests are served
    by the model itself until the first background job has loaded the pieces (held back here until the first
    request is done) and switched the runner over; then the warm-ups run, and the compiled engine gives the
    same tokens."""
    net, tokenizer, _, pieces = read_weights(artifact, tiny_model_dir())
    held = threading.Event()

    def held_back_pieces() -> CompiledModel:
        assert held.wait(120)
        return pieces()

    llm = graphkiln.LLM(build_engine(net, None, EngineConfig(kv_cache_tokens=2048), pieces=held_back_pieces),
                        tokenizer)  # fmt: skip
    runner = llm.engine.runner
    assert greedy_tokens(llm) == eager_tokens
    assert runner.forward is net and not llm.stats().prepared
    held.set()
    assert llm.wait_ready(120)
    prepared = llm.stats().prepared
    assert [(p.kind, p.error) for p in prepared[:1]] == [("pieces", None)] and len(prepared) > 1
    assert isinstance(runner.forward, CompiledModel)
    assert greedy_tokens(llm) == eager_tokens
    llm.close()


def test_eager_kernels_launch_beside_the_weights_after_the_graph_is_unpickled(
        artifact: Path, eager_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """With launches turned on for the CPU too, a background load runs one eager forward per first-call row count
    beside the weights, never beside the stitching graph's unpickling (an FX trace, which intercepts every
    module call and made such a forward fail), and the engine serves the eager model's tokens after it."""
    monkeypatch.setattr(kernel_loads, "LAUNCH_ON", ("cuda", "cpu"))
    for _ in range(3):  # the graph's unpickling and the launches used to race: a few loads to meet it
        before = kernel_loads.forwards_launched()
        net, tokenizer, _, pieces = read_weights(artifact, tiny_model_dir(), warm_rows=(1, 16))
        assert kernel_loads.forwards_launched() == before + 2
    llm = graphkiln.LLM(build_engine(net, None, EngineConfig(kv_cache_tokens=2048), pieces=pieces), tokenizer)
    assert greedy_tokens(llm) == eager_tokens
    llm.close()


def test_the_caller_may_import_dynamo_while_the_pieces_load(artifact: Path) -> None:
    """In a fresh process: right after a background load, the caller reads Dynamo's counters (importing Dynamo,
    and through it Inductor) while the pieces job imports Inductor: both imports complete and the pieces load."""
    code = f"""
import json, graphkiln
from graphkiln.compiler.counters import torch_compile_events
llm = graphkiln.load({str(artifact)!r}, **{ENGINE!r})
events = torch_compile_events()
tokens = [o.token_ids for o in llm.generate({PROMPTS!r}, graphkiln.{GREEDY!r})]
compiled = llm.wait_compiled(120)
print({RESULT_PREFIX!r} + json.dumps({{"compiled": compiled, "errors": [p.error for p in llm.stats().prepared if p.error],
      "events": events}}))
"""
    result = run_python_json(code)
    assert result["compiled"] and result["errors"] == [] and result["events"]["inductor_compiles"] == 0


def test_a_script_that_ends_while_the_pieces_load_exits_quietly(artifact: Path) -> None:
    """A fresh process that serves one request and ends while the pieces job still imports Inductor exits with
    0 and logs no failure: the job's imports fail once the interpreter shuts down, which is nobody's error."""
    code = f"""
import graphkiln
llm = graphkiln.load({str(artifact)!r}, **{ENGINE!r})
llm.generate({PROMPTS[:1]!r}, graphkiln.{GREEDY!r})
"""
    proc = run([sys.executable, "-c", code], timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0 and "failed" not in proc.stderr, proc.stderr[-4000:]


def test_closing_a_background_loaded_engine_frees_its_weights(artifact: Path) -> None:
    """Once the pieces are in, close() leaves nothing holding the weights: not the pieces job, whose compiled
    model binds every parameter (the device memory would stay taken until the engine object went)."""
    llm = graphkiln.load(artifact, **ENGINE)
    assert llm.wait_compiled(120)
    weights = weakref.ref(next(llm.engine.runner.model.parameters()))
    engine = llm.engine
    llm.close()
    assert weights() is None
    del engine


def test_inside_captures_paused_preparation_waits_and_steps_go_on(artifact: Path, eager_tokens: list[list[int]]) -> None:
    """While a thread holds `captures_paused()` (as compile_model does), a background load serves eagerly and
    its preparation does not get past the pieces' unlocked part; an engine closed in there closes without
    waiting for its preparation thread. Once the block ends, the preparation completes."""
    with graphkiln.captures_paused():
        llm = graphkiln.load(artifact, **ENGINE)
        assert greedy_tokens(llm) == eager_tokens
        assert not llm.wait_compiled(5) and llm.stats().prepared == ()
        other = graphkiln.load(artifact, **ENGINE)
        other.close()
    assert llm.wait_ready(120)
    assert [p.error for p in llm.stats().prepared if p.error] == []
    llm.close()


def test_pieces_that_fail_to_load_leave_the_engine_serving_eagerly(art: Path, eager_tokens: list[list[int]]) -> None:
    """A piece that cannot be loaded (its sha256 fixed up, so the load's checks pass) fails the background job,
    which is recorded with the piece's path; the engine keeps serving with the model itself."""
    piece = flip_piece_byte_and_rehash(art)
    llm = graphkiln.load(art, **ENGINE)
    assert llm.wait_ready(120)
    prepared = llm.stats().prepared
    assert [p.kind for p in prepared] == ["pieces"] and str(piece) in prepared[0].error
    assert llm.engine.runner.forward is llm.engine.runner.model
    assert greedy_tokens(llm) == eager_tokens
    llm.close()


def test_a_request_is_served_while_preparation_runs(artifact: Path) -> None:
    """Steps and warm-ups take turns: the request arrives before the preparation is done, every step runs,
    preparation advances between them, and the tokens are those of an engine prepared before serving."""
    want = greedy_tokens(graphkiln.load(artifact, decode_batch_sizes=(1, 2, 4), capture="blocking", **ENGINE))
    llm = graphkiln.load(artifact, decode_batch_sizes=MANY_SIZES, **ENGINE)
    assert llm.wait_compiled(120)  # the warm-ups are planned once the pieces are in
    engine = llm.engine
    total = engine.preparation.planned
    seqs = [engine.add_request(llm.encode(p), GREEDY) for p in PROMPTS]
    prepared = []
    while any(s.finish_reason is None for s in seqs):
        engine.step()
        prepared.append(len(llm.stats().prepared))
    assert prepared[0] < total, "the preparation was done before the first step: nothing was tested"
    assert prepared[-1] > prepared[0]  # it ran between the steps
    assert [list(s.output_ids) for s in seqs] == want
    assert llm.wait_ready(120) and llm.stats().ready
    assert len(llm.stats().prepared) == total
    load = llm.stats().load
    assert load.first_token_s < load.prepare_s


def test_close_during_preparation_skips_the_rest(artifact: Path) -> None:
    llm = graphkiln.load(artifact, decode_batch_sizes=MANY_SIZES, **ENGINE)
    preparation = llm.engine.preparation
    llm.close()
    assert preparation.ready and len(preparation.done) < preparation.planned and not preparation.jobs


def test_blocking_capture_prepares_before_load_returns(artifact: Path) -> None:
    llm = graphkiln.load(artifact, capture="blocking", **ENGINE)
    stats = llm.stats()
    assert stats.ready and len(stats.prepared) == llm.engine.preparation.planned > 0
    assert stats.load.prepare_s <= stats.load.load_s


def test_capture_mode_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"EngineConfig\.capture='later'.*background"):
        EngineConfig(capture="later")


def test_a_failing_job_is_recorded_and_the_rest_still_run() -> None:
    """The preparation with jobs of its own: one raises; it is logged and recorded, the others run."""
    ran = []

    def fail() -> None:
        raise RuntimeError("no graph for you")

    jobs = [WarmupJob("decode", "1", lambda: ran.append(1)), WarmupJob("decode", "2", fail),
            WarmupJob("decode", "4", lambda: ran.append(4))]  # fmt: skip
    import torch

    preparation = Preparation(jobs, StepLock(), torch.device("cpu"))
    preparation.start()
    assert preparation.wait(30)
    assert ran == [1, 4]
    assert [(p.key, p.error) for p in preparation.done] == [("1", None), ("2", "RuntimeError: no graph for you"),
                                                            ("4", None)]  # fmt: skip
    assert isinstance(preparation.errors[0], RuntimeError)


@contextlib.contextmanager
def taken_over_and_over(lock: StepLock, background: bool) -> Iterator[list[float]]:
    """A thread that takes `lock` (as a step, or as a background turn) without pause; the times of its turns."""
    turns, stop = [], threading.Event()

    def take() -> None:
        while not stop.is_set():
            with lock(background=background):
                turns.append(time.perf_counter())
                time.sleep(0.002)

    thread = threading.Thread(target=take)
    thread.start()
    try:
        time.sleep(0.02)
        yield turns
    finally:
        stop.set()
        thread.join()


def test_a_waiting_background_turn_comes_before_the_next_step() -> None:
    """A thread that steps without pause cannot starve a background turn: it gets the lock within one step."""
    lock = StepLock()
    with taken_over_and_over(lock, background=False) as steps:
        asked = time.perf_counter()
        with lock(background=True):
            got = time.perf_counter()
            before = len(steps)
        assert len([t for t in steps[:before] if t > asked]) <= 1  # at most the step that held the lock
        assert got - asked < 1.0


def test_reentrant_for_its_holder() -> None:
    lock = StepLock()
    with lock(), lock():
        pass
    with lock(background=True), lock():
        pass


def test_a_waiting_step_comes_before_the_next_background_turn() -> None:
    """Background turns back to back (a preparation's jobs) let a waiting step in after the current one."""
    lock = StepLock()
    with taken_over_and_over(lock, background=True) as turns:
        asked = time.perf_counter()
        with lock():
            before = len(turns)
        assert len([t for t in turns[:before] if t > asked]) <= 1


def test_a_taker_held_up_by_a_background_turn_gets_its_wait() -> None:
    """A taker that finds the lock free waited 0 s; one that waits behind a background turn gets its wait."""
    lock = StepLock()
    with lock() as waited:
        assert waited == 0.0
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock(background=True):
            taken.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    threading.Timer(0.1, release.set).start()
    with lock() as waited:
        pass
    holder.join()
    assert 0.09 <= waited < 10


def _import_fresh(folder: Path, name: str) -> float:
    """Seconds to import a new module `name` written into `folder` (on sys.path)."""
    (folder / f"{name}.py").write_text("VALUE = 1\n")
    start = time.perf_counter()
    __import__(name)
    return time.perf_counter() - start


def test_a_jobs_imports_give_way_to_a_late_step_and_only_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside late_steps_first, an import waits for a step that has held the lock past LATE_S (once a step, at
    most MAX_WAIT_S), not for a step that has just begun, nor for a background turn; other threads' imports
    never wait."""
    monkeypatch.syspath_prepend(str(tmp_path))
    lock = StepLock()
    held, release = threading.Event(), threading.Event()

    def hold(background: bool) -> None:
        with lock(background=background):
            held.set()
            release.wait(10)

    def timed_import_while_held(name: str, background: bool, age_s: float, release_after_s: float) -> tuple:
        held.clear(), release.clear()
        holder = threading.Thread(target=hold, args=(background,))
        holder.start()
        assert held.wait(10)
        time.sleep(age_s)
        threading.Timer(release_after_s, release.set).start()
        with late_steps_first(lock) as finder:
            seconds = _import_fresh(tmp_path, name)
        holder.join()
        return seconds, finder.waits

    seconds, waits = timed_import_while_held("gk_late_step", False, LATE_S * 2, 0.05)
    assert waits == 1 and seconds >= 0.04  # waited for the late step to end
    seconds, waits = timed_import_while_held("gk_long_step", False, LATE_S * 2, 1.0)
    assert waits == 1 and MAX_WAIT_S * 0.9 <= seconds < 0.9  # no longer than MAX_WAIT_S
    seconds, waits = timed_import_while_held("gk_background_turn", True, LATE_S * 2, 0.2)
    assert waits == 0 and seconds < 0.1
    release.clear(), held.clear()
    holder = threading.Thread(target=hold, args=(False,))
    holder.start()
    assert held.wait(10)
    time.sleep(LATE_S * 2)
    with late_steps_first(lock) as finder:
        elsewhere = threading.Thread(target=_import_fresh, args=(tmp_path, "gk_other_thread"))
        start = time.perf_counter()
        elsewhere.start()
        elsewhere.join()
        assert time.perf_counter() - start < 0.1 and finder.waits == 0  # another thread's import: no wait
    release.set()
    holder.join()


def test_a_job_among_late_steps_gives_way_for_at_most_its_share(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps back to back, each late (a large model's eager steps): the job's imports give way to some of them,
    and its waits add up to at most SHARE of its time plus one MAX_WAIT_S."""
    monkeypatch.syspath_prepend(str(tmp_path))
    lock, stop = StepLock(), threading.Event()

    def steps() -> None:
        while not stop.is_set():
            with lock():
                time.sleep(LATE_S * 4)

    stepping = threading.Thread(target=steps)
    stepping.start()
    try:
        start = time.perf_counter()
        with late_steps_first(lock) as finder:
            for i in range(30):
                _import_fresh(tmp_path, f"gk_among_steps_{i}")
                time.sleep(0.01)
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        stepping.join()
    assert finder.waits > 1
    assert finder.waited_s <= SHARE * elapsed + MAX_WAIT_S + 0.02
