"""What quantized weights and the fp8 KV cache cost in quality: each format's logits against the unquantized
model's, and the trained `tiny` model's held-out perplexity per format (`python -m bench quantized --quality`).

    python -m bench quantized --quality --model 1b|8b --out $OUT [--layers N]

The bench's random-weight model (bench/models.py) is compiled in this process once unquantized and
once per format (fp8, int8, int4); the unquantized engine stays loaded while the others are loaded one at a
time beside it, so two copies of the model at most are in memory (the 8B-like one fits an 80 GB GPU). Each
of PROMPTS random prompts of PROMPT_TOKENS tokens is scored (`LLM.score`) by both; per format: the relative
L2 error of its logits against the unquantized ones (median and worst prompt) and top-1 agreement (the
fraction of positions whose argmax matches). Then the `tiny` model, compiled the same way, gives
its held-out perplexity per format (the documents tools/train_tiny.py held out). Beside the formats,
`fp8-rounded`: the unquantized engine on a copy of the checkpoint whose projection weights were
rounded through fp8 (per output channel) and stored back in their dtype, what fp8 does to the
weights alone with no fp8 kernel or activation rounding: on a random-weight model it shows how far
any such perturbation carries through the layers. And `fp8-kv-cache`: the unquantized model on an engine whose
KV cache is fp8 (`kv_cache_dtype="fp8_e4m3"`, a scale per token and KV head); scoring a prompt attends every
position through the cache as stored, as decoding does. On the CPU
(--smoke) the logits come from `tiny` too, over a few short prompts, in float32, and the perplexity
from the first few held-out windows.
Written to <out>/quality-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from .common import REPO, Study, log, random_prompts
from .models import save_model
from .report import markdown_table, text_table
from .rows import free_memory

FORMATS = ("fp8", "int8", "int4")
VARIANTS = (*FORMATS, "fp8-rounded", "fp8-kv-cache")  # compared with the unquantized engine
PROJECTIONS = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))
PROMPTS, PROMPT_TOKENS = 64, 256
SMOKE_PROMPTS, SMOKE_TOKENS, SMOKE_WINDOWS = 4, 64, 6
HELD_OUT_SEQ_LEN = 256


def held_out_windows(seq_len: int = HELD_OUT_SEQ_LEN) -> list[list[int]]:
    """The tiny model's held-out documents as <s> ids </s>, cut into windows of seq_len + 1 tokens
    overlapping by one, as tools/train_tiny.py measures its perplexity on them."""
    from tokenizers import Tokenizer

    from graphkiln.models.tiny import tiny_model_dir

    tools = str(REPO / "tools")
    sys.path.insert(0, tools)
    try:
        import train_tiny
    finally:
        sys.path.remove(tools)
    splits, _ = train_tiny.build_corpus(None)
    docs = train_tiny.encode(Tokenizer.from_file(str(tiny_model_dir() / "tokenizer.json")), splits["held_out"])
    windows = [d[i : i + seq_len + 1] for d in docs for i in range(0, max(1, len(d) - 1), seq_len)]
    return [w for w in windows if len(w) > 1]


def perplexity(llm, windows: list[list[int]]) -> float:
    """exp of the mean next-token negative log-likelihood over every window."""
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    for w in windows:
        logits = llm.score(w)
        nll += F.cross_entropy(logits[:-1], torch.tensor(w[1:], device=logits.device), reduction="sum").item()
        count += len(w) - 1
    return math.exp(nll / count)


def compiled_engine(model_dir: Path, study: Study, quantization: str | None, kv_cache_dtype: str = "auto"):
    """The model compiled in this process (no artifact written), quantized as asked, with a small engine whose KV
    cache is `kv_cache_dtype`."""
    import graphkiln
    from graphkiln.compiler.compile import compile_module
    from graphkiln.models import load_model
    from graphkiln.runtime.builder import build_engine

    net = load_model(model_dir, study.device, study.dtype_name, quantization=quantization)
    config = graphkiln.CompileConfig(device=study.device, dtype=study.dtype_name, quantization=quantization)
    compiled, _ = compile_module(net, config)
    engine = graphkiln.EngineConfig(cuda_graphs=False, kv_cache_tokens=4096, decode_batch_sizes=(1,),
                                    kv_cache_dtype=kv_cache_dtype)
    llm = graphkiln.LLM(build_engine(net, compiled, engine), None)
    llm.wait_ready()  # the warm-up runs before any scoring
    return llm


def fp8_rounded_copy(model_dir: Path, out: Path) -> Path:
    """A copy of the checkpoint whose decoder projection weights are rounded through float8_e4m3 with a scale per
    output channel and stored back in their own dtype."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for path in model_dir.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name, w in tensors.items():
            if name.endswith(PROJECTIONS) and w.dim() == 2:
                scale = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
                tensors[name] = ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    return out


