"""The rows a run can have, and Settings: everything a run decides up front (command line or smoke defaults)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .common import BENCH_DIR, T0

# --rows key -> (JSON row name, which bench/report.py labels; what the log calls the row; seconds it needs at
# least: with less budget left it is skipped, recorded, not run). In the order a model runs them.
BENCH_ROWS = {
    "hf_eager": ("transformers_eager", "transformers eager", 25),
    "gk_compiled": ("graphkiln_compiled", "graphkiln compiled + CUDA graphs", 90),
    "gk_eager": ("graphkiln_eager", "graphkiln eager", 25),
    "hf_static": ("transformers_static", "transformers static cache + torch.compile", 150),
}
BUILD_MIN_S = 30  # the same, for building and saving a model


def csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def csv_strs(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, s = [], 1
    while s <= hi:
        if s >= lo:
            out.append(s)
        s *= 2
    return out


class Settings:
    """Everything a run decides up front (from the command line, or the smoke defaults)."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch

        self.smoke = a.smoke
        self.device = "cpu" if a.smoke else "cuda"
        self.dtype_name = "float32" if a.smoke else "bfloat16"
        self.dtype = getattr(torch, self.dtype_name)
        self.dtype_bytes = torch.tensor([], dtype=self.dtype).element_size()
        self.attention_backend = "sdpa" if a.smoke else "triton"
        self.models = csv_strs(a.models or ("smoke" if a.smoke else "1b,8b"))
        self.rows = csv_strs(a.rows or ",".join(BENCH_ROWS))
        self.batches = csv_ints(a.batches or ("1,2" if a.smoke else "1,8,32,64"))
        self.prefill_lens = csv_ints(a.prefill or ("16,48" if a.smoke else "128,1024,4096"))
        self.prompt_len = a.prompt_len or (16 if a.smoke else 128)
        self.new_tokens = a.new_tokens or (8 if a.smoke else 128)
        self.static_models = csv_strs(a.static_models if a.static_models is not None else ("smoke" if a.smoke else "1b"))
        self.static_batches = csv_ints(a.static_batches or "1")
        self.decode_reps = a.decode_reps
        self.prefill_reps = a.prefill_reps or (2 if a.smoke else 5)
        self.budget_s = a.budget_s or (1500 if a.smoke else 450)
        self.hard_limit_s = a.hard_limit_s if a.hard_limit_s is not None else self.budget_s + 80
        self.max_position = 512 if a.smoke else 8192
        self.decode_buckets = csv_ints(a.decode_buckets) if a.decode_buckets else tuple(
            sorted(set(powers_of_two(1, max(self.batches))) | set(self.batches)))
        self.prefill_buckets = csv_ints(a.prefill_buckets) if a.prefill_buckets else (
            (16, 32) if a.smoke else tuple(powers_of_two(16, max(self.prefill_lens))))
        self.copy_bytes = (64 << 20) if a.smoke else (2 << 30)
        self.matmul_n = 256 if a.smoke else 8192
        self.plot = not a.no_plot
        self.keep = a.keep
        self.commit = a.commit
        self.out = Path(a.out or os.environ.get("OUT") or (BENCH_DIR / "results")).resolve()
        # One engine shape for every graphkiln row: room for the largest decode batch or prefill.
        longest = max(max(self.batches) * (self.prompt_len + self.new_tokens), max(self.prefill_lens) + 16)
        self.kv_cache_tokens = -(-(longest + 512) // 1024) * 1024
        self.max_batched_tokens = max(max(self.batches) * self.prompt_len, max(self.prefill_lens))
        self.engine = dict(
            attention_backend=self.attention_backend,
            kv_cache_tokens=self.kv_cache_tokens,
            max_num_batched_tokens=self.max_batched_tokens,
            max_num_seqs=max(256, max(self.batches)),
        )

    def remaining(self) -> float:
        """Seconds until --budget-s: rows that would start later are skipped."""
        return self.budget_s - (time.time() - T0)

    def child_timeout(self, reserve: float, cap: float | None = None) -> float | None:
        """A subprocess timeout that leaves `reserve` seconds before --hard-limit-s (None: no limit)."""
        if not self.hard_limit_s:
            return cap
        left = max(30.0, self.hard_limit_s - (time.time() - T0) - reserve)
        return left if cap is None else min(cap, left)

    def compile_config(self) -> dict:
        return dict(device=self.device, dtype=self.dtype_name, decode_batch_sizes=list(self.decode_buckets),
                    prefill_token_buckets=list(self.prefill_buckets))

    def as_dict(self) -> dict:
        keys = ("smoke", "device", "dtype_name", "attention_backend", "models", "rows", "batches", "prefill_lens",
                "prompt_len", "new_tokens", "static_models", "static_batches", "decode_reps", "prefill_reps",
                "budget_s", "hard_limit_s", "max_position", "decode_buckets", "prefill_buckets", "copy_bytes", "matmul_n",
                "kv_cache_tokens", "max_batched_tokens")
        return {k: getattr(self, k) for k in keys}
