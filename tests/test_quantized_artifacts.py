"""Compile-time fp8/int8/int4 artifacts of the trained tiny model, and a pre-quantized checkpoint compiled: the ops in
the compiled graph, logits and perplexity against bf16, the quantized weights stored once and checked, inspect."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors import safe_open

import graphkiln
from artifact_helpers import COMPILED, ENGINE, RESULT_PREFIX, SMALL_ENGINE, run_python_json
from bench import quality
from graphkiln import CompileConfig, cli
from graphkiln.compiler.artifacts import QUANTIZED_FILE
from graphkiln.compiler.compile import CompileReport
from graphkiln.compiler.counters import torch_compile_events
from graphkiln.errors import ArtifactError, UnsupportedModelError
from graphkiln.models.quantized_layers import projections_quantized
from graphkiln.models.tiny import tiny_model_dir
from quant_helpers import FP8, relative_error, top1_agreement, with_quantization_config, write_fp8_checkpoint

if TYPE_CHECKING:
    from conftest import Checkpoint


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tiny model directory, whose weights a test may overwrite."""
    return Path(shutil.copytree(tiny_model_dir(), tmp_path_factory.mktemp("tiny") / "tiny"))


@pytest.fixture(scope="module")
def compiled_quantized(tiny_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, CompileReport]]:
    """The tiny model compiled with each scheme: (artifact, compile report), its dumps in <artifact>-dumps."""
    root = tmp_path_factory.mktemp("quantized")
    outs = {}
    for scheme in ("fp8", "int8", "int4"):
        config = CompileConfig(quantization=scheme, dump_dir=root / f"{scheme}-dumps")
        _, report = graphkiln.compile_model(tiny_copy, root / scheme, config, engine=SMALL_ENGINE)
        report.counters.expect(graphs_traced=1, inductor_compiles=3)
        outs[scheme] = (root / scheme, report)
    return outs


@pytest.fixture(scope="module")
def quantized(compiled_quantized: dict[str, tuple[Path, CompileReport]]) -> dict[str, Path]:
    return {scheme: out for scheme, (out, _) in compiled_quantized.items()}


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
def test_quantized_graph_calls_the_quantized_ops_and_the_linear_passes_leave_them(
    compiled_quantized: dict[str, tuple[Path, CompileReport]], scheme: str
) -> None:
    out, report = compiled_quantized[scheme]
    pieces = "".join(p.read_text() for p in out.parent.joinpath(f"{scheme}-dumps").glob("*-split.submod_*.py"))
    # the graph's calls, not the source lines quoted in comments above them: 4 projections x 4 layers, fp8's gate/up
    # and down projections one graphkiln::fp8_mlp call a layer, int4's down projection of the SiLU-and-mul one
    # graphkiln::int4_silu_mul_linear call
    calls = Counter(re.findall(r"= torch\.ops\.graphkiln\.(\w+)(?:\.default)?\(", pieces))
    products = {f"{scheme}_linear": 1, f"{scheme}_linear_silu_mul": 1, "fp8_mlp": 2, "int4_silu_mul_linear": 1}
    assert sum(calls[op] * n for op, n in products.items()) == 16, calls
    assert "graphkiln.silu_mul_linear" not in pieces
    records = {r.name: r for r in report.passes}
    assert records["linear_op"].runs > 0 and records["linear_op"].matches == 0
    assert records["silu_mul_linear"].runs == 1 and records["silu_mul_linear"].matches == (4 if scheme == "int4" else 0)
    # fp8's and int8's gate/up products take their activation (4 layers); int4's are left as they are
    assert records["silu_mul_epilogue"].matches == (0 if scheme == "int4" else 4)
    assert records["fp8_mlp"].matches == (4 if scheme == "fp8" else 0)
    assert ("graphkiln.int8_linear_silu_mul" in pieces) == (scheme == "int8")


@pytest.mark.slow
def test_fp8_mlp_activation_in_its_product_scores_as_without_silu_mul_epilogue(
    quantized: dict[str, Path], tmp_path: Path
) -> None:
    """The default fp8 artifact, whose gate/up products apply their activation (graphkiln::fp8_linear_silu_mul,
    inside graphkiln::fp8_mlp with the down projection), scores a prompt as one compiled with silu_mul_epilogue
    disabled (the product, then Inductor's SiLU-and-mul; on the CPU the op is the product, then the activation
    rounded once, as Inductor's fused kernel rounds it)."""
    config = CompileConfig(quantization="fp8", disabled_passes=("silu_mul_epilogue",))
    _, report = graphkiln.compile_model(tiny_model_dir(), tmp_path / "fp8", config, engine=SMALL_ENGINE)
    records = {r.name: r for r in report.passes}
    assert records["silu_mul_epilogue"].runs == 0 and records["silu_mul_linear"].matches == 0
    ids = list(range(5, 133))
    without = graphkiln.load(tmp_path / "fp8", **COMPILED).score(ids)
    default = graphkiln.load(quantized["fp8"], **COMPILED).score(ids)
    torch.testing.assert_close(default, without, rtol=2e-2, atol=2e-2)
    assert top1_agreement(default, without) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("scheme,fusion", [("fp8", "fp8_norm_quant"), ("int4", "int4_norm_words")])
