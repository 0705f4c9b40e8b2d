"""Decode and prefill at the shapes a server sees, per attention backend, against the floor.

    python -m bench serving --model 1b --backends triton,flashinfer --out $OUT
    python -m bench serving --model 8b --shapes 1x16,1x2000,32x4000 --long '' --out $OUT
    python -m bench serving --model 1b --backends triton,triton:blocks --long '' --out $OUT
    python -m bench serving --model 1b --backends triton --shapes '' --prefill-chunk-tokens 2048,8192 --out $OUT
    python -m bench serving --smoke --out /tmp/bench-smoke     # CPU, tiny shapes, SDPA

One compiled artifact, loaded once per backend with `max_seq_len` raised so every prompt and its
new tokens fit. Decode, per `BATCHxPROMPT` shape: the prompts are prefilled, a few warm-up steps
run, then the time of --steps engine steps (the host's part included, as a server pays it) gives
ms per step; every request has new tokens enough to decode through all of them (the first ones decode
while the later prompts are prefilled), and a row whose timed steps decoded fewer than the batch fails.
The floor is (weight bytes read + KV bytes read at the steps' mean context, in the cache's dtype) / the
copy rate, the faster of the rates measured before and after the rows. Long prompts: one request of each
--long length with max_tokens=1, chunked over steps of at most `max_num_batched_tokens` (the engine's, or each
of --prefill-chunk-tokens, an engine each); its rate counts the weight products and the causal attention's
FLOPs against the measured bf16 matmul rate. The load time of each backend is recorded too.
A backend named `triton:blocks` is Triton with `decode_kernel="blocks"` (`triton:rows` the row
kernel, `triton` its default, `auto`), so one run compares the decode kernels end to end. On the
H200 the first backend a run loads measured up to 17% slower at small shapes than the same backend
loaded again, so compare in A-B-A order (`--backends triton:rows,triton:blocks,triton:rows`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .common import Study, add_study_arguments, log, random_prompts
from .measure import copy_rate, matmul_rate, sync
from .models import model_bytes, positions_for, save_model, shape_of, tokens_to_outlive
from .report import text_table

DECODE_COLUMNS = ["backend", "batch", "prompt", "ms_per_step", "floor_ms", "x_floor", "kv_gb", "weights_gb"]
LONG_COLUMNS = ["backend", "tokens", "chunk", "ms", "tflops", "pct_matmul"]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        batch, prompt = item.lower().split("x")
        shapes.append((int(batch), int(prompt)))
    return shapes


WARMUP_STEPS = 4


def decode_tokens(batch: int, prompt: int, steps: int, chunk: int) -> int:
    """New tokens each request of a decode shape may take: through the prefill of the later prompts, the warm-up
    and the timed steps. Fewer, and the first requests would finish before the timed steps, which would then
    run a smaller batch than the shape says."""
    return tokens_to_outlive(batch, prompt, WARMUP_STEPS + steps + 2, chunk)


def decode_row(llm, batch: int, prompt: int, steps: int, device: str, mb: dict, copy_bw: float, vocab: int) -> dict:
    """ms per decode step of `batch` sequences after `prompt` tokens each, and its floor (the weights and the KV
    cache at the sequences' mean length over the timed steps); all `batch` decode in every timed step."""
    import graphkiln

    engine = llm.engine
    max_tokens = decode_tokens(batch, prompt, steps, engine.config.max_num_batched_tokens)
    params = graphkiln.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(ids, params) for ids in random_prompts(batch, prompt, vocab, seed=batch + prompt)]
    while not all(seq.output_ids for seq in seqs):
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    sync(device)
    tokens_before = sum(len(seq.tokens) for seq in seqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.drain()
    sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    tokens_after = sum(len(seq.tokens) for seq in seqs)
    finished = sum(seq.finish_reason is not None for seq in seqs)
    for seq in seqs:
        engine.abort(seq)
    if finished or tokens_after - tokens_before != batch * steps:
        raise RuntimeError(f"decode {batch}x{prompt}: {finished} of {batch} requests finished and "
                           f"{tokens_after - tokens_before} tokens were added in {steps} timed steps, not "
                           f"{batch * steps}: the timed steps ran a smaller batch (max_tokens {max_tokens})")
    kv = (tokens_before + tokens_after) / 2 * mb["kv_bytes_per_token"]
    floor_ms = (mb["weight_bytes_read"] + kv) / copy_bw * 1e3
    return dict(batch=batch, prompt=prompt, ms_per_step=ms, floor_ms=floor_ms, x_floor=ms / floor_ms, kv_gb=kv / 1e9,
                weights_gb=mb["weight_bytes_read"] / 1e9, mean_context=(tokens_before + tokens_after) / 2 / batch)


def long_row(llm, tokens: int, device: str, mb: dict, matmul_bw: float, reps: int, vocab: int) -> dict:
    """Time to the first token of one `tokens`-token prompt, its FLOP rate, and the steps of one prompt that ran
    without a graph, by kind (a backend's long prefill steps among them)."""
    import graphkiln

    prompt = random_prompts(1, tokens, vocab, seed=tokens)
    params = graphkiln.SamplingParams(max_tokens=1, ignore_eos=True)
    before = llm.stats().steps_without_graph
    llm.generate(prompt, params)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        sync(device)
        times.append(time.perf_counter() - t0)
    seconds = min(times)
    flops = 2 * mb["matmul_params_per_token"] * tokens + 2 * mb["lm_head_params"]
    flops += mb["attn_flops_per_token_per_ctx"] * tokens * (tokens + 1) / 2
    after = llm.stats().steps_without_graph
    eager = {kind: (count - before.get(kind, 0)) // (reps + 1) for kind, count in after.items()
             if count > before.get(kind, 0)}  # fmt: skip
    return dict(tokens=tokens, ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                pct_matmul=100 * flops / seconds / matmul_bw, steps_without_graph=eager)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p, model="1b")
    p.add_argument("--backends", default="triton,flashinfer",
                   help="attention backends, comma-separated; triton:blocks: Triton with the block decode kernel")
    p.add_argument("--shapes", default="1x16,1x2000,16x4000,64x2000,128x1000", help="decode BATCHxPROMPT list")
    p.add_argument("--long", default="16384,32768", help="long prompt lengths (prefill), comma-separated")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per shape")
    p.add_argument("--prefill-chunk-tokens", default="",
                   help="max_num_batched_tokens for the long prompts, comma-separated: one engine each "
                        "(default: the engine's)")
    p.add_argument("--kv-cache-dtype", default=None, help="kv_cache_dtype engine option (default: the engine's)")


