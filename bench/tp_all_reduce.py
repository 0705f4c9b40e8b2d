"""The all-reduce alone on 2 GPUs: PyTorch's symmetric-memory one-shot kernel against NCCL, by message size.

    python -m bench tp-all-reduce --out "$OUT"      # 2 GPUs; about a minute

Where symm_mem_all_reduce should stop (`SymmMemAllReduceConfig.max_bytes`, 128 KiB): two spawned ranks
(NCCL, multicast off) time, for bfloat16 messages of 1 to 256 rows of --hidden (default 4096, the
8B-like model's: 8 KiB a row), `symm_mem.one_shot_all_reduce_copy` (as the pass calls it: the local
input copied into a symmetric buffer of its size) and NCCL's in-place all-reduce, each 50 times in
one CUDA graph, replays timed with CUDA events on rank 0 (median of 10). Both results are checked
against each other. Written to tp-all-reduce.json; the table shows microseconds per all-reduce.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from .common import environment, log, write_json
from .report import text_table

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CALLS = 50  # all-reduces per CUDA graph


def graph_of(fn, calls: int = CALLS):
    """A CUDA graph of `calls` back-to-back calls of fn (warmed up first, outside the capture)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def replay_us(graph, calls: int = CALLS, reps: int = 10) -> float:
    """Median microseconds per call over `reps` replays (both ranks replay in step: a barrier before each)."""
    import statistics

    import torch
    import torch.distributed as dist

    samples = []
    for _ in range(reps + 2):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples[2:])


def rank_main(rank: int, store_path: str, hidden: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from graphkiln.compat import one_shot_all_reduce_copy, symm_mem_multicast_off, symmetric_empty

    symm_mem_multicast_off()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    group = dist.group.WORLD.group_name
    one_shot = one_shot_all_reduce_copy()
    rows = []
    for tokens in ROWS:
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        buffer = symmetric_empty((tokens, hidden), torch.bfloat16, torch.device("cuda", rank))
        nccl_x = x.clone()
        symm_graph = graph_of(lambda: one_shot(buffer, x, "sum", group))
        nccl_graph = graph_of(lambda: dist.all_reduce(nccl_x))
        expected = x.clone()
        dist.all_reduce(expected)
        agree = torch.equal(one_shot(buffer, x, "sum", group), expected)
        rows.append({"rows": tokens, "bytes": x.numel() * 2, "symm_mem_us": replay_us(symm_graph),
                     "nccl_us": replay_us(nccl_graph), "same_sum": agree})  # fmt: skip
        rows[-1]["symm_mem_over_nccl"] = rows[-1]["symm_mem_us"] / rows[-1]["nccl_us"]
    if rank == 0:
        Path(out).write_text(repr(rows))
    dist.barrier()
    dist.destroy_process_group()


def _join(ranks, table: Path, exit_s: float = 30.0) -> None:
    """Wait for the ranks; once rank 0 has written `table`, give them `exit_s` to leave the group and exit, then
    stop them (a teardown that hangs must not hold the measurements back). A rank that fails raises here."""
    deadline = None
    while not ranks.join(timeout=1.0):
        if deadline is None and table.exists():
            deadline = time.monotonic() + exit_s
        if deadline is not None and time.monotonic() > deadline:
            log(f"the ranks did not exit within {exit_s:.0f} s of writing their rows: stopped")
            for process in ranks.processes:
                process.kill()
                process.join(5)
            return


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None, help="results folder (default $OUT, else the current folder)")
    p.add_argument("--hidden", type=int, default=4096, help="elements per row (default 4096)")
    p.add_argument("--commit", help="git commit to record where the tree has no .git")


def main(a: argparse.Namespace) -> int:
    import ast

    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        raise SystemExit("bench tp-all-reduce: needs 2 GPUs")
    out = Path(a.out or os.environ.get("OUT") or ".").resolve()
    with tempfile.TemporaryDirectory(prefix="gk-bench-ar-") as folder:
        table = f"{folder}/rows"
        ranks = mp.spawn(rank_main, args=(f"{folder}/store", a.hidden, table), nprocs=2, join=False)
        _join(ranks, Path(table))
        rows = ast.literal_eval(Path(table).read_text())
    print(text_table(rows, ["rows", "bytes", "symm_mem_us", "nccl_us", "symm_mem_over_nccl", "same_sum"]))
    path = write_json(out / "tp-all-reduce.json",
                      {"meta": {**environment("cuda", a.commit), "study": "tp-all-reduce"}, "hidden": a.hidden,
                       "rows": rows})  # fmt: skip
    log(f"wrote {path}")
    return 0