def test_norm_fusions_take_the_norms_before_quantized_products_and_score_as_the_norms_alone(
    tmp_path: Path, scheme: str, fusion: str
) -> None:
    """Enabled with add_rms_norm, the norms feeding fp8 (int4) products (each layer's post-attention norm before the
    MLP, the input norms of layers 2-4 before q/k/v; not the final norm before the bf16 LM head) quantize their
    output for them (write its words); the artifact scores a prompt bit for bit as one compiled with add_rms_norm
    alone. On the CPU the products multiply x and ignore the rows, scales and words the norm hands them, so this
    checks that each product's x is its norm's output; the handoff's wiring is checked on Dynamo graphs
    (test_fusion_passes.py, test_int4_fusions.py), its values on CUDA (tests/gpu/test_fusion_engines_gpu.py).
    (Against the default artifact, whose norms are Inductor's, the fp8 scores differ: its per-token quantization
    rounds some of the other norm's last bits to another fp8 value.)"""
    ids = list(range(5, 133))
    scores = {}
    for name, passes in (("fused", ("add_rms_norm", fusion)), ("norms", ("add_rms_norm",))):
        config = CompileConfig(quantization=scheme, enabled_passes=passes)
        _, report = graphkiln.compile_model(tiny_model_dir(), tmp_path / name, config, engine=SMALL_ENGINE)
        records = {r.name: r for r in report.passes}
        assert (records["add_rms_norm"].matches, records[fusion].matches) == (8, 7 if name == "fused" else 0)
        scores[name] = graphkiln.load(tmp_path / name, **COMPILED).score(ids)
    assert torch.equal(scores["fused"], scores["norms"])


@pytest.mark.slow
@pytest.mark.parametrize("scheme,max_error,min_top1", [("fp8", 0.1, 0.9), ("int8", 0.05, 0.95), ("int4", 0.2, 0.8)])
def test_quantized_tiny_logits_stay_close_to_bf16(
    quantized: dict[str, Path], scheme: str, max_error: float, min_top1: float
) -> None:
    ids = list(range(5, 133))
    ref = graphkiln.LLM.eager("tiny", **ENGINE).score(ids)
    before = torch_compile_events()
    llm = graphkiln.load(quantized[scheme], **COMPILED)
    ours = llm.score(ids)
    after = torch_compile_events()
    for event in ("dynamo_graphs", "inductor_compiles"):  # nothing traced or compiled by the load or the call
        assert after[event] == before[event], event
    error, top1 = relative_error(ours, ref), top1_agreement(ours, ref)
    print(f"{scheme}: logits vs bf16 relative error {error:.4f}, top-1 agreement {top1:.3f}")
    assert 0 < error < max_error and top1 >= min_top1


@pytest.mark.slow
def test_quantized_tiny_held_out_perplexity_within_target(
    quantized: dict[str, Path], held_out_windows: list[list[int]]
) -> None:
    """fp8 and int8 within 1% of bf16, int4 within 5% (the quality goals of quantized weights)."""
    base = quality.perplexity(graphkiln.LLM.eager("tiny", **ENGINE), held_out_windows)
    schemes = ("fp8", "int8", "int4")
    ppl = {s: quality.perplexity(graphkiln.load(quantized[s], **COMPILED), held_out_windows) for s in schemes}
    print(f"held-out perplexity: bf16 {base:.3f}, " + ", ".join(f"{s} {p:.3f} ({p / base - 1:+.2%})" for s, p in ppl.items()))
    assert base < ppl["fp8"] < base * 1.01 and base < ppl["int4"] < base * 1.05
    assert abs(ppl["int8"] / base - 1) < 0.01  # +0.01% measured: it may land on either side


