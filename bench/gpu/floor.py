"""The hardware ceilings measured in this run (copy bandwidth, matmul rate) and the floor they give a model."""

from __future__ import annotations

import statistics

from .timing import free_memory, time_device_ms


def measure_hardware(s) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and the dense matmul rate, medians of 10."""
    import torch

    n = s.copy_bytes // s.dtype_bytes
    src = torch.randn(n, dtype=s.dtype, device=s.device)
    dst = torch.empty_like(src)
    copy_ms = time_device_ms(lambda: dst.copy_(src), s.device, reps=10)
    if not torch.equal(dst, src):
        raise RuntimeError("copy check failed: destination differs from source")
    del src, dst
    m = s.matmul_n
    a = torch.randn(m, m, dtype=s.dtype, device=s.device)
    b = torch.randn(m, m, dtype=s.dtype, device=s.device)
    mm_ms = time_device_ms(lambda: torch.mm(a, b), s.device, reps=10)
    del a, b
    free_memory(s.device)
    copy_med, mm_med = statistics.median(copy_ms), statistics.median(mm_ms)
    return {
        "copy_bytes": s.copy_bytes,
        "copy_ms_median": copy_med,
        "copy_ms_all": copy_ms,
        "copy_bandwidth_Bps": 2 * s.copy_bytes / (copy_med / 1e3),
        "matmul_n": m,
        "matmul_ms_median": mm_med,
        "matmul_flops_per_s": 2 * m**3 / (mm_med / 1e3),
    }


def _bound(nbytes: float, flops: float, hw: dict) -> dict:
    """max(bytes / copy bandwidth, FLOPs / matmul rate) in ms, and both sides of it."""
    mem_ms, comp_ms = nbytes / hw["copy_bandwidth_Bps"] * 1e3, flops / hw["matmul_flops_per_s"] * 1e3
    return {"ms": max(mem_ms, comp_ms), "memory_ms": mem_ms, "compute_ms": comp_ms, "bytes": nbytes, "flops": flops}


def floor_row(mb: dict, hw: dict, s) -> dict:
    """The floor row for model bytes `mb`: per decode batch (KV read at the mean decode context) and per prefill."""
    ctx = s.prompt_len + s.new_tokens / 2
    decode = {}
    for b in s.batches:
        nbytes = mb["weight_bytes_read"] + b * ctx * mb["kv_bytes_per_token"] + b * mb["kv_bytes_per_token"]
        flops = b * (2 * (mb["matmul_params_per_token"] + mb["lm_head_params"]) + mb["attn_flops_per_token_per_ctx"] * ctx)
        cell = _bound(nbytes, flops, hw)
        decode[str(b)] = {"ms_per_token": cell.pop("ms"), **cell}
    prefill = {}
    for n in s.prefill_lens:
        nbytes = mb["weight_bytes_read"] + n * mb["kv_bytes_per_token"]
        flops = 2 * n * mb["matmul_params_per_token"] + 2 * mb["lm_head_params"] + mb["attn_flops_per_token_per_ctx"] * n * n / 2
        prefill[str(n)] = _bound(nbytes, flops, hw)
    return {
        "label": "bandwidth floor",
        "decode": decode,
        "prefill": prefill,
        # The definition: every weight byte over the copy bandwidth, batch 1, no KV.
        "issue_floor_ms_per_token": mb["weight_bytes_all"] / hw["copy_bandwidth_Bps"] * 1e3,
        "error": None,
    }
