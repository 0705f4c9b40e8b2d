"""Compiler core: one trace, split at attention, per-piece Inductor compiles, size dispatch, plans."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from graphkiln import CompileConfig, EngineConfig, LLM, SamplingParams
from graphkiln.compiler.compile import compile_module
from graphkiln.compiler.counters import torch_compile_events
from graphkiln.compiler.inductor import INDUCTOR_PDL, InductorCompiler
from graphkiln.errors import ConfigError
from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.models.config import ModelConfig
from graphkiln.models.rope import default_inv_freq, rope_cache
from graphkiln.models.transformer import CausalLM
from graphkiln.runtime.batch import Batch
from graphkiln.runtime.graphs import smallest_bucket
from graphkiln.runtime.runner import Padding

TOY = ModelConfig(
    architecture="LlamaForCausalLM", family="llama", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_context=512,
    tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
    rope_type="default", rope_inv_freq=default_inv_freq(10000.0, 16), rope_scaling=1.0, bos_token_id=None,
    eos_token_ids=(),
)  # fmt: skip


def toy_model(num_layers: int = 2) -> CausalLM:
    cfg = replace(TOY, num_layers=num_layers)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = CausalLM(cfg)
    model.model.register_buffer("rope_cache", rope_cache(cfg, torch.device("cpu")), persistent=False)
    return model.eval().requires_grad_(False)


class CountingAttention:
    """A stand-in attention: out = q * 0.5 + mean of k over heads, counting calls per layer."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, layer, q, k, v, out, scale) -> None:
        self.calls.append(layer)
        out.copy_(q * 0.5 + k.mean(dim=1, keepdim=True))


@pytest.fixture(scope="module")
def toy_compiled():
    model = toy_model()
    config = CompileConfig(specialize_sizes=(1, 4))
    compiled, report = compile_module(model, config)
    return model, compiled, report, config


def test_piece_and_compile_counts_follow_the_documented_rule(toy_compiled):
    model, compiled, report, config = toy_compiled
    layers = model.cfg.num_layers
    # N attention calls split the graph into N + 1 pieces; the first and last differ from the
    # N - 1 identical middle pieces, so 3 unique pieces for N >= 2.
    report.counters.expect(graphs_traced=1, pieces=layers + 1, attention_pieces=layers, unique_pieces=3)
    sizes = config.specialize_sizes
    assert sizes == (1, 4)
    report.counters.expect(inductor_compiles=3 * (1 + len(sizes)), specialized_compiles=3 * len(sizes))
    assert [attn for _, attn in compiled.split.submodules] == [False, True] * layers + [False]
    assert set(report.timings) >= {"trace", "passes", "split", "inductor", "total"}


def test_every_token_count_runs_without_recompiling_and_matches_eager(toy_compiled):
    model, compiled, _, _ = toy_compiled
    before = torch_compile_events()
    attention = CountingAttention()
    with torch.compiler.set_stance("fail_on_recompile"), torch.no_grad():
        with forward_context(ForwardContext(attention)):
            for tokens in [*range(1, 40), 64, 100, 255, 300]:
                ids = torch.randint(0, TOY.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
                positions = torch.arange(tokens)
                got = compiled(ids, positions)
                want = model(ids, positions)
                assert got.shape == (tokens, TOY.hidden_size)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch_compile_events() == before
    assert attention.calls[:4] == [0, 1, 0, 1]


def test_specialized_variant_is_chosen_by_token_count(toy_compiled):
    _, compiled, _, _ = toy_compiled
    piece = next(iter(compiled.pieces.values()))
    assert set(piece.by_size) == {1, 4}
    assert piece.variant(4) is piece.by_size[4]
    assert piece.variant(2) is piece.variant(5) is piece.dynamic


def test_identical_layers_compile_once():
    config = CompileConfig()
    _, two = compile_module(toy_model(2), config)
    _, six = compile_module(toy_model(6), config)
    assert six.counters.pieces == 7 and two.counters.pieces == 3
    assert six.counters.inductor_compiles == two.counters.inductor_compiles == 3
    assert six.counters.cache_hits == 4


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_compiled_engine_matches_eager_for_every_family(hf_checkpoint, family, prompts):
    ckpt = hf_checkpoint(family)
    compiled = LLM.compile(ckpt.path, CompileConfig(), decode_batch_sizes=(1, 2, 4), prefill_token_buckets=(16, 32))
    eager = LLM.eager(ckpt.path)
    ids = prompts[2] + prompts[1]
    got, want = compiled.score(ids), eager.score(ids)
    assert (got - want).abs().max() / want.abs().max() <= 1e-4
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = compiled.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(prompts, params)]
    assert compiled.compile_report.counters.graphs_traced == 1