@pytest.mark.slow
def test_quantized_weights_are_stored_once_and_a_warm_load_neither_quantizes_nor_reads_the_linears(
    quantized: dict[str, Path], tiny_copy: Path
) -> None:
    out = quantized["fp8"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert QUANTIZED_FILE in manifest["files"] and manifest["config"]["quantization"] == "fp8"
    with safe_open(str(out / QUANTIZED_FILE), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.qkv_proj.weight").dtype == FP8
    assert "model.layers.0.mlp.down_proj.weight_scale" in names and not any("embed" in n or "norm" in n for n in names)
    ids = list(range(5, 40))
    quantized_before = projections_quantized()
    assert quantized_before > 0  # the fixture's compiles quantized in this process, so the counter counts
    before = graphkiln.load(out, **COMPILED).score(ids)
    _zero_projection_weights(tiny_copy / "model.safetensors")  # same header, so the artifact still matches
    after = graphkiln.load(out, **COMPILED).score(ids)
    assert torch.equal(before, after)
    assert projections_quantized() == quantized_before  # the two loads quantized nothing
    assert not torch.equal(graphkiln.LLM.eager(tiny_copy, **ENGINE).score(ids), graphkiln.LLM.eager("tiny", **ENGINE).score(ids))


def _zero_projection_weights(path: Path) -> None:
    """Overwrite the bytes of every q/k/v/o/gate/up/down weight in a safetensors file, keeping its header."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    for name, info in header.items():
        if name != "__metadata__" and name.endswith("_proj.weight"):
            start, end = info["data_offsets"]
            data[8 + length + start : 8 + length + end] = bytes(end - start)
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_tampered_or_missing_quantized_weights_are_artifact_errors(quantized: dict[str, Path], tmp_path: Path) -> None:
    art = Path(shutil.copytree(quantized["int4"], tmp_path / "art"))
    data = bytearray((art / QUANTIZED_FILE).read_bytes())
    data[-1] ^= 1
    (art / QUANTIZED_FILE).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=rf"{QUANTIZED_FILE}: sha256 differs from manifest.json"):
        graphkiln.load(art, **ENGINE)
    (art / QUANTIZED_FILE).unlink()
    with pytest.raises(ArtifactError, match=rf"{QUANTIZED_FILE}: listed in manifest.json but missing"):
        graphkiln.load(art, **ENGINE)


@pytest.mark.slow
def test_inspect_shows_each_layers_format(quantized: dict[str, Path], capsys) -> None:
    assert cli.main(["inspect", str(quantized["int4"])]) == 0
    text = capsys.readouterr().out
    assert f"quantization  int4, group weight scales, weight-only (quantized by compile-model), weights in {QUANTIZED_FILE}" in text
    assert "layers 0-3 self_attn.qkv_proj        int4, asymmetric, groups of 128, weight-only" in text
    assert "layers 0-3 mlp.down_proj             int4, asymmetric, groups of 16, weight-only" in text  # K = 688
    assert "lm_head                              float32 (not quantized)" in text


@pytest.mark.slow
def test_prequantized_checkpoint_compiles_into_an_artifact_that_reads_it_as_it_is(
    llama: Checkpoint, random_ids: Callable[..., list[int]], tmp_path: Path
) -> None:
    ids = random_ids(48)
    write_fp8_checkpoint(llama.path, llama.model, tmp_path / "fp8", "compressed-tensors", "tensor", "static", ids)
    manifest, _ = graphkiln.compile_model(tmp_path / "fp8", tmp_path / "art", engine=SMALL_ENGINE)
    quant = manifest["model"]["quantization"]
    assert quant["description"] == "fp8, tensor weight scales, static activations (compressed-tensors checkpoint)"
    assert quant["file"] is None and QUANTIZED_FILE not in manifest["files"]
    assert quant["layers"]["model.layers.1.self_attn.qkv_proj"] == "fp8 e4m3, per-channel weight scales, static per-tensor activations"
    compiled = graphkiln.load(tmp_path / "art", **COMPILED).score(ids)
    eager = graphkiln.LLM.eager(tmp_path / "fp8", **ENGINE).score(ids)
    assert relative_error(compiled, eager) < 1e-4
    code = f"""import json, sys, graphkiln
logits = graphkiln.load({str(tmp_path / "art")!r}, **{COMPILED!r}).score({ids!r})
print("{RESULT_PREFIX}" + json.dumps({{"logits": logits.tolist(), "imported": [m for m in ("compressed_tensors", "transformers") if m in sys.modules]}}))
"""
    fresh = run_python_json(code)  # the recorded scheme: config.json is not parsed again, so neither library loads
    assert fresh["imported"] == [] and torch.equal(torch.tensor(fresh["logits"]), compiled)


def test_compile_model_refuses_an_unsupported_scheme_before_writing_anything(llama: Checkpoint, tmp_path: Path) -> None:
    gptq = with_quantization_config(llama.path, tmp_path / "gptq", {"quant_method": "gptq", "bits": 3})
    with pytest.raises(UnsupportedModelError, match="GPTQ with bits 3"):
        graphkiln.compile_model(gptq, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gptq"]
