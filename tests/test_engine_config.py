"""EngineConfig is the engine's: load-time choices, recorded defaults, memory sizing, and giving memory back."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

import graphkiln
from artifact_helpers import COMPILED, ENGINE, SMALL_ENGINE, run_python_json
from graphkiln import EngineConfig, SamplingParams
from graphkiln.errors import CapacityError, ConfigError, RequestError


def test_load_takes_the_recorded_engine_defaults_and_overrides_them(artifact: Path) -> None:
    recorded = graphkiln.load(artifact, **ENGINE).stats().config
    assert recorded.decode_batch_sizes == SMALL_ENGINE.decode_batch_sizes
    assert recorded.prefill_token_buckets == SMALL_ENGINE.prefill_token_buckets
    stats = graphkiln.load(artifact, decode_batch_sizes=(1, 2), kv_cache_tokens=4096, max_num_seqs=8).stats()
    assert stats.config.decode_batch_sizes == (1, 2) and stats.config.max_num_seqs == 8
    assert stats.kv_cache_blocks == 4096 // 16 + 1  # the dummy block beside them
    given = graphkiln.load(artifact, engine=EngineConfig(kv_cache_tokens=1024, block_size=32)).stats()
    assert given.kv_cache_blocks == 1024 // 32 + 1 and given.config.decode_batch_sizes == EngineConfig().decode_batch_sizes


def recorded_steps(llm: graphkiln.LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(tokens, tokens padded to) of each forward the engine's runner makes from now on."""
    runner, steps = llm.engine.runner, []
    run = runner._run

    def recorded(padded, input_ids, num_tokens, long_prefill):
        steps.append((num_tokens, padded.num_tokens))
        return run(padded, input_ids, num_tokens, long_prefill)

    monkeypatch.setattr(runner, "_run", recorded)
    return steps


def test_load_pads_to_the_decode_sizes_it_was_given(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without graphs (the CPU) a compiled engine pads to the capture sizes a GPU would replay: three rows' decode
    steps run the compiled pieces on 8."""
    llm = graphkiln.load(artifact, decode_batch_sizes=(8,), **COMPILED)
    steps = recorded_steps(llm, monkeypatch)
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert steps.count((3, 8)) == 2 and not llm.stats().graphs


def test_sizes_no_step_can_reach_are_neither_padded_to_nor_called_first(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode size past max_num_seqs and a prefill bucket past max_num_batched_tokens: padding a step (or a first
    call) to them would allocate for a billion rows; the steps run at their own sizes and give the same tokens."""
    huge = 10**9
    want = graphkiln.load(artifact, **COMPILED).generate(["a", "b", "c"], SamplingParams(max_tokens=3, temperature=0))
    llm = graphkiln.load(artifact, decode_batch_sizes=(huge,), prefill_token_buckets=(huge,), **COMPILED)
    steps = recorded_steps(llm, monkeypatch)
    got = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3, temperature=0))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert steps and all(tokens == padded for tokens, padded in steps)


def test_unknown_engine_option_is_a_config_error(artifact: Path) -> None:
    with pytest.raises(ConfigError, match="unknown engine option kv_cache_size"):
        graphkiln.load(artifact, kv_cache_size=10)


@pytest.mark.parametrize("engine", [{"max_num_seqs": 2}, 5], ids=["dict", "int"])
def test_an_engine_that_is_not_an_engine_config_is_a_config_error(artifact: Path, tmp_path: Path, engine) -> None:
    for build in (lambda: graphkiln.load(artifact, engine=engine), lambda: graphkiln.LLM.eager("tiny", engine=engine),
                  lambda: graphkiln.LLM.compile("tiny", engine=engine),
                  lambda: graphkiln.compile_model("tiny", tmp_path / "out", engine=engine)):  # fmt: skip
        with pytest.raises(ConfigError, match=r"engine=.*: give an EngineConfig, or its fields as keyword arguments"):
            build()


@pytest.mark.parametrize("size", ["2", 0, 1.0, True], ids=["str", "zero", "float", "bool"])
def test_a_tensor_parallel_size_that_is_not_a_positive_int_is_a_config_error(size) -> None:
    with pytest.raises(ConfigError, match=rf"tensor_parallel_size={size!r}: give an int >= 1"):
        graphkiln.LLM.eager("tiny", tensor_parallel_size=size)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 1e10, "60", True],
                         ids=["zero", "negative", "nan", "inf", "past-a-year", "str", "bool"])  # fmt: skip
def test_a_collective_timeout_outside_a_year_is_a_config_error(timeout) -> None:
    """Past what torch.distributed's timeouts hold, a timeout overflowed there or hung a send."""
    with pytest.raises(ConfigError, match=r"EngineConfig.collective_timeout_s=.*at most 31536000 \(a year\)"):
        EngineConfig(collective_timeout_s=timeout)