def main(a: argparse.Namespace) -> int:
    import graphkiln

    study = Study.of("serving", a)
    shapes = [(1, 16), (2, 64)] if study.smoke else parse_shapes(a.shapes)
    longs = [256] if study.smoke else [int(x) for x in a.long.split(",") if x.strip()]
    backends = ["sdpa"] if study.smoke else [b for b in a.backends.split(",") if b.strip()]
    steps = 4 if study.smoke else a.steps
    chunks = [int(x) for x in a.prefill_chunk_tokens.split(",") if x.strip()] or [None]
    chunk = graphkiln.EngineConfig().max_num_batched_tokens
    max_seq_len = max([p + decode_tokens(b, p, steps, chunk) + 16 for b, p in shapes] + [n + 16 for n in longs])
    max_position = positions_for(max_seq_len)
    shape = shape_of(study.model, max_position=max_position, layers=study.layers)
    mb = model_bytes(shape, 4 if study.smoke else 2)
    copy_bytes = (64 << 20) if study.smoke else (1 << 30)
    copy_bw = copy_rate(study.device, copy_bytes)
    matmul_bw = matmul_rate(study.device, study.dtype, 512 if study.smoke else 8192)
    log(f"copy {copy_bw / 1e9:.0f} GB/s, matmul {matmul_bw / 1e12:.0f} TFLOP/s, max_seq_len {max_seq_len}")
    result: dict = {"copy_gbs": copy_bw / 1e9, "matmul_tflops": matmul_bw / 1e12, "max_seq_len": max_seq_len,
                    "shape": shape, "decode": [], "long": [], "load_s": {}, "errors": {}}
    engine_options: dict = {"max_seq_len": max_seq_len}
    if a.kv_cache_dtype:
        engine_options["kv_cache_dtype"] = a.kv_cache_dtype
        result["kv_cache_dtype"] = a.kv_cache_dtype
    if a.kv_cache_dtype == "fp8_e4m3":  # one byte an element and a float32 scale per token and KV head
        mb["kv_bytes_per_token"] = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * (
            shape["head_dim"] + 4)
    with study.scratch() as work:
        save_model(study.model, work / "model", study.device, study.dtype, study.layers, max_position=max_position)
        config = graphkiln.CompileConfig(device=study.device, dtype=study.dtype_name)
        graphkiln.compile_model(work / "model", work / "art", config)
        for backend in backends:
            name, _, kernel = backend.partition(":")
            backend_options = {"attention_backend": name, **({"decode_kernel": kernel} if kernel else {})}
            if shapes:
                decode_rows(work / "art", backend, backend_options, engine_options, shapes, steps, study, mb,
                            copy_bw, shape["vocab_size"], result)
            for chunk in chunks if longs else []:
                long_options = {**engine_options, **({"max_num_batched_tokens": chunk} if chunk else {})}
                with graphkiln.load(work / "art", capture="blocking", **backend_options, **long_options) as llm:
                    for tokens in longs:
                        row = dict(backend=backend, chunk=llm.engine.config.max_num_batched_tokens,
                                   **long_row(llm, tokens, study.device, mb, matmul_bw, 1 if study.smoke else 2,
                                              shape["vocab_size"]))
                        result["long"].append(row)
                        log(f"{backend} prefill {tokens} in chunks of {row['chunk']}: {row['ms']:.1f} ms, "
                            f"{row['pct_matmul']:.0f}% of matmul, steps without a graph {row['steps_without_graph']}")
    floor_by_best_copy(result, copy_rate(study.device, copy_bytes))
    print(text_table(result["decode"], DECODE_COLUMNS))
    if result["long"]:
        print(text_table(result["long"], LONG_COLUMNS))
    log(f"load s: {result['load_s']}; wrote {study.save(result, study.model)}")
    return 0