def variant_engine(name: str, model_dir: Path, study: Study, work: Path):
    """The engine of one of 'unquantized', FORMATS, 'fp8-rounded' and 'fp8-kv-cache' on the model, compiled and
    loaded."""
    if name == "fp8-rounded":
        llm = compiled_engine(fp8_rounded_copy(model_dir, work / f"{model_dir.name}-fp8-rounded"), study, None)
    elif name == "fp8-kv-cache":
        llm = compiled_engine(model_dir, study, None, kv_cache_dtype="fp8_e4m3")
    else:
        llm = compiled_engine(model_dir, study, None if name == "unquantized" else name)
    log(f"{model_dir.name}: {name} compiled and loaded")
    return llm


def each_variant(model_dir: Path, study: Study, work: Path, visit: Callable) -> None:
    """visit(name, llm, unquantized_llm) for 'unquantized' and then every variant, each variant loaded beside the
    unquantized engine and closed before the next."""
    reference = variant_engine("unquantized", model_dir, study, work)
    try:
        visit("unquantized", reference, reference)
        for name in VARIANTS:
            llm = variant_engine(name, model_dir, study, work)
            try:
                visit(name, llm, reference)
            finally:
                llm.close()
                free_memory(study.device)
    finally:
        reference.close()
        free_memory(study.device)


def logit_quality(llm, reference, prompts: list[list[int]]) -> dict:
    """The relative L2 error of llm's logits against the reference's (median, worst prompt) and the fraction of
    positions whose argmax agrees."""
    errors, agree = [], 0
    for ids in prompts:
        ref, ours = reference.score(ids), llm.score(ids)
        errors.append(((ours - ref).norm() / ref.norm()).item())
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
    return {"median_relative_l2": statistics.median(errors), "worst_relative_l2": max(errors),
            "top1_agreement": agree / sum(map(len, prompts))}


def to_markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Quantized weights and fp8 KV cache: quality against the unquantized model ({meta['device_name']}, {meta['date']})",
             "", f"commit `{meta['git_commit']}`; torch {meta['torch']}; {results['prompts']} random prompts of "
             f"{results['prompt_tokens']} tokens on the {results['model']} model ({results['dtype']}); held-out "
             f"perplexity of the trained tiny model over {results['held_out_tokens']} tokens.", ""]
    base = results["perplexity"]["unquantized"]
    body = [["unquantized", "—", "—", "—", f"{base:.3f}"]]
    for fmt in VARIANTS:
        q, ppl = results["logits"][fmt], results["perplexity"][fmt]
        body.append([fmt, f"{q['median_relative_l2']:.4f}", f"{q['worst_relative_l2']:.4f}",
                     f"{q['top1_agreement']:.3f}", f"{ppl:.3f} ({ppl / base - 1:+.2%})"])
    header = ["format", "logits rel. L2 error (median)", "(worst prompt)", "top-1 agreement", "tiny perplexity"]
    return "\n".join(lines + markdown_table(header, body)) + "\n"


def main(a: argparse.Namespace) -> int:
    from graphkiln.models.tiny import tiny_model_dir

    study = Study.of("quality", a)
    count, length = (SMOKE_PROMPTS, SMOKE_TOKENS) if study.smoke else (PROMPTS, PROMPT_TOKENS)
    windows = held_out_windows()[:SMOKE_WINDOWS] if study.smoke else held_out_windows()
    results: dict = {"model": "tiny" if study.smoke else study.model, "dtype": study.dtype_name, "prompts": count,
                     "prompt_tokens": length, "held_out_tokens": sum(len(w) - 1 for w in windows)}
    logits, perplexities = {}, {}

    def score(name: str, llm, reference) -> None:
        if name != "unquantized":
            logits[name] = logit_quality(llm, reference, prompts)
            log(f"{name}: {logits[name]}")
            study.save({**results, "logits": logits}, study.model)  # a run stopped later keeps what it measured
        if study.smoke:  # the logits' model is the tiny one
            perplexities[name] = perplexity(llm, windows)

    with study.scratch() as work:
        model_dir = tiny_model_dir() if study.smoke else save_model(study.model, work / study.model, study.device,
                                                                     study.dtype, study.layers)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = random_prompts(count, length, vocab, seed=0)
        each_variant(model_dir, study, work, score)
        results["logits"] = logits
        if not study.smoke:
            each_variant(tiny_model_dir(), study, work,
                         lambda name, llm, reference: perplexities.__setitem__(name, perplexity(llm, windows)))
        results["perplexity"] = perplexities
    rows = [{"format": fmt, **results["logits"][fmt], "perplexity": results["perplexity"][fmt]} for fmt in VARIANTS]
    print(text_table(rows, ["format", "median_relative_l2", "worst_relative_l2", "top1_agreement", "perplexity"]))
    path = study.save(results, study.model)
    path.with_suffix(".md").write_text(to_markdown(json.loads(path.read_text())))
    log(f"wrote {path} and {path.with_suffix('.md').name}")
    return 0
