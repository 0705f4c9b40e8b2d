"""Quantized models on two tensor-parallel ranks (gloo, float32, CPU). A pre-quantized checkpoint: each rank reads
its slice of every format's tensors (models/quantized_shards.py) and the two ranks score as one does, or, where
the activations are quantized per token, as the float32 model that quantizes each rank's share of o's and down's
input on its own. Quantized by compile-model: each rank loads its own file of its quantized share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist

import graphkiln
from artifact_helpers import COMPILED, ENGINE, SMALL_ENGINE
from graphkiln import CompileConfig
from graphkiln.compiler.artifacts import QUANTIZED_FILE, quantized_file
from graphkiln.errors import UnsupportedModelError
from graphkiln.models.loader import load_model
from graphkiln.models.sharding import Shard
from int4_checkpoint_helpers import write_int4_checkpoint
from int8_checkpoint_helpers import write_int8_checkpoint
from quant_helpers import fp8_inputs, relative_error, top1_agreement, write_fp8_checkpoint

if TYPE_CHECKING:
    from conftest import Checkpoint, CheckpointFactory

GROUP = 32
# Qwen3 with every rank's share of q, k, v, gate, up and of o's and down's inputs whole 128 x 128 blocks
QWEN3_WHOLE_BLOCKS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=128)
QWEN3_SPLIT_BLOCKS = dict(hidden_size=192, intermediate_size=384, num_attention_heads=2, num_key_value_heads=2,
                          head_dim=64)
CASES = ["int4-compressed-tensors", "int4-gptq", "int4-awq", "int4-gptq-channel", "fp8-autofp8-static", "fp8-block",
         "fp8-compressed-tensors-block", "int8-static", "int8-packed", "int8-gptq"]
BLOCK_FP8 = ("fp8-block", "fp8-compressed-tensors-block")
WHOLE_BLOCKS = (*BLOCK_FP8, "int8-gptq")  # on QWEN3_WHOLE_BLOCKS: each rank's share holds whole 128-wide tiles
# Block fp8 quantizes activations per 1 x 128 group as they come: the ranks' sum, in another order, moves the next
# layer's input by an ulp of float32, which flips the fp8 rounding of the odd element near a boundary (one fp8
# step is 1/16 of its value), so its logits agree to this share of their largest magnitude, not to float32's.
FLIPPED_ROUNDINGS = 1e-2


def _write(case: str, ckpt: Checkpoint, out: Path, ids: list[int]) -> None:
    if case.startswith("int4-"):
        fmt = case.removeprefix("int4-").removesuffix("-channel")
        group = -1 if case.endswith("-channel") else GROUP
        write_int4_checkpoint(ckpt.path, ckpt.model, out, fmt, group, symmetric=fmt == "gptq")
    elif case in BLOCK_FP8:
        layout = "block" if case == "fp8-block" else "compressed-tensors"
        write_fp8_checkpoint(ckpt.path, ckpt.model, out, layout, weights="block")
    elif case == "int8-gptq":
        write_int8_checkpoint(ckpt.path, ckpt.model, out, "gptq", "group")
    elif case.startswith("int8-"):
        write_int8_checkpoint(ckpt.path, ckpt.model, out, "static" if case == "int8-static" else "none",
                              calibration=ids)
    else:
        write_fp8_checkpoint(ckpt.path, ckpt.model, out, "autofp8", activations="static", calibration=ids)


def _two_ranks(path: Path, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    with graphkiln.LLM.eager(path, tensor_parallel_size=2, **ENGINE) as llm:
        out = llm.score(ids), llm.generate([ids], graphkiln.SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert not dist.is_initialized()
    return out


@pytest.mark.parametrize("case", CASES)
def test_quantized_checkpoint_on_two_ranks_scores_as_one(
    case: str, llama: Checkpoint, hf_checkpoint: CheckpointFactory, random_ids: Callable[..., list[int]],
    tmp_path: Path,
) -> None:
    """Weights split exactly and activations quantized alike (none, a static scale, or 1 x 128 groups, which a
    rank's share holds whole): the ranks' sum is the single rank's product up to the order of the sum (and, for
    block fp8, the roundings that order flips: FLIPPED_ROUNDINGS)."""
    ckpt = hf_checkpoint("qwen3", **QWEN3_WHOLE_BLOCKS) if case in WHOLE_BLOCKS else llama
    ids = random_ids(40)
    _write(case, ckpt, tmp_path / case, ids)
    with graphkiln.LLM.eager(tmp_path / case, **ENGINE) as llm:
        want = llm.score(ids), llm.generate([ids], graphkiln.SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    logits, tokens = _two_ranks(tmp_path / case, ids)
    if case in BLOCK_FP8:
        assert relative_error(logits, want[0]) < FLIPPED_ROUNDINGS and top1_agreement(logits, want[0]) >= 0.95
    else:
        torch.testing.assert_close(logits, want[0], atol=1e-4, rtol=0)
        assert tokens == want[1]
    rank1 = load_model(tmp_path / case, shard=Shard(1, 2)).model.layers[0]
    assert rank1.self_attn.qkv_proj.parts == tuple(p // 2 for p in rank1.self_attn.qkv_proj.checkpoint_parts)
    assert rank1.mlp.down_proj.in_features == rank1.mlp.down_proj.checkpoint_in_features // 2


def test_dynamic_fp8_on_two_ranks_quantizes_each_ranks_share(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """Per-token activation scales of o's and down's input are each rank's own (over its half of the input), as
    in every tensor-parallel engine: checked against the float32 model that quantizes those inputs half by half."""
    ids = random_ids(40)
    reference = write_fp8_checkpoint(llama.path, llama.model, tmp_path / "fp8", "compressed-tensors")
    for name, module in reference.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            module._forward_pre_hooks.clear()
            module.register_forward_pre_hook(
                lambda m, args: (torch.cat([fp8_inputs(half, "channel", None) for half in args[0].chunk(2, -1)], -1),))
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    logits, _ = _two_ranks(tmp_path / "fp8", ids)
    assert relative_error(logits, ref) < 1e-4
    one = graphkiln.LLM.eager(tmp_path / "fp8", **ENGINE).score(ids)
    assert relative_error(one, ref) > 1e-2  # the bound above tells the ranks' rounding from one rank's


def test_what_ranks_cannot_split_is_refused_before_they_start(
    llama: Checkpoint, hf_checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    ckpt = hf_checkpoint("qwen3", **QWEN3_SPLIT_BLOCKS)  # q, k and v: 64 rows a rank, half a block
    write_fp8_checkpoint(ckpt.path, ckpt.model, tmp_path / "block", "block")
    with pytest.raises(UnsupportedModelError, match=r"fused projections of sizes \(64, 64, 64\): each must be a "
                                                    "multiple of 128"):
        load_model(tmp_path / "block", shard=Shard(1, 2))
    narrow = hf_checkpoint("llama", num_attention_heads=8, head_dim=4)  # k, v: 4 rows a rank, half a packed word
    write_int4_checkpoint(narrow.path, narrow.model, tmp_path / "awq", "awq", 16, False)
    with pytest.raises(UnsupportedModelError, match=r"k_proj.qweight': a tensor-parallel rank's output rows 4..8 do "
                                                    "not fall on whole units of 8"):
        load_model(tmp_path / "awq", shard=Shard(1, 2))
    write_int4_checkpoint(llama.path, llama.model, tmp_path / "act-order", "gptq", GROUP, True, act_order=True)
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=2 with an int4, symmetric groups of 32 in "
                                                    "act-order.*no rank's share of their inputs holds whole groups"):
        graphkiln.LLM.eager(tmp_path / "act-order", tensor_parallel_size=2, **ENGINE)
    with pytest.raises(UnsupportedModelError, match="act-order"):
        graphkiln.compile_model(tmp_path / "act-order", tmp_path / "art", CompileConfig(tensor_parallel_size=2))
    assert not (tmp_path / "art").exists() and not dist.is_initialized()


@pytest.mark.slow
def test_compiled_gptq_checkpoint_on_two_ranks(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """compile-model traces rank 0's graph over its slices; every rank of the loaded artifact reads its own."""
    ids = random_ids(40)
    write_int4_checkpoint(llama.path, llama.model, tmp_path / "gptq", "gptq", GROUP, True)
    one = graphkiln.LLM.eager(tmp_path / "gptq", **ENGINE).score(ids)
    manifest, _ = graphkiln.compile_model(tmp_path / "gptq", tmp_path / "art", CompileConfig(tensor_parallel_size=2),
                                          engine=SMALL_ENGINE)
    assert manifest["model"]["quantization"]["layers"]["model.layers.0.mlp.down_proj"].startswith("int4")
    with graphkiln.load(tmp_path / "art", **ENGINE) as llm:
        torch.testing.assert_close(llm.score(ids), one, atol=1e-4, rtol=0)
    assert not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int4", "fp8"])
