#!/usr/bin/env python3
"""graphkiln side by side with transformers (eager; static cache + torch.compile) and the bandwidth floor.

One process (plus fresh child processes for the start-up times), one GPU, one device call:

    python3 bench/gpu_bench.py --out "$OUT"          # 1b and 8b: about 6-9 minutes, at most ~9
    python3 bench/gpu_bench.py --models 1b --out "$OUT"

graphkiln is imported as installed, or else straight from this repository's folders (no install
needed). Rows that would start after --budget-s (450 s) are skipped; the one still running at
--hard-limit-s (530 s) is stopped by a SIGALRM watchdog; the JSON, markdown and table are written
either way.

Random-weight bf16 Llama models (Llama-3.2-1B-like, Llama-3.1-8B-like) are built with transformers'
own classes on the GPU and saved to a scratch directory that graphkiln loads. Per model, in this
order (most important first, so a short budget drops the least important rows):

  transformers eager       model.generate, default dynamic cache; prefill = one forward;
                           start = fresh process: import, from_pretrained, first token
  graphkiln compiled       compile_model in a FRESH process with empty Inductor/Triton caches (cold
                           start), graphkiln.load in another fresh process (warm start, CUDA graph
                           capture included), then load in this process for decode/prefill timings;
                           graph memory = CaptureStats.pool_bytes of the decode (full) and prefill
                           (piecewise) graphs
  graphkiln eager          LLM.eager(..., attention_backend="triton"): the reference engine
and, after all models, transformers with cache_implementation="static" (its automatic
torch.compile; its first call compiles, 24-200 s, recorded separately), batch 1 on 1b by default.

Decode: 128 random prompt tokens, 128 new tokens, EOS ignored; per generate call as a user sees it:
ms/token = (total - time to first token) / (new tokens - 1), and total / new tokens. At batch B one
step makes B tokens, one per sequence, so ms/token is ms per step. Prefill: batch 1; graphkiln =
time to first token with max_tokens=1, transformers = one forward (logits_to_keep=1).
Floor: max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in this run; bytes =
weights read per step (the untied input embedding table is not read, only its rows) + the KV cache
read at the mean decode context (prompt + new/2).

Expected on the H200 (torch 2.11, transformers 5.17), from the issue (comment only, not asserted):
  1b transformers eager 14.6 ms/token at batch 1; static cache + compile 3.19 ms/token; floor 0.58 ms.
  Targets: decode batch 1 <= 1.15x floor on 8b (<= 4.35 ms/token) and <= 1.0 ms/token on 1b;
  batch 64 on 1b <= 1.6 ms/step; prefill 128 <= 2 ms (1b); warm start <= 10 s (1b); cold <= 60 s (1b).

Results: <out>/<date>-<device>.json (rewritten after every row, so a killed run keeps what it had),
<out>/<date>-<device>.md (bench/report.py), <out>/<date>-<device>.png (matplotlib, optional).
A short table is printed last. Every row runs in try/except; errors land in the JSON.

--smoke runs every code path on the CPU in float32 with tiny shapes (graphkiln compiled on the
CPU, no CUDA graphs; transformers' static row auto-compiles on the CPU too).

This file is the command line; the code is in bench/gpu/ (its __init__ lists the modules).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/gpu/ and its sibling modules

from gpu.child import child_main  # noqa: E402
from gpu.common import ensure_graphkiln, error_text, log  # noqa: E402
from gpu.runner import Run, arm_watchdog  # noqa: E402
from gpu.settings import BENCH_ROWS, Settings  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", help="comma list of 1b, 8b (default 1b,8b; smoke: smoke; also smoke-untied)")
    p.add_argument("--rows", help=f"comma list of {','.join(BENCH_ROWS)} (default all; the floor is always computed)")
    p.add_argument("--batches", help="decode batch sizes (default 1,8,32,64; smoke 1,2)")
    p.add_argument("--prefill", help="prefill prompt lengths at batch 1 (default 128,1024,4096; smoke 16,48)")
    p.add_argument("--prompt-len", type=int, help="decode prompt tokens (default 128; smoke 16)")
    p.add_argument("--new-tokens", type=int, help="decode new tokens (default 128; smoke 8)")
    p.add_argument("--static-models", help="models that get the transformers static+compile row (default 1b; '' for none)")
    p.add_argument("--static-batches", help="batches for that row (default 1; each new batch recompiles)")
    p.add_argument("--decode-reps", type=int, default=1, help="timed generate calls per batch, the fastest kept")
    p.add_argument("--prefill-reps", type=int, help="timed prefills per length, the median kept (default 5)")
    p.add_argument("--decode-buckets", help="graphkiln decode batch buckets (default powers of 2 up to the largest batch)")
    p.add_argument("--prefill-buckets", help="graphkiln prefill token buckets (default 16..largest prefill, powers of 2)")
    p.add_argument("--budget-s", type=float, help="rows that would start past this many seconds are skipped "
                   "(default 450; smoke 1500)")
    p.add_argument("--hard-limit-s", type=float, help="the row still running at this many seconds is stopped "
                   "(default budget + 80; 0 = never)")
    p.add_argument("--reuse-caches", action="store_true", help="keep this process's Inductor/Triton cache "
                   "environment instead of fresh empty caches (the graphkiln cold start always starts empty)")
    p.add_argument("--out", help="results folder (default $OUT, else bench/results)")
    p.add_argument("--commit", help="git commit to record when the tree has no .git")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--keep", action="store_true", help="keep the scratch model and artifact directories")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes: every code path, minutes")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        child_main(json.loads(a.child))
        return 0
    # Fresh Inductor and Triton caches for this process (set before torch reads them), so transformers'
    # first static-cache call compiles from scratch on every run; graphkiln's children get their own.
    caches = Path(tempfile.mkdtemp(prefix="gk-bench-caches-"))
    if not a.reuse_caches:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(caches / "triton")
    try:
        return _run(a)
    finally:
        shutil.rmtree(caches, ignore_errors=True)


def _run(a: argparse.Namespace) -> int:
    s = Settings(a)
    if s.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on a machine without a GPU", file=sys.stderr)
            return 2
    try:
        how = ensure_graphkiln()
    except Exception as e:  # noqa: BLE001
        print(f"graphkiln is not importable ({error_text(e)}); run `pip install --no-deps --no-build-isolation -e .` "
              "in the repository first", file=sys.stderr)
        return 2
    if how != "installed":
        log(f"graphkiln imported {how}")
    arm_watchdog(s.hard_limit_s)
    Run(s).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
