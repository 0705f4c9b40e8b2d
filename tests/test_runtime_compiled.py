"""The compiled engine on the CPU: the same runner, padding and bucketing the GPU uses, minus the capture."""

from __future__ import annotations

import pytest
import torch

from graphkiln import CompileConfig, LLM, SamplingParams
from graphkiln.errors import CapacityError
from greedy_helpers import assert_greedy_agrees

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
CONFIG = CompileConfig()
SIZES = dict(decode_batch_sizes=(1, 2, 4), prefill_token_buckets=(16, 32))


@pytest.fixture(scope="module")
def compiled_and_eager(llama):
    compiled = LLM.compile(llama.path, CONFIG, max_num_batched_tokens=32, kv_cache_tokens=2048, **SIZES)
    eager = LLM.eager(llama.path, max_num_batched_tokens=32, kv_cache_tokens=2048)
    return compiled, eager


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_requests_joining_at_different_steps_match_eager(compiled_and_eager):
    """Requests added while others decode; every step mixes what the scheduler gives it."""
    outputs = []
    for llm in compiled_and_eager:
        engine = llm.engine
        seqs = [engine.add_request(ids(5, 1), GREEDY)]
        for step in range(40):
            if step in (2, 5, 9):
                seqs.append(engine.add_request(ids(3 + 4 * step, step), GREEDY))
            engine.step()
        while engine.has_work():
            engine.step()
        outputs.append([s.output_ids for s in seqs])
    assert outputs[0] == outputs[1]
    assert all(len(o) == GREEDY.max_tokens for o in outputs[0])


def test_prompt_longer_than_largest_prefill_bucket_is_chunked(compiled_and_eager):
    compiled, eager = compiled_and_eager
    prompt = ids(90, 7)  # budget 32 tokens a step, largest bucket 32: three chunks
    assert compiled.generate([prompt], GREEDY)[0].token_ids == eager.generate([prompt], GREEDY)[0].token_ids


def test_batch_larger_than_largest_decode_bucket(compiled_and_eager):
    compiled, eager = compiled_and_eager
    prompts = [ids(2 + i, 20 + i) for i in range(7)]  # 7 sequences decode together, largest bucket 4
    want = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert [o.token_ids for o in compiled.generate(prompts, GREEDY)] == want


def test_kv_exhaustion_waits_and_every_request_finishes_correctly(llama):
    small = dict(max_num_batched_tokens=32, kv_cache_tokens=96, block_size=16)
    compiled = LLM.compile(llama.path, CONFIG, **small, **SIZES)
    eager = LLM.eager(llama.path, **small)
    prompts = [ids(20, 30 + i) for i in range(4)]  # each needs 2 blocks of the 6, all together 8
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [[o.token_ids] for o in (eager.generate([p], params)[0] for p in prompts)]
    got = compiled.generate(prompts, params)
    assert [[o.token_ids] for o in got] == want
    assert compiled.engine.allocator.num_free == compiled.engine.allocator.capacity
    with pytest.raises(CapacityError):
        compiled.generate([ids(20, 1)], SamplingParams(max_tokens=200, ignore_eos=True))


def test_sampling_on_the_compiled_engine(compiled_and_eager):
    compiled, _ = compiled_and_eager
    prompt = ids(9, 3)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    first, second = (compiled.generate([prompt], seeded)[0].token_ids for _ in range(2))
    assert first == second
    top1 = SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    assert compiled.generate([prompt], top1)[0].token_ids == compiled.generate([prompt], GREEDY)[0].token_ids


def test_streaming_yields_what_generate_returns(compiled_and_eager):
    compiled, _ = compiled_and_eager
    prompt = ids(6, 4)
    streamed = [d.token_id for d in compiled.generate_stream(prompt, GREEDY)]
    assert streamed == compiled.generate([prompt], GREEDY)[0].token_ids


@pytest.fixture(scope="module")
def tiny_bf16():
    """The tiny model in bfloat16, compiled and eager: Inductor's fused kernels round differently."""
    compiled = LLM.compile("tiny", CompileConfig(dtype="bfloat16"), decode_batch_sizes=(1, 2, 4, 8), kv_cache_tokens=4096)
    eager = LLM.eager("tiny", dtype="bfloat16", kv_cache_tokens=4096)
    return compiled, eager


def uneven_prompts(count: int) -> list[list[int]]:
    return [ids(1 + 7 * i, 10 + i) for i in range(count)]


def test_bfloat16_compiled_greedy_agrees_with_eager(tiny_bf16):
    compiled, eager = tiny_bf16
    prompts = uneven_prompts(8)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in compiled.generate(prompts, params)]
    assert assert_greedy_agrees(eager, prompts, want, got) >= len(prompts) // 2
    ref = eager.score(prompts[-1])
    assert ((compiled.score(prompts[-1]) - ref).norm() / ref.norm()).item() <= 2e-2


def test_greedy_agreement_rejects_a_token_that_is_not_a_near_tie(tiny_bf16):
    _, eager = tiny_bf16
    prompt = uneven_prompts(3)[-1]
    want = eager.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    worst = int(eager.score(prompt + want[:1])[-1].argmin())
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_agrees(eager, [prompt], [want], [want[:1] + [worst] + want[2:]])
