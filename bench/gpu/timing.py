"""Device clocks and memory, random prompts, and the prefill and decode loops every row shares."""

from __future__ import annotations

import gc
import statistics
import time

from .common import error_text, log


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def now(device: str) -> float:
    sync(device)
    return time.perf_counter()


def time_device_ms(fn, device: str, reps: int, warmup: int = 3) -> list[float]:
    """Per-call milliseconds: CUDA events around each call on the GPU, the host clock on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def free_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def peak_reset(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def decode_cell(runs: list[dict], new_tokens: int, **extra) -> dict:
    """The fastest of `runs` (each {"total_s", "ttft_s"} of one generate call) as a decode cell, `extra` added."""
    best = min(runs, key=lambda r: r["total_s"])
    total_s, ttft_s = best["total_s"], best["ttft_s"]
    cell = {"total_s": total_s, "new_tokens": new_tokens, "ms_per_token_plain": total_s / new_tokens * 1e3}
    if ttft_s is not None:
        cell["ttft_ms"] = ttft_s * 1e3
        cell["ms_per_token"] = (total_s - ttft_s) / max(1, new_tokens - 1) * 1e3
    return {**cell, **extra, "all_total_s": [r["total_s"] for r in runs]}


def measure_prefill(row: dict, s, label: str, times_ms) -> None:
    """Per --prefill length n: the median of `times_ms(n)` (a list of milliseconds), or the error."""
    for n in s.prefill_lens:
        try:
            times = times_ms(n)
            row["prefill"][str(n)] = {"ms": statistics.median(times), "all_ms": times}
            log(f"  {label} prefill {n}: {statistics.median(times):.2f} ms")
        except Exception as e:  # noqa: BLE001
            row["prefill"][str(n)] = {"error": error_text(e)}
            log(f"  {label} prefill {n} failed: {error_text(e)}")


def measure_decode(row: dict, s, label: str, generate, vocab: int, save) -> None:
    """Per --batches size: a warm-up call, then the fastest of --decode-reps `generate(prompts, new_tokens)` calls."""
    for b in s.batches:
        if s.remaining() < 5:
            row["decode"][str(b)] = {"error": "skipped: time budget spent"}
            continue
        try:
            prompts = random_prompts(b, s.prompt_len, vocab, seed=b)
            generate(prompts, min(4, s.new_tokens))  # warm-up: kernels, allocator, the same prefill and decode shapes
            row["decode"][str(b)] = decode_cell([generate(prompts, s.new_tokens) for _ in range(s.decode_reps)], s.new_tokens)
            log(f"  {label} batch {b}: {row['decode'][str(b)].get('ms_per_token', float('nan')):.3f} ms/token")
        except Exception as e:  # noqa: BLE001
            row["decode"][str(b)] = {"error": error_text(e)}
            log(f"  {label} batch {b} failed: {error_text(e)}")
        save()
