"""The graphkiln rows: compiled (cold and warm start in fresh processes, CUDA graphs) and eager (the reference)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

from .child import graph_stats, run_child
from .common import error_text, log
from .timing import measure_decode, measure_prefill, now, random_prompts


@contextlib.contextmanager
def env_override(values: dict):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def gk_generate(llm, prompts: list[list[int]], new_tokens: int, s) -> dict:
    from graphkiln import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = now(s.device)
    outs = llm.generate(prompts, params)
    t1 = now(s.device)
    made = {len(o.token_ids) for o in outs}
    if made != {new_tokens}:
        raise RuntimeError(f"graphkiln generated {sorted(made)} tokens per request, not {new_tokens}")
    return {"total_s": t1 - t0, "ttft_s": max(o.time_to_first_token_s for o in outs)}


def check_against_hf(llm, ids: list[int], ref) -> dict:
    """Logits of one prompt against transformers': relative error and argmax agreement (recorded only)."""
    got = llm.score(ids).float().cpu()
    rel = float((got - ref).norm() / ref.norm())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"rel_err": rel, "argmax_agreement": agree}


def _prefill_ms(llm, n: int, s, vocab: int) -> list[float]:
    """Time to first token with max_tokens=1, after one warm-up."""
    prompt = random_prompts(1, n, vocab, seed=1000 + n)
    gk_generate(llm, prompt, 1, s)
    return [gk_generate(llm, prompt, 1, s)["ttft_s"] * 1e3 for _ in range(s.prefill_reps)]


def _check_and_time(llm, s, mres: dict, row: dict, label: str, save) -> None:
    if "_ref_logits" in mres:
        row["check"] = check_against_hf(llm, mres["_check_ids"], mres["_ref_logits"])
        log(f"  {label} vs transformers logits: {row['check']}")
    vocab = mres["shape"]["vocab_size"]
    measure_prefill(row, s, label, lambda n: _prefill_ms(llm, n, s, vocab))
    measure_decode(row, s, label, lambda prompts, k: gk_generate(llm, prompts, k, s), vocab, save)


def _cold_start(s, row: dict, spec: dict, cache_env: dict) -> None:
    try:
        log("  graphkiln cold start (compile in a fresh process, empty caches) ...")
        cold = run_child({**spec, "mode": "gk_cold"}, cache_env, timeout=s.child_timeout(reserve=90))
        row["start"]["cold"] = cold
        row["start"]["cold_s"] = cold["start_to_first_token_s"]
        row["compile_s"] = cold.get("compile_s")
        log(f"  graphkiln cold start to first token: {cold['start_to_first_token_s']:.1f} s "
            f"(compile {cold.get('compile_s', float('nan')):.1f} s; {cold.get('compile_summary', '')})")
    except subprocess.TimeoutExpired as e:
        row["start"]["cold"] = {"error": error_text(e)}
        raise RuntimeError(f"the cold compile ran past its {e.timeout:.0f} s (the time left before --hard-limit-s)") from e
    except Exception as e:  # noqa: BLE001
        row["start"]["cold"] = {"error": error_text(e)}
        log(f"  graphkiln cold start failed: {error_text(e)}")


def _warm_start(s, row: dict, spec: dict, cache_env: dict) -> None:
    try:
        warm = run_child({**spec, "mode": "gk_warm"}, cache_env, timeout=s.child_timeout(reserve=60, cap=300))
        row["start"]["warm"] = warm
        row["start"]["warm_s"] = warm["start_to_first_token_s"]
        log(f"  graphkiln warm start to first token: {warm['start_to_first_token_s']:.1f} s "
            f"(load {warm['load_s']:.1f} s, capture {warm.get('capture_s') or 0:.1f} s)")
    except Exception as e:  # noqa: BLE001
        row["start"]["warm"] = {"error": error_text(e)}
        log(f"  graphkiln warm start failed: {error_text(e)}")


def compiled(s, mres: dict, row: dict, save) -> None:
    """compile_model in a fresh process with empty caches (cold start), load in another (warm start), then
    load here for the timings; graph memory from the decode and prefill graphs' CaptureStats."""
    import graphkiln

    artifact = Path(mres["model_dir"] + "-artifact")
    caches = Path(mres["model_dir"] + "-caches")  # fresh: the cold start compiles everything
    cache_env = {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    prompt = random_prompts(1, s.prompt_len, mres["shape"]["vocab_size"], seed=7)[0]
    spec = {"model_dir": mres["model_dir"], "artifact": str(artifact), "config": s.compile_config(),
            "engine": s.engine, "prompt": prompt}
    row["compile_config"] = s.compile_config()
    row["engine"] = dict(s.engine)
    _cold_start(s, row, spec, cache_env)
    if not (artifact / "manifest.json").is_file():
        log("  no artifact from the cold child: compiling in this process instead")
        t = time.time()
        graphkiln.compile_model(mres["model_dir"], artifact, graphkiln.CompileConfig(**s.compile_config()), force=True)
        row["compile_in_process_s"] = time.time() - t
    _warm_start(s, row, spec, cache_env)
    t = time.time()
    with env_override(cache_env):  # load as the warm start did: the caches the cold compile filled
        llm = graphkiln.load(artifact, **s.engine)
    row["load_in_process_s"] = time.time() - t
    try:
        row.update(graph_stats(llm))
        if s.device == "cuda" and not row.get("decode_graphs"):
            row["warning"] = "no decode CUDA graphs were captured"
        _check_and_time(llm, s, mres, row, "graphkiln compiled", save)
    finally:
        del llm


def eager(s, mres: dict, row: dict, save) -> None:
    """LLM.eager on the saved model: the reference engine, no compile."""
    import graphkiln

    t = time.time()
    llm = graphkiln.LLM.eager(mres["model_dir"], device=s.device, dtype=s.dtype_name, **s.engine)
    row["load_in_process_s"] = time.time() - t
    try:
        _check_and_time(llm, s, mres, row, "graphkiln eager", save)
    finally:
        del llm