def test_tiny_model_compiled_matches_eager():
    compiled = LLM.compile("tiny", decode_batch_sizes=(1, 2, 4, 8), prefill_token_buckets=(16, 64))
    eager = LLM.eager("tiny")
    prompts = ["the kiln", "a model of tokens and layers", "x"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = compiled.generate(prompts, params)
    want = eager.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    ids = got[1].prompt_token_ids + got[1].token_ids
    diff = (compiled.score(ids) - eager.score(ids)).abs().max() / eager.score(ids).abs().max()
    assert diff <= 1e-4


def test_buckets_and_padding():
    assert [smallest_bucket((1, 2, 4, 8), n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    padding = Padding(decode=(1, 2, 4, 8), prefill=(16, 64))

    def batch(n: int, decode: bool) -> Batch:
        return Batch([5] * n, list(range(n)), [], decode)

    assert padding.size(batch(3, True)) == 4
    assert padding.size(batch(9, True)) == 9
    assert padding.size(batch(3, False)) == 16
    assert padding.size(batch(70, False)) == 70


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"specialize_sizes": (4, 2)}, "specialize_sizes"),
        ({"specialize_sizes": (0, 1)}, "specialize_sizes"),
        ({"device": "tpu"}, "device"),
        ({"dtype": "int8"}, "dtype"),
        ({"inductor_options": {"pass": object()}}, "inductor_options"),
        ({"inductor_options": {"triton.multi_kernel": 2}}, "triton.multi_kernel"),
    ],
)
def test_compile_config_rejects_invalid_values(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CompileConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"decode_batch_sizes": (4, 2)}, "decode_batch_sizes"),
        ({"decode_batch_sizes": (0, 1)}, "decode_batch_sizes"),
        ({"prefill_token_buckets": ()}, "prefill_token_buckets"),
        ({"prefill_token_buckets": (16, 16)}, "prefill_token_buckets"),
        ({"block_size": 12}, "block_size"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"kv_cache_tokens": 8}, "kv_cache_tokens"),
        ({"kv_cache_tokens": 4096, "max_seq_len": 8192}, "max_seq_len"),
        ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction"),
        ({"attention_backend": "magic"}, "attention_backend"),
        ({"max_num_seqs": True}, "max_num_seqs"),
    ],
)
def test_engine_config_rejects_invalid_values(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kwargs)


def test_unknown_engine_option_is_named():
    with pytest.raises(ConfigError, match="kv_cache_token.*known: .*kv_cache_tokens"):
        EngineConfig().replace(kv_cache_token=64)


def test_config_defaults():
    engine = EngineConfig()
    assert engine.decode_batch_sizes[0] == 1 and engine.decode_batch_sizes[-1] == 256
    assert engine.prefill_token_buckets == tuple(2**i for i in range(4, 13))
    assert CompileConfig().specialize_sizes == CompileConfig(device="cuda").specialize_sizes == ()
    assert EngineConfig.from_dict(json.loads(json.dumps(engine.to_dict()))) == engine
    with pytest.raises(Exception):
        CompileConfig().dtype = "bfloat16"


def test_compiler_hash_follows_the_passes_and_options():
    model = toy_model()
    base = compile_module(model, CompileConfig())[1].compiler_hash
    assert compile_module(model, CompileConfig())[1].compiler_hash == base
    disabled = CompileConfig(disabled_passes=("silu_mul_epilogue",))
    assert compile_module(model, disabled)[1].compiler_hash != base


def test_cuda_compiles_launch_inductor_kernels_with_pdl_unless_turned_off(monkeypatch):
    """A CUDA compile asks Inductor for programmatic dependent launch (it keeps it to sm90+ itself); an explicit
    option and GRAPHKILN_PDL=0 turn it off, the CPU never gets it, and the compiler hash follows the choice."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("GRAPHKILN_PDL", raising=False)
    default = InductorCompiler(cuda)
    assert default.options[INDUCTOR_PDL] is True
    assert InductorCompiler(cuda, {INDUCTOR_PDL: False}).options[INDUCTOR_PDL] is False
    assert INDUCTOR_PDL not in InductorCompiler(cpu).options
    monkeypatch.setenv("GRAPHKILN_PDL", "0")
    off = InductorCompiler(cuda)
    assert INDUCTOR_PDL not in off.options and off.hash() != default.hash()