def test_compile_time_quantization_on_two_ranks(
    scheme: str, hf_checkpoint: CheckpointFactory, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    """compile-model quantizes every rank's share and writes a file a rank, which that rank alone reads. int4 takes
    the groups one rank would (chosen from the checkpoint's sizes), so two ranks score as the one-rank artifact;
    fp8's channel scales of o and down are each rank's own (over its share of the inputs), as are its per-token
    activation scales there, so two ranks round otherwise than one, and land as near the unquantized model."""
    ckpt = hf_checkpoint("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    ids = random_ids(40)
    graphkiln.compile_model(ckpt.path, tmp_path / "one", CompileConfig(quantization=scheme), engine=SMALL_ENGINE)
    two = CompileConfig(quantization=scheme, tensor_parallel_size=2)
    manifest, _ = graphkiln.compile_model(ckpt.path, tmp_path / "two", two, engine=SMALL_ENGINE)
    assert {QUANTIZED_FILE, quantized_file(1)} <= set(manifest["files"])
    one = graphkiln.load(tmp_path / "one", **COMPILED).score(ids)
    with graphkiln.load(tmp_path / "two", **COMPILED) as llm:
        logits = llm.score(ids)
    if scheme == "int4":
        torch.testing.assert_close(logits, one, atol=1e-4, rtol=0)
    else:  # two roundings of one model: each as far from the unquantized model as the other (a wrong slice is not)
        ref = ckpt.reference_logits(ids)
        assert relative_error(logits, ref) < 1.5 * relative_error(one, ref)
        assert top1_agreement(logits, ref) >= top1_agreement(one, ref) - 0.15
    assert not dist.is_initialized()
