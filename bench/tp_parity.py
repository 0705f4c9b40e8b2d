"""Tensor-parallel parity: each family's model at TP 2 against TP 1 on the same checkpoint, in one run.

    python -m bench tp-parity --out "$OUT"                  # 2 GPUs (NCCL): bfloat16 and float32, 64 prompts
    python -m bench tp-parity --smoke --out /tmp/x          # CPU (gloo): float32, tiny shapes, 4 prompts

For each family (Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its q/k norms) a random checkpoint of
the 8B-like widths and 2 layers (`--layers`) is saved, then compiled and loaded at TP 1 and at TP 2 in each
dtype. Per (family, dtype): the largest logit difference over every prompt position, relative to the
largest TP-1 logit; greedy agreement of 16 new tokens per prompt (tokens and whole sequences); and, where a
prompt's tokens part, the TP-1 engine's top-two logit gap there (a near-tie parts on a rounding
difference, a wide gap on a wrong sum). In float32 the greedy tokens should be identical.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .common import Study, add_study_arguments, error_text, greedy_agreement, log, random_prompts, top2_gaps
from .models import FAMILIES, build_hf_model, shape_of
from .report import text_table

NEW_TOKENS = 16
MIN_ROW_S = 45  # a (family, dtype) pair needs at least this much of the budget left to start


def run_engine(study: Study, model_dir: Path, out: Path, size: int, dtype: str, prompts: list[list[int]]) -> dict:
    """Compile and load `model_dir` at `size` ranks; each prompt's logits, greedy tokens and top-two gaps."""
    import graphkiln

    engine = graphkiln.EngineConfig(decode_batch_sizes=tuple(sorted({1, 8, len(prompts)})),
                                    prefill_token_buckets=(32, 64), kv_cache_tokens=8192)  # fmt: skip
    config = graphkiln.CompileConfig(device=study.device, dtype=dtype, tensor_parallel_size=size)
    graphkiln.compile_model(model_dir, out, config, engine=engine, force=True)
    params = graphkiln.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    with graphkiln.load(out) as llm:
        llm.wait_ready()
        outs = llm.generate(prompts, params)
        return {"logits": [llm.score(p).float().cpu() for p in prompts],
                "tokens": [o.token_ids for o in outs],
                "top2_gaps": top2_gaps(outs)}


def agreement(two: dict, one: dict) -> dict:
    """TP 2 against TP 1: relative logit difference, token and sequence agreement, gaps where tokens part."""
    largest = max(float(x.abs().max()) for x in one["logits"])
    diff = max(float((a - b).abs().max()) for a, b in zip(two["logits"], one["logits"]))
    agree, gaps = greedy_agreement(two["tokens"], one["tokens"], one["top2_gaps"])
    return {"logits_rel_diff": diff / largest, "token_agreement": agree,
            "sequences_equal": sum(x == y for x, y in zip(two["tokens"], one["tokens"])),
            "prompts": len(one["tokens"]), "divergence_gaps": gaps, "largest_divergence_gap": max(gaps, default=None)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p, model="8b", layers=2)
    p.add_argument("--families", default=None, help=f"default {','.join(FAMILIES)} (smoke: llama)")
    p.add_argument("--dtypes", default=None, help="default bfloat16,float32 (smoke: float32)")
    p.add_argument("--prompts", type=int, default=None, help="prompts of 24 tokens (default 64; smoke 4)")
    p.add_argument("--budget-s", type=float, default=540, help="start no (family, dtype) pair after this long")


def main(a: argparse.Namespace) -> int:
    import torch

    t0 = time.perf_counter()
    study = Study.of("tp-parity", a)
    study.two_gpus()
    families = study.chosen(a.families or ("llama" if a.smoke else ",".join(FAMILIES)), FAMILIES, "families")
    dtypes = (a.dtypes or ("float32" if a.smoke else "bfloat16,float32")).split(",")
    shape = shape_of(study.model, max_position=2048, layers=study.layers)
    prompts = random_prompts(a.prompts or (4 if a.smoke else 64), 24, shape["vocab_size"], seed=0)
    weights = torch.bfloat16 if study.cuda else torch.float32  # float32 runs hold them exactly
    rows = []
    with study.scratch() as work:
        for family in families:
            model_dir = work / family / "model"
            build_hf_model(shape, study.device, weights, family=family).save_pretrained(model_dir)
            for dtype in dtypes:
                row = {"family": family, "dtype": dtype}
                if time.perf_counter() - t0 > a.budget_s - MIN_ROW_S:
                    row["skipped"] = f"over --budget-s {a.budget_s:.0f}"
                else:
                    try:
                        one, two = (run_engine(study, model_dir, work / family / f"{dtype}-tp{size}", size, dtype,
                                               prompts) for size in (1, 2))  # fmt: skip
                        row.update(agreement(two, one))
                    except Exception as e:  # the next pairs still run; the error is in the JSON
                        row["error"] = error_text(e)
                rows.append(row)
                log(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                              if k != "divergence_gaps"))  # fmt: skip
                study.save({"new_tokens": NEW_TOKENS, "rows": rows})
            if study.cuda:
                torch.cuda.empty_cache()
    print(text_table(rows, ["family", "dtype", "logits_rel_diff", "token_agreement", "sequences_equal", "prompts",
                            "largest_divergence_gap"]))  # fmt: skip
    log(f"wrote {study.save({'new_tokens': NEW_TOKENS, 'rows': rows})}")
    return 0
