"""Engines compiled with the quantized products' fusions on (CUDA's defaults) against the same compile with them off,
each loaded with every graph captured before its first step (a background load serves with the model itself until
the compiled pieces are in, so that two of them compared at once would be two eager models): the same logits bit for
bit over a 128-token prompt, and the same tokens and log-probabilities decoding prompts one at a time (one row: the
fp8 GEMV, int4's words path) and six together, replayed in CUDA graphs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import graphkiln
from graphkiln import CompileConfig, SamplingParams
from graphkiln.models.tiny import tiny_model_dir
from graphkiln.models.tokenizer import tokenizer_files

# Each scheme's fusions: the passes that compile them in, and what their engines must take to run them.
FUSIONS = {"fp8": ("fp8_norm_quant",), "int4": ("int4_norm_words", "silu_mul_linear")}


def _model(scheme: str, tmp_path: Path) -> Path:
    """fp8: the tiny model. int4: the bench's Llama-3.2-1B-like model cut to 2 layers (random weights), with the tiny
    model's vocabulary and tokenizer, whose one-row products take the dp4a GEMV's words (the tiny model's 256-wide
    rows are too narrow)."""
    if scheme == "fp8":
        return tiny_model_dir()
    from bench.models import build_hf_model, shape_of

    build_hf_model(dict(shape_of("1b", 4096, 2), vocab_size=4096), "cuda", torch.bfloat16).save_pretrained(
        tmp_path / "model")
    for path in tokenizer_files(tiny_model_dir()):
        shutil.copy(path, tmp_path / "model" / path.name)
    return tmp_path / "model"


@pytest.mark.parametrize("scheme", FUSIONS)
def test_fused_engine_scores_and_decodes_as_without_its_fusions(scheme: str, tmp_path: Path) -> None:
    source = _model(scheme, tmp_path)
    llms = {}
    for name, disabled in (("fused", ()), ("apart", FUSIONS[scheme])):
        config = CompileConfig(device="cuda", dtype="bfloat16", quantization=scheme, disabled_passes=disabled)
        _, report = graphkiln.compile_model(source, tmp_path / name, config)
        matches = {r.name: r.matches for r in report.passes}
        assert all((matches[p] > 0) == (name == "fused") for p in FUSIONS[scheme]), matches
        llms[name] = graphkiln.load(tmp_path / name, kv_cache_tokens=8192, capture="blocking")
    ids = list(range(100, 228))
    fused, apart = (llms[name].score(ids) for name in ("fused", "apart"))
    assert torch.equal(fused, apart), (fused - apart).abs().max().item()
    prompts = [[5 + i] * (1 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=4)
    for batch in [[p] for p in prompts[:2]] + [prompts]:
        outs = {name: llm.generate(batch, params) for name, llm in llms.items()}
        assert [(o.token_ids, o.logprobs) for o in outs["fused"]] == [(o.token_ids, o.logprobs) for o in outs["apart"]]
    for name, llm in llms.items():
        assert sum(llm.stats().graphs["decode"].replays.values()) > 0, name
        llm.close()
