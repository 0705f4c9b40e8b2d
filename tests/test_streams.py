"""Every request's output reaches its caller: open streams, generate and score interleaved on one LLM,
each stream's tokens as when run alone, and a stream closed early frees what it held."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import graphkiln
from graphkiln import LLM, SamplingParams, StreamDelta
from graphkiln.runtime.readback import LaunchedStep

STREAMS = [
    ("the kiln compiles a graph", SamplingParams(max_tokens=12, ignore_eos=True)),
    ("tokens flow", SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=3)),
    ("every layer", SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.0, top_k=30, top_p=0.9, seed=4)),
]
GENERATE = (
    ["a graph", "the runtime"],
    [SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.8, seed=5)],
)
SCORE = "score this prompt while streams are open"


@pytest.fixture(scope="module", params=["eager", "compiled"])
def llm(request: pytest.FixtureRequest, artifact: Path) -> LLM:
    if request.param == "eager":
        return LLM.eager("tiny", kv_cache_tokens=1024)
    return graphkiln.load(artifact, kv_cache_tokens=1024, capture="blocking")


def take(stream: Iterator[StreamDelta], n: int) -> list[StreamDelta]:
    return [next(stream) for _ in range(n)]


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_work() and not engine.requests
    assert engine.allocator.num_free == engine.allocator.capacity


def assert_stream_like_alone(deltas: list[StreamDelta], alone: graphkiln.RequestOutput) -> None:
    assert [d.token_id for d in deltas] == alone.token_ids
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [alone.finish_reason]
    assert "".join(d.text for d in deltas) == alone.text


def test_streams_generate_and_score_interleaved_lose_nothing(llm: LLM) -> None:
    """It used to lose a stream's tokens to whichever call drove the steps that made them: a score
    between two deltas dropped one, a generate ended the stream early without a finish_reason."""
    alone = [llm.generate(prompt, params)[0] for prompt, params in STREAMS]
    generated_alone = llm.generate(*GENERATE)
    scored_alone = llm.score(llm.encode(SCORE))

    streams = [llm.generate_stream(prompt, params) for prompt, params in STREAMS]
    deltas = [take(stream, 2) for stream in streams]  # each added at its first delta, the others advancing meanwhile
    generated = llm.generate(*GENERATE)
    for got, stream in zip(deltas, streams):
        got += take(stream, 3)
    scored = llm.score(llm.encode(SCORE))
    for got, stream in zip(deltas, streams):
        got += stream

    for got, want in zip(deltas, alone):
        assert_stream_like_alone(got, want)
    assert [(o.token_ids, o.finish_reason) for o in generated] == [
        (o.token_ids, o.finish_reason) for o in generated_alone
    ]
    assert torch.equal(scored, scored_alone)
    assert_idle(llm)


def test_stream_closed_early_frees_its_blocks_while_others_run(llm: LLM) -> None:
    engine = llm.engine
    alone = llm.generate(*STREAMS[1])[0]
    closed = llm.generate_stream(*STREAMS[0])
    other = llm.generate_stream(*STREAMS[1])
    got = take(other, 1)
    take(closed, 2)  # its next step is in flight: the row is dropped when read back
    closed.close()
    assert len(engine.requests) == 1
    held = sum(len(seq.blocks) for seq in engine.requests.values())
    assert engine.allocator.num_free == engine.allocator.capacity - held
    got += other
    assert_stream_like_alone(got, alone)
    assert_idle(llm)
    for delta in llm.generate_stream(*STREAMS[2]):  # leaving a for loop drops the stream
        break
    assert_idle(llm)


def test_an_interrupted_generate_loses_no_token_of_an_open_stream(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while generate waits for a step's ids (where a CUDA host spends its time): generate's
    requests are aborted, the open stream's token in that step reaches it at the next read-back."""
    alone = llm.generate(*STREAMS[1])[0]
    stream = llm.generate_stream(*STREAMS[1])
    got = take(stream, 2)
    results, calls = LaunchedStep.results, iter(range(3))

    def interrupted(step: LaunchedStep):
        if next(calls, None) == 2:
            raise KeyboardInterrupt
        return results(step)

    monkeypatch.setattr(LaunchedStep, "results", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(*GENERATE)
    got += stream
    assert_stream_like_alone(got, alone)
    assert_idle(llm)
