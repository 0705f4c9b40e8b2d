"""Start-up: the load breakdown, a warm load that neither traces nor compiles, and requests served while the
engine's background preparation (on the CPU: one warm-up run per bucket) is still running."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

import graphkiln
from artifact_helpers import (ENGINE, GREEDY, PROMPTS, RESULT_PREFIX, SUBPROCESS_TIMEOUT_S, flip_piece_byte_and_rehash,
                              greedy_tokens, run, run_python_json)
from graphkiln import EngineConfig
from graphkiln.api import build_serving_kernels
from graphkiln.compat import pin_triton_environment
from graphkiln.errors import ConfigError
from graphkiln.models import kernel_loads
from graphkiln.models.tiny import tiny_model_dir
from graphkiln.models.safetensors_header import read_header
from graphkiln.compiler import artifact_load
from graphkiln.compiler.artifact_load import read_weights
from graphkiln.compiler.manifest import read_manifest
from graphkiln.compiler.compiled_model import CompiledModel
from graphkiln.runtime import warmup
from graphkiln.runtime.builder import build_engine
from graphkiln.runtime.sampler import MODES, sample

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


def test_eager_kernels_launch_beside_the_weights(
        artifact: Path, eager_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """With launches turned on for the CPU too, a background load runs one eager forward per first-call row count
    beside the weights, and the engine serves the eager model's tokens after it."""
    monkeypatch.setattr(kernel_loads, "LAUNCH_ON", ("cuda", "cpu"))
    before = kernel_loads.forwards_launched()
    net, tokenizer, _, pieces = read_weights(artifact, tiny_model_dir(), warm_rows=(1, 16))
    assert kernel_loads.forwards_launched() == before + 2
    llm = graphkiln.LLM(build_engine(net, None, EngineConfig(kv_cache_tokens=2048), pieces=pieces), tokenizer)
    assert greedy_tokens(llm) == eager_tokens
    llm.close()


def test_the_sampler_first_calls_run_ahead_of_the_checks(artifact: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """With launches turned on for the CPU too, `read_weights(ahead=sampler_ahead(manifest, None))` samples each mode
    at one row and at SAMPLED_ROWS, on the vocabulary's width, on a thread of its own that starts before the
    checks and is done before it returns; a sampler that fails there is logged and the load goes on; a manifest
    naming no usable vocabulary size, or a device the caller rules out, starts nothing."""
    monkeypatch.setattr(warmup, "LAUNCH_ON", ("cuda", "cpu"))
    events = []
    sampling = threading.Event()

    def recorded(logits: torch.Tensor, rows, mode: str):
        events.append(("sample", threading.current_thread().name, tuple(logits.shape), mode))
        sampling.set()
        return sample(logits, rows, mode)

    checks = artifact_load.check_artifact

    def checked(*args, **kwargs):  # the checks wait for the sampler: it must have started without them
        events.append(("checks", sampling.wait(60)))
        return checks(*args, **kwargs)

    monkeypatch.setattr(warmup, "sample", recorded)
    monkeypatch.setattr(artifact_load, "check_artifact", checked)
    manifest = read_manifest(artifact)
    net, *_ = read_weights(artifact, tiny_model_dir(), ahead=warmup.sampler_ahead(manifest, None))
    samples = [e for e in events if e[0] == "sample"]
    vocab = net.cfg.vocab_size
    assert sorted((shape, mode) for _, _, shape, mode in samples) == sorted(
        ((rows, vocab), mode) for rows in (1, warmup.SAMPLED_ROWS) for mode in MODES)
    assert {name.rsplit("_", 1)[0] for _, name, _, _ in samples} == {"graphkiln-ahead"}
    assert ("checks", True) in events

    def failing(logits: torch.Tensor, rows, mode: str):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(warmup, "sample", failing)
    with caplog.at_level("WARNING", logger="graphkiln.runtime"):
        net, *_ = read_weights(artifact, tiny_model_dir(), ahead=warmup.sampler_ahead(manifest, None))
    assert "sampler's first calls ahead of the model failed (RuntimeError: no kernel image)" in caplog.text

    config = {**manifest["model"]["config"], "vocab_size": -1}
    bad_vocab = {**manifest, "model": {**manifest["model"], "config": config}}
    assert warmup.sampler_ahead(bad_vocab, None) is None
    assert warmup.sampler_ahead({}, None) is None
    assert warmup.sampler_ahead(manifest, "meta") is None  # the caller asked for another device: the checks refuse


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


def test_building_serving_kernels_loads_the_artifact_once_and_leaves_nothing_running(
        artifact: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """`build_serving_kernels` (what compile_model runs on CUDA) loads the artifact, waits until every bucket is
    prepared, with a KV cache of the largest decode bucket alone, and closes it: no warning, and no preparation
    thread is left."""
    with caplog.at_level("WARNING", logger="graphkiln.api"):
        assert build_serving_kernels(artifact) > 0
    assert [r.getMessage() for r in caplog.records if r.name == "graphkiln.api"] == []
    assert not [t for t in threading.enumerate() if t.name == "graphkiln-prepare"]


def test_building_serving_kernels_of_a_broken_artifact_warns_and_never_raises(
        art: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A piece that cannot be loaded, or no artifact at all: a warning naming the artifact and the error (the
    first start builds the kernels then), never an exception out of the compile that ran it."""
    piece = flip_piece_byte_and_rehash(art)
    with caplog.at_level("WARNING", logger="graphkiln.api"):
        build_serving_kernels(art)
        build_serving_kernels(art.parent / "missing")
    warnings = [r.getMessage() for r in caplog.records if r.name == "graphkiln.api"]
    assert len(warnings) == 2 and str(piece) in warnings[0] and "ArtifactError" in warnings[0]
    assert str(art.parent / "missing") in warnings[1]


def test_triton_settings_are_pinned_and_the_users_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Unset, TRITON_CACHE_DIR becomes Triton's own default folder and TRITON_PTXAS_PATH torch's ptxas where torch
    ships one (where Triton is installed), so Inductor, which sets each only where it is unset, cannot change
    them midway through a process; what the user chose stays."""
    chosen = {"TRITON_CACHE_DIR": str(tmp_path / "chosen"), "TRITON_PTXAS_PATH": str(tmp_path / "my-ptxas")}
    for name, value in chosen.items():
        monkeypatch.setenv(name, value)
    pin_triton_environment()
    assert {name: os.environ[name] for name in chosen} == chosen
    for name in chosen:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    pin_triton_environment()
    if importlib.util.find_spec("triton") is None:
        assert not any(name in os.environ for name in chosen)
        return
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home" / ".triton" / "cache")
    ptxas = Path(torch.__file__).parent / "bin" / "ptxas"
    assert os.environ.get("TRITON_PTXAS_PATH") == (str(ptxas) if ptxas.is_file() else None)
