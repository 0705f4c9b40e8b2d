"""Tensor-parallel decode and prefill: TP 1 beside TP 2 with NCCL's all-reduces and with symm_mem_all_reduce.

    python -m bench tp-decode --model 8b --out "$OUT"     # 2 GPUs (NCCL, multicast off)
    python -m bench tp-decode --smoke --out /tmp/x        # CPU, gloo: tp1 and tp2 (the pass needs CUDA)

Every configuration compiles the model (`compile_model`, the decode batch sizes in `specialize_sizes`, which
symm_mem_all_reduce needs: every row gets them, so the TP-2 rows differ in the pass alone), loads it
(`graphkiln.load`: rank 1 spawned, graphs captured on both ranks) and measures: decode ms per engine step
at each batch (a user's step: rank 0 announces it on the control group, both ranks replay their decode
graph, whose all-reduces meet inside), prefill ms of one prompt per length (time to first token, median
of 5), the greedy tokens of a few prompts and the logits of one. Rows, most important first (a row that
would start after --budget-s is skipped and recorded so): `tp2` (NCCL), `tp2-symm-mem`, `tp1`, and `tp2`
again (the noise). The JSON has, per row, each batch's share of the bandwidth floor per rank (weights
and the KV cache at the mean context, divided by the ranks, at the measured copy rate), the pass's
rewrites (counted only where Inductor compiled afresh), steps that ran without a graph, and the token
agreement and largest logit difference against the first TP-2 row, with the reference's top-two logit gap
where a prompt's greedy tokens first part from it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .common import Study, add_study_arguments, error_text, greedy_agreement, log, random_prompts, top2_gaps
from .measure import copy_rate, time_ms
from .models import decoding, model_bytes, save_model, shape_of, stop
from .report import text_table

PASS = "symm_mem_all_reduce"
CONFIGS = {  # name -> (tensor-parallel size, enabled passes)
    "tp2": (2, ()),
    "tp2-symm-mem": (2, (PASS,)),
    "tp1": (1, ()),
    "tp2-again": (2, ()),
}
MIN_ROW_S = 60  # a row needs at least this much of the budget left to start


def measure(study: Study, model_dir: Path, work: Path, name: str, batches: tuple[int, ...],
            prefills: tuple[int, ...], prompts: list[list[int]]) -> dict:  # fmt: skip
    import graphkiln

    size, enabled = CONFIGS[name]
    engine = graphkiln.EngineConfig(decode_batch_sizes=batches, prefill_token_buckets=prefills,
                                    max_num_batched_tokens=max(2048, *prefills),
                                    kv_cache_tokens=8192 if study.smoke else 65536)  # fmt: skip
    config = graphkiln.CompileConfig(device=study.device, dtype=study.dtype_name, tensor_parallel_size=size,
                                     specialize_sizes=batches, enabled_passes=enabled)  # fmt: skip
    start = time.perf_counter()
    _, report = graphkiln.compile_model(model_dir, work / name, config, engine=engine, force=True)
    row = {"config": name, "ranks": size, "enabled": list(enabled), "compile_s": time.perf_counter() - start,
           "pass_rewrites": {r.name: r.matches for r in report.passes}.get(PASS, 0)}  # fmt: skip
    start = time.perf_counter()
    with graphkiln.load(work / name) as llm:
        llm.wait_ready()
        row["load_and_capture_s"] = time.perf_counter() - start
        prompt = 16 if study.smoke else 128
        for b in batches:
            seqs = decoding(llm, b, 160, prompt)
            timing = time_ms(llm.engine.step, study.device, reps=5, calls=4 if study.smoke else 25, warmup=5)
            row[f"decode_ms_b{b}"] = timing.median_ms
            stop(llm, seqs)
        params = graphkiln.SamplingParams(max_tokens=1, ignore_eos=True)
        for n in prefills:
            row[f"prefill_ms_{n}"] = time_ms(lambda: llm.generate([[11] * n], params), study.device, reps=5,
                                             warmup=1).median_ms  # fmt: skip
        greedy = graphkiln.SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2)
        outs = llm.generate(prompts, greedy)
        row["tokens"] = [o.token_ids for o in outs]
        row["top2_gaps"] = top2_gaps(outs)
        row["logits"] = llm.score(prompts[0]).float().cpu()
        row["steps_without_graph"] = dict(llm.stats().steps_without_graph)
    return row


def compare(row: dict, reference: dict) -> None:
    """Token agreement and the largest logit difference of `row` against `reference`, into `row`, with the
    reference's top-two logit gap where a prompt's tokens part (`greedy_agreement`)."""
    row["token_agreement"], row["divergence_gaps"] = greedy_agreement(row["tokens"], reference["tokens"],
                                                                      reference["top2_gaps"])  # fmt: skip
    row["max_logit_diff"] = float((row["logits"] - reference["logits"]).abs().max())


def add_floor(row: dict, study: Study, batches: tuple[int, ...], rate: float) -> None:
    """Each batch's decode step against the per-rank floor: (weights + KV at the mean context) / ranks / rate."""
    sizes = model_bytes(shape_of(study.model, layers=study.layers), study.dtype.itemsize)
    context = (16 if study.smoke else 128) + 80
    for b in batches:
        floor_ms = (sizes["weight_bytes_read"] + sizes["kv_bytes_per_token"] * context * b) / row["ranks"] / rate * 1e3
        row[f"floor_ms_b{b}"] = floor_ms
        row[f"x_floor_b{b}"] = row[f"decode_ms_b{b}"] / floor_ms


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p, model="8b")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,32,64; smoke 1,2)")
    p.add_argument("--prefill", default=None, help="prefill prompt lengths (default 128,1024,4096; smoke 16,48)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"rows, in order (default {','.join(CONFIGS)})")
    p.add_argument("--budget-s", type=float, default=480, help="start no row after this many seconds")


def main(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    study = Study.of("tp-decode", a)
    study.two_gpus()
    batches = tuple(int(x) for x in (a.batches or ("1,2" if study.smoke else "1,8,32,64")).split(","))
    prefills = tuple(int(x) for x in (a.prefill or ("16,48" if study.smoke else "128,1024,4096")).split(","))
    names = study.chosen(a.configs, tuple(CONFIGS), "configs")
    rate = copy_rate(study.device, (1 << 24) if study.smoke else (2 << 30))
    rows: dict[str, dict] = {}
    results = {"batches": batches, "prefill_tokens": prefills, "copy_rate_bytes_per_s": rate, "rows": rows}
    with study.scratch() as work:
        model_dir = save_model(study.model, work / "model", study.device, study.dtype, study.layers)
        vocab = shape_of(study.model)["vocab_size"]
        prompts = random_prompts(4, 24, vocab, seed=0)
        reference = None
        for name in names:
            if CONFIGS[name][1] and not study.cuda:
                rows[name] = {"config": name, "skipped": "needs CUDA and 2 GPUs"}
            elif time.perf_counter() - t0 > a.budget_s - MIN_ROW_S:
                rows[name] = {"config": name, "skipped": f"over --budget-s {a.budget_s:.0f}"}
            else:
                try:
                    row = measure(study, model_dir, work, name, batches, prefills, prompts)
                    add_floor(row, study, batches, rate)
                    if row["ranks"] == 2:
                        reference = reference or row
                        compare(row, reference)
                    rows[name] = row
                except Exception as e:  # the next rows still run; the error is in the JSON
                    rows[name] = {"config": name, "error": error_text(e)}
            said = {k: v for k, v in rows[name].items() if isinstance(v, float) or k in ("skipped", "error")}
            log(f"{name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k}: {v}"
                                        for k, v in said.items()))  # fmt: skip
            study.save({**results, "rows": {k: _saved(v) for k, v in rows.items()}})
    columns = ["config", *(f"decode_ms_b{b}" for b in batches), *(f"x_floor_b{b}" for b in batches),
               *(f"prefill_ms_{n}" for n in prefills), "pass_rewrites", "token_agreement", "max_logit_diff"]
    print(text_table(list(rows.values()), columns))
    log(f"wrote {study.save({**results, 'rows': {k: _saved(v) for k, v in rows.items()}})}")
    return 0


def _saved(row: dict) -> dict:
    """The row as JSON holds it (no logits tensor)."""
    return {k: v for k, v in row.items() if k != "logits"}
