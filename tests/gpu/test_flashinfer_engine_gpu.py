"""The FlashInfer backend in a whole engine (its prefill on FlashInfer's fa3 kernels on Hopper), and the
Triton engine that hands its long prefill steps to FlashInfer ("triton+flashinfer", Hopper only), against
transformers on the same checkpoint: a long prompt scored in chunks over its cached prefix, and greedy
generation from prompts that take several prefill chunks."""

from __future__ import annotations

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, SamplingParams
from graphkiln.runtime.attention import long_prefill
from graphkiln.runtime.attention.flashinfer_backend import flashinfer_importable
from greedy_helpers import assert_greedy_agrees
from tiny_engines import save_random_llama

pytestmark = pytest.mark.skipif(not flashinfer_importable(), reason="flashinfer is not installed")
VOCAB = 32000


class Transformers:
    """transformers' model as the reference: logits of a prompt, and greedy continuations."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def score(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids], device="cuda")).logits[0].float()

    def greedy(self, ids: list[int], steps: int) -> list[int]:
        out = []
        for _ in range(steps):
            out.append(int(self.score(ids + out)[-1].argmax()))
        return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A two-layer Llama of 64-wide heads (4 query heads a KV head) in bf16, saved, and transformers' copy of it."""
    path = tmp_path_factory.mktemp("llama2layer64")
    model = save_random_llama(path, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                              num_attention_heads=16, num_key_value_heads=4, vocab_size=VOCAB,
                              max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
    return path, Transformers(model)


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "art"
    graphkiln.compile_model(checkpoint[0], path, CompileConfig(device="cuda", dtype="bfloat16"))
    return path


@pytest.mark.parametrize("backend", ["flashinfer", "triton+flashinfer"])
def test_engine_matches_transformers_on_chunked_long_prompts(checkpoint, artifact, backend, monkeypatch):
    """For "triton+flashinfer" the long prefill threshold is lowered to 512 x 1024 pairs, so that of the long
    prompt's three chunks of 512 the first replays Triton's prefill graph and the other two run on FlashInfer."""
    if backend == "triton+flashinfer":
        if torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("triton+flashinfer runs on Hopper only")
        monkeypatch.setattr(long_prefill, "LONG_PREFILL_WORK", 512 * 1024)
    _, reference = checkpoint
    gen = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(3, VOCAB, (1500,), generator=gen).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (700, 1200, 90)]
    with graphkiln.load(artifact, attention_backend=backend, max_num_batched_tokens=512, kv_cache_tokens=8192,
                        capture="blocking", decode_batch_sizes=(1, 4), prefill_token_buckets=(512,)) as llm:
        assert llm.stats().attention_backend == backend
        got = llm.score(long_prompt)  # three chunks of 512 over the cached prefix
        if backend == "triton+flashinfer":
            assert llm.stats().steps_without_graph == {"long_prefill": 2}
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    want = reference.score(long_prompt)
    assert ((got - want).norm() / want.norm()).item() <= 2e-2
    greedy = [reference.greedy(p, 8) for p in prompts]
    assert_greedy_agrees(reference, prompts, greedy, [o.token_ids for o in outputs])
