"""Broken model directories, bad settings and bad requests raise typed errors that name what is wrong."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file, save_file

from artifact_helpers import single_error_line
from graphkiln import LLM, SamplingParams, cli
from graphkiln.errors import (
    ConfigError,
    ModelFileError,
    RequestError,
    UnsupportedModelError,
    WeightMismatchError,
)
from graphkiln.models import load_model

if TYPE_CHECKING:
    from conftest import Checkpoint, CheckpointFactory


@pytest.fixture
def model_dir(llama: Checkpoint, tmp_path: Path) -> Path:
    """A private, editable copy of the default llama checkpoint."""
    return Path(shutil.copytree(llama.path, tmp_path / "model"))


def edit_config(model_dir: Path, **fields) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def edit_weights(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_config(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelFileError, match=re.escape(str(model_dir / "config.json"))):
        LLM.eager(model_dir)


def test_config_not_json(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelFileError, match=r"config\.json.*JSON"):
        LLM.eager(model_dir)


@pytest.mark.parametrize(
    "fields, error, words",
    [({"num_attention_heads": 0}, UnsupportedModelError, "ZeroDivisionError"),
     ({"rms_norm_eps": "abc"}, UnsupportedModelError, "rms_norm_eps"),
     ({"vocab_size": -5}, ModelFileError, "field 'vocab_size' is -5; it must be a positive integer"),
     ({"num_hidden_layers": 0}, ModelFileError, "field 'num_hidden_layers' is 0"),
     ({"rope_parameters": {"rope_type": "default", "rope_theta": "x"}}, ModelFileError, "rope_theta is 'x'")],
    ids=["heads-0", "eps-string", "vocab-negative", "layers-0", "rope-theta-string"],
)
def test_config_field_of_the_wrong_type_or_value(model_dir: Path, fields: dict, error: type, words: str) -> None:
    edit_config(model_dir, **fields)
    with pytest.raises(error, match=re.escape(str(model_dir / "config.json")) + ".*" + re.escape(words)):
        LLM.eager(model_dir)


@pytest.mark.parametrize("text", ["", "[]"], ids=["empty", "list"])
def test_inspect_of_an_unreadable_config_is_one_error_line(
    model_dir: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (model_dir / "config.json").write_text(text)
    assert cli.main(["inspect", str(model_dir)]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {model_dir / 'config.json'}: "), line


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=re.escape(str(tmp_path / "nowhere"))):
        LLM.eager(tmp_path / "nowhere")


def test_missing_safetensors(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelFileError, match=r"model\.safetensors"):
        LLM.eager(model_dir)


def test_truncated_safetensors(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ModelFileError, match=re.escape(str(weights))):
        LLM.eager(model_dir)


def test_sharded_index_lists_missing_shard(hf_checkpoint: CheckpointFactory, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(hf_checkpoint("llama", max_shard_size="100KB").path, tmp_path / "model"))
    shard = sorted(model_dir.glob("model-*-of-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelFileError, match=re.escape(shard.name)):
        LLM.eager(model_dir)


@pytest.mark.parametrize("weight_map", [[], "model.safetensors", {"lm_head.weight": 5}], ids=["list", "string", "int"])
def test_sharded_index_whose_weight_map_is_not_names_to_files(
    hf_checkpoint: CheckpointFactory, tmp_path: Path, weight_map: object
) -> None:
    model_dir = Path(shutil.copytree(hf_checkpoint("llama", max_shard_size="100KB").path, tmp_path / "model"))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFileError, match=r"index\.json: 'weight_map' must map each tensor name to a file name"):
        LLM.eager(model_dir)


def test_integer_tensor_for_a_float_parameter(model_dir: Path) -> None:
    """The same bytes relabelled as integers of their width: read as values, they would be weights wrong by
    orders of magnitude, silently."""
    name = "model.layers.0.input_layernorm.weight"
    integer = {2: torch.int16, 4: torch.int32}[load_file(model_dir / "model.safetensors")[name].element_size()]
    edit_weights(model_dir, lambda t: t.update({name: t[name].view(integer)}))
    with pytest.raises(WeightMismatchError, match=re.escape(f"tensor {name!r} is stored as {integer}")):
        LLM.eager(model_dir)


def test_weight_shape_disagrees_with_config(model_dir: Path) -> None:
    edit_config(model_dir, intermediate_size=192)
    with pytest.raises(WeightMismatchError, match=r"'model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight' has shape"):
        LLM.eager(model_dir)


def test_missing_weight(model_dir: Path) -> None:
    edit_weights(model_dir, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.1\.post_attention_layernorm\.weight"):
        LLM.eager(model_dir)


def test_missing_fused_slice(model_dir: Path) -> None:
    """q, k and v fill one fused parameter: losing only k must still be reported."""
    edit_weights(model_dir, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.0\.self_attn\.(k|qkv)_proj\.weight"):
        LLM.eager(model_dir)


def test_unexpected_weight(model_dir: Path) -> None:
    edit_weights(model_dir, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight"):
        LLM.eager(model_dir)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weight_is_refused_by_name(model_dir: Path, bad: float) -> None:
    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = bad

    edit_weights(model_dir, poison)
    message = re.escape(f"{model_dir / 'model.safetensors'}: tensor 'model.layers.1.mlp.up_proj.weight' holds NaN or Inf")
    with pytest.raises(ModelFileError, match=message):
        LLM.eager(model_dir)


def test_non_finite_weight_stops_compile_model(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit_weights(model_dir, lambda t: t["lm_head.weight"].__setitem__((0, 0), float("nan")))
    out = tmp_path / "out"
    assert cli.compile_model_main([str(model_dir), "-o", str(out), "--device", "cpu", "--quiet"]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {model_dir / 'model.safetensors'}: tensor 'lm_head.weight' holds NaN or Inf"), line
    assert not out.exists()


def test_weight_beyond_float16_range_is_refused_by_name(model_dir: Path) -> None:
    edit_weights(model_dir, lambda t: t["model.norm.weight"].__setitem__(0, 1e6))  # finite in float32
    load_model(model_dir, dtype="float32")  # control
    with pytest.raises(ModelFileError, match=r"tensor 'model\.norm\.weight' holds values beyond float16's range"):
        load_model(model_dir, dtype="float16")


def test_unsupported_architecture(model_dir: Path) -> None:
    edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"architectures.*GPT2LMHeadModel"):
        LLM.eager(model_dir)


def test_unknown_dtype(llama: Checkpoint) -> None:
    with pytest.raises(ConfigError, match="int8"):
        LLM.eager(llama.path, dtype="int8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(llama: Checkpoint) -> None:
    with pytest.raises(ConfigError, match="'cuda'"):
        LLM.eager(llama.path, device="cuda")


def test_single_token_id_prompt_must_be_wrapped(llama: Checkpoint) -> None:
    with pytest.raises(RequestError, match="wrap a single token-id prompt"):
        LLM.eager(llama.path).generate([1, 2, 3])


def test_kv_cache_smaller_than_a_block(llama: Checkpoint) -> None:
    with pytest.raises(ConfigError, match="kv_cache_tokens"):
        LLM.eager(llama.path, kv_cache_tokens=8, block_size=16)


@pytest.mark.parametrize("setting", ["max_num_seqs", "max_num_batched_tokens", "block_size"])
def test_engine_setting_of_zero(llama: Checkpoint, setting: str) -> None:
    with pytest.raises(ConfigError, match=setting):
        LLM.eager(llama.path, **{setting: 0})


@pytest.fixture(scope="module")
def llm(llama: Checkpoint) -> LLM:
    return LLM.eager(llama.path)


def assert_clean_after_failure(llm: LLM, free_before: int, ckpt: Checkpoint, prompts: list[list[int]]) -> None:
    """Nothing of a failed generate stays behind, and the next generate gives what a fresh engine gives."""
    scheduler = llm.engine.scheduler
    assert not scheduler.waiting and not scheduler.running and not llm.engine.requests
    assert llm.engine.allocator.num_free == free_before
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM.eager(ckpt.path).generate(prompts, params)]
    assert llm.engine.allocator.num_free == free_before


BAD_REQUESTS = {
    "longer-than-context": (lambda ids: [ids(10), ids(257)], r"257 tokens.*context of 256"),
    "empty-prompt": (lambda ids: [ids(10), []], "empty prompt"),
    "id-outside-vocab": (lambda ids: [ids(10), [5, 512]], r"\[512\].*\[0, 512\)"),
    "negative-id": (lambda ids: [ids(10), [-1, 5]], r"\[-1\]"),
}


@pytest.mark.parametrize("bad", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_request_leaves_engine_clean(
    llm: LLM, llama: Checkpoint, bad: str, prompts: list[list[int]], random_ids: Callable[..., list[int]]
) -> None:
    make_prompts, message = BAD_REQUESTS[bad]
    free_before = llm.engine.allocator.num_free
    with pytest.raises(RequestError, match=message):
        llm.generate(make_prompts(random_ids), SamplingParams(max_tokens=4))
    assert_clean_after_failure(llm, free_before, llama, prompts)


def test_params_count_mismatch(llm: LLM, llama: Checkpoint, prompts: list[list[int]]) -> None:
    free_before = llm.engine.allocator.num_free
    with pytest.raises(RequestError, match="2 SamplingParams given for 3 prompts"):
        llm.generate(prompts, [SamplingParams(), SamplingParams()])
    assert_clean_after_failure(llm, free_before, llama, prompts)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("max_tokens", 2.5),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
    ],
)
def test_invalid_sampling_params(field: str, value: float) -> None:
    with pytest.raises(RequestError, match=rf"SamplingParams\.{field}={value}"):
        SamplingParams(**{field: value})


def test_string_prompt_without_tokenizer(llm: LLM) -> None:
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate("hello")
