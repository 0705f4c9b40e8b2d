"""Two attention backends in one engine (runtime/attention/long_prefill.py), on the CPU: the SDPA backend
stands in for Triton (both capture-free here) and FlashInfer's wrappers are the torch stand-in; the
routing by attention work, the runner's counts, and the results against float64 and transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_helpers import CPU, model_config
from flashinfer_stand_in import check_rows, install, paged_batch

import graphkiln
from graphkiln import SamplingParams
from graphkiln.cli import main as cli_main
from graphkiln.errors import ConfigError
from graphkiln.runtime.attention import long_prefill
from graphkiln.runtime.attention.block_decode import check_decode_kernel
from graphkiln.runtime.attention.flashinfer_backend import FlashInferBackend
from graphkiln.runtime.attention.long_prefill import LongPrefillBackend, triton_with_flashinfer
from graphkiln.runtime.attention.metadata import attention_work
from graphkiln.runtime.attention.sdpa import SdpaBackend
from graphkiln.runtime.attention.select import select_backend
from graphkiln.runtime.config import EngineConfig
from graphkiln.runtime.kv_cache import KVCache


@pytest.fixture
def stand_in_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch)


def test_attention_work_counts_query_by_context_tokens() -> None:
    assert attention_work((5, 1, 16, 3), (21, 17, 48, 3)) == 5 * 21 + 17 + 16 * 48 + 9
    assert attention_work((), ()) == 0
    assert long_prefill.LONG_PREFILL_WORK == attention_work((4096,), (4096,))


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_steps_marked_long_prefill_go_to_the_long_backend_and_match_float64() -> None:
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    cache = KVCache(model_config(num_heads, num_kv_heads, head_dim), 80, 16, torch.bfloat16, CPU)
    long = FlashInferBackend(cache, workspace_bytes=16)
    backend = LongPrefillBackend(SdpaBackend(cache), long, min_work=899)
    assert backend.name == "sdpa+flashinfer" and backend.eager_prefill_work == 899
    assert (backend.capturable_decode, backend.capturable_prefill, backend.concurrent_plans) == (False, False, True)
    scale = head_dim**-0.5
    gen = torch.Generator().manual_seed(0)

    def run(lens, decode: bool, seed: int, long_prefill: bool = False) -> None:
        cache.keys.zero_()
        cache.values.zero_()
        meta, k, v, full_k, full_v = paged_batch(cache, lens, decode=decode, pad=2, seed=seed)
        meta = dataclasses.replace(meta, long_prefill=long_prefill)
        q = torch.randn(k.shape[0], num_heads, head_dim, generator=gen).to(torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        backend.plan(meta)(1, q, k, v, out, scale)
        check_rows(out, q, lens, full_k, full_v, scale)

    prefill_lens = [(5, 21), (1, 17), (16, 48), (3, 3)]
    run(prefill_lens, decode=False, seed=1, long_prefill=True)  # FlashInfer's wrapper plans it
    assert long._prefill_wrappers["fa2"].plans == 1
    run(prefill_lens, decode=False, seed=2)  # unmarked (a warm-up's, say): SDPA's
    run([(1, 40), (1, 900)], decode=True, seed=3)  # decode: SDPA's
    assert long._prefill_wrappers["fa2"].plans == 1 and not long._decode


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_building_the_prefill_kernels_at_load_leaves_the_first_step_to_learn_the_heads() -> None:
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    cache = KVCache(model_config(num_heads, num_kv_heads, head_dim), 40, 16, torch.bfloat16, CPU)
    backend = FlashInferBackend(cache, workspace_bytes=16)
    backend.build_prefill_kernels()
    wrapper = backend._prefill_wrappers["fa2"]
    assert wrapper.plans == 1 and wrapper.layout()[2].tolist() == [0]  # one query token over the dummy block
    assert backend._heads_and_scale is None  # the build ran one query head a KV head, not the model's eight
    lens = [(7, 30), (12, 12)]
    meta, k, v, full_k, full_v = paged_batch(cache, lens, decode=False, pad=1, seed=5)
    q = torch.randn(k.shape[0], num_heads, head_dim, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    backend.plan(meta)(1, q, k, v, out, head_dim**-0.5)
    check_rows(out, q, lens, full_k, full_v, head_dim**-0.5)
    assert backend._heads_and_scale == (num_heads, head_dim**-0.5) and wrapper.plans == 2


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_an_engine_runs_its_long_prefill_chunks_on_the_long_backend(hf_checkpoint) -> None:
    """Chunks of 32 tokens of a 100-token prompt: the second and third reach 2048 pairs, run outside the runner's
    graphs, on FlashInfer's (stand-in) wrappers; logits and greedy tokens as transformers gives them."""
    ckpt = hf_checkpoint("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    prompt = torch.randint(0, ckpt.vocab_size, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    with graphkiln.LLM.eager(ckpt.path, "cpu", "bfloat16", max_num_batched_tokens=32, kv_cache_tokens=512) as llm:
        runner = llm.engine.runner
        long = FlashInferBackend(runner.kv_cache, workspace_bytes=16)
        runner.backend = LongPrefillBackend(runner.backend, long, min_work=2048)
        logits = llm.score(prompt)
        assert llm.stats().steps_without_graph == {"prefill": 2, "long_prefill": 2}
        tokens = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
        assert llm.stats().steps_without_graph == {"prefill": 4, "long_prefill": 4, "decode": 3}
        assert long._prefill_wrappers["fa2"].plans == 4 and not long._decode
    want = ckpt.reference_logits(prompt)
    assert ((logits - want).norm() / want.norm()).item() < 2e-2
    assert tokens == ckpt.reference_greedy(prompt, 4)


def test_triton_with_flashinfer_is_named_on_hopper_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig(attention_backend="triton+flashinfer").attention_backend == "triton+flashinfer"
    check_decode_kernel("blocks", "triton+flashinfer")  # its decode is Triton's
    cache = KVCache(model_config(4, 2, 64), 4, 16, torch.bfloat16, CPU)
    with pytest.raises(ConfigError, match="'triton\\+flashinfer' needs a CUDA device"):
        select_backend("triton+flashinfer", cache)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 9\.x\); this GPU has 8\.0.*use 'triton'"):
        triton_with_flashinfer(cache, "auto")


def test_the_cli_takes_every_attention_backend(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    assert "triton+flashinfer" in capsys.readouterr().out