def test_a_kv_cache_that_cannot_fit_names_its_size() -> None:
    with pytest.raises(CapacityError, match=r"kv_cache_tokens=1000000000000 needs .* GiB of KV cache .*lower kv_cache_tokens"):
        graphkiln.LLM.eager("tiny", kv_cache_tokens=10**12)


@pytest.mark.parametrize("block_size", [2**15, 2**40], ids=["past-the-cache", "past-memory"])
def test_a_block_larger_than_the_default_kv_cache_names_block_size(artifact: Path, block_size: int) -> None:
    """It used to be blamed on kv_cache_tokens (the cache's bytes, rounded up to one block) or on the cache's
    block count."""
    with pytest.raises(ConfigError, match=rf"block_size={block_size} exceeds the 16384 tokens .*lower block_size"):
        graphkiln.load(artifact, block_size=block_size)


def test_errors_import_neither_the_compiler_nor_dynamo() -> None:
    result = run_python_json(
        "import json, sys\n"
        "import graphkiln.errors, graphkiln.runtime.config\n"
        "heavy = [m for m in sys.modules if m.startswith(('torch._dynamo', 'graphkiln.compiler', 'transformers'))]\n"
        "print('RESULT-JSON ' + json.dumps({'heavy': heavy, 'torch': 'torch' in sys.modules}))\n"
    )
    assert result == {"heavy": [], "torch": False}


def test_dropping_an_llm_frees_its_engine_without_a_collection(artifact: Path) -> None:
    gc.disable()
    try:
        llm = graphkiln.load(artifact, **ENGINE)
        llm.generate(["hello"], SamplingParams(max_tokens=4))
        engine = weakref.ref(llm.engine)
        cache = weakref.ref(llm.engine.runner.kv_cache.keys)
        weights = weakref.ref(next(llm.engine.runner.model.parameters()))
        del llm
        assert engine() is None and cache() is None and weights() is None
    finally:
        gc.enable()


def test_close_frees_a_kv_cache_a_reference_cycle_still_holds(artifact: Path) -> None:
    """A cycle that holds a view of one layer's keys (as a closure that refers to itself would), and nothing of
    the weights: `close` still collects it, so the cache goes at once."""
    gc.disable()
    try:
        llm = graphkiln.load(artifact, **ENGINE)
        llm.generate(["hello"], SamplingParams(max_tokens=2))
        cycle: dict = {"view": llm.engine.runner.kv_cache.layer(0)[0]}
        cycle["self"] = cycle
        cache = weakref.ref(llm.engine.runner.kv_cache.keys)
        del cycle
        llm.close()
        assert cache() is None
    finally:
        gc.enable()


def test_close_takes_the_attention_backends_buffers_from_whoever_still_holds_them(artifact: Path) -> None:
    """Attention backends that outlive the engine (held here, as a reference cycle through a plan may hold them)
    keep no buffer of their own after `close`: on CUDA the Triton backend's split counters may lie in the tail of
    the allocator segment the KV cache's keys took and keep all of it reserved. Both halves of a LongPrefillBackend
    give theirs back."""
    pytest.importorskip("triton")
    from graphkiln.runtime.attention.long_prefill import LongPrefillBackend
    from graphkiln.runtime.attention.triton_backend import TritonBackend

    llm = graphkiln.load(artifact, **ENGINE)
    llm.engine.wait_ready()  # nothing in the background runs the backends swapped in below
    runner = llm.engine.runner
    halves = TritonBackend(runner.kv_cache), TritonBackend(runner.kv_cache)
    runner.backend = LongPrefillBackend(*halves, min_work=2048)
    counters = [weakref.ref(half._split_counters) for half in halves]
    llm.close()
    assert [ref() for ref in counters] == [None, None]
    assert [half._split_counters.numel() for half in halves] == [0, 0]


def test_steps_leave_no_reference_cycles(artifact: Path) -> None:
    """Prefill and decode steps free what they make by reference counting alone: a cycle made while a load keeps
    collection off (its warm-up steps) would be frozen with whatever device memory it holds (gc_pauses.py)."""
    llm = graphkiln.load(artifact, **ENGINE)
    llm.engine.wait_ready()
    prompts = ["hello", "a longer prompt than the first"]
    llm.generate(prompts, SamplingParams(max_tokens=2))
    gc.collect()
    gc.disable()
    try:
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert gc.collect() == 0
    finally:
        gc.enable()
        llm.close()


def test_close_and_with_free_the_engine_at_once(artifact: Path) -> None:
    with graphkiln.load(artifact, **ENGINE) as llm:
        stream = llm.generate_stream("hello", SamplingParams(max_tokens=8, ignore_eos=True))
        next(stream)  # a request still running when the block ends
        cache = weakref.ref(llm.engine.runner.kv_cache.keys)
    assert cache() is None
    with pytest.raises(RequestError, match="closed"):
        llm.generate(["again"])
    llm.close()  # a second close does nothing