def floor_by_best_copy(result: dict, copy_end: float) -> None:
    """The floors at the faster of the copy rates measured before and after the rows: the rate measured varies
    by some percent, and a floor is what the device can do, so its best measured rate."""
    copy_start = result["copy_gbs"] * 1e9
    best = max(copy_start, copy_end)
    result.update(copy_gbs=best / 1e9, copy_gbs_start=copy_start / 1e9, copy_gbs_end=copy_end / 1e9)
    for row in result["decode"]:
        row["floor_ms"] *= copy_start / best
        row["x_floor"] = row["ms_per_step"] / row["floor_ms"]


def decode_rows(art: Path, backend: str, backend_options: dict, engine_options: dict, shapes: list, steps: int,
                study: Study, mb: dict, copy_bw: float, vocab: int, result: dict) -> None:
    """Each decode shape on one engine of `backend`, its load and readiness times in `result`."""
    import graphkiln

    try:
        t0 = time.perf_counter()
        llm = graphkiln.load(art, **backend_options, **engine_options)
        result["load_s"][backend] = time.perf_counter() - t0
        llm.wait_ready()
        result.setdefault("ready_s", {})[backend] = time.perf_counter() - t0
    except graphkiln.errors.GraphkilnError as e:
        result["errors"][backend] = str(e)
        log(f"{backend}: {e}")
        return
    with llm:
        for batch, prompt in shapes:
            row = dict(backend=backend, **decode_row(llm, batch, prompt, steps, study.device, mb, copy_bw, vocab))
            result["decode"].append(row)
            log(f"{backend} decode {batch}x{prompt}: {row['ms_per_step']:.3f} ms ({row['x_floor']:.2f}x floor)")
