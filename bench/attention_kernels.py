"""Benchmark the Triton attention kernels on one GPU: paged decode bandwidth and prefill TFLOP/s.

Decode: Llama-8B-like heads (32 q, 8 kv, head_dim 128, bf16), batch 1/32/128 x context 1k/4k/16k,
every sequence at full context in shuffled 16-token blocks; achieved bandwidth counts the K and V
bytes read, against a device-to-device copy of 1 GiB (read + write bytes). Prefill: one causal
sequence of 128, 1024 and 4096 tokens against torch SDPA's flash kernel, timed in a CUDA graph as
the engine replays it (a 128-token call is a few microseconds). A small sweep of tile
configurations at batch 32 / 4k and at prefill 128 and 4096 shows how much the defaults leave on
the table.

    python bench/attention_kernels.py --out bench/results/attention_kernels.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench, do_bench_cudagraph

from graphkiln.runtime.attention.triton_backend import (
    DecodeTiles,
    PrefillTiles,
    decode_tiles,
    prefill_tiles,
    prefill_work,
    work_table,
)
from graphkiln.kernels.decode_attention import paged_decode
from graphkiln.kernels.prefill_attention import paged_prefill

HQ, HKV, D, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def paged_cache(num_seqs: int, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V caches holding num_seqs sequences of `context` tokens in shuffled blocks, lengths, block tables."""
    per_seq = -(-context // BLOCK)
    shape = (num_seqs * per_seq + 1, BLOCK, HKV, D)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    tables = (torch.randperm(num_seqs * per_seq, device="cuda") + 1).view(num_seqs, per_seq).int()
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, seq_lens, tables


def decode_error(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 out: torch.Tensor) -> float:
    """Relative error of a full-context decode output against float32 attention over the gathered cache."""
    keys = k_cache[tables.long()].flatten(1, 2).float().repeat_interleave(HQ // HKV, 2)
    values = v_cache[tables.long()].flatten(1, 2).float().repeat_interleave(HQ // HKV, 2)
    weights = (torch.einsum("bhd,blhd->bhl", q.float(), keys) * D**-0.5).softmax(-1)
    expected = torch.einsum("bhl,blhd->bhd", weights, values)
    return ((out.float() - expected).norm() / expected.norm()).item()


def bench_decode(num_seqs: int, context: int, copy_bw: float, tiles: DecodeTiles | None = None) -> dict:
    """Time one decode launch; a swept (explicit) tile configuration is also checked against float32."""
    k_cache, v_cache, seq_lens, tables = paged_cache(num_seqs, context)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    planned = decode_tiles(num_seqs, HKV, tables.shape[1] * BLOCK, D, k_cache.element_size(), num_sms)
    q = torch.randn(num_seqs, HQ, D, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    last = context - 1  # the step's new key and value: rewritten in place with what the slot holds already
    slots = (tables[:, last // BLOCK].long() * BLOCK + last % BLOCK).contiguous()
    k, v = k_cache.view(-1, HKV, D)[slots], v_cache.view(-1, HKV, D)[slots]
    counters = torch.zeros(num_seqs * HKV, dtype=torch.int32, device="cuda")
    ms = do_bench(lambda: paged_decode(q, k, v, k_cache, v_cache, seq_lens, tables, slots, out, D**-0.5, counters,
                                       **asdict(tiles or planned)), return_mode="median")
    kv_bytes = 2 * num_seqs * context * HKV * D * k_cache.element_size()
    bw = kv_bytes / (ms * 1e-3)
    row = dict(batch=num_seqs, context=context, **asdict(tiles or planned), us=ms * 1e3, gbs=bw / 1e9,
               pct_copy=100 * bw / copy_bw)
    return row | (dict(rel_err=decode_error(q, k_cache, v_cache, tables, out)) if tiles else {})


def bench_prefill(tokens: int, tiles: PrefillTiles | None = None) -> dict:
    k_cache, v_cache, seq_lens, tables = paged_cache(1, tokens)
    tiles = tiles or prefill_tiles(tokens, D, k_cache.element_size())
    q = torch.randn(tokens, HQ, D, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    query_start = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    items = prefill_work((tokens,), (tokens,), tiles.block_m)
    work = torch.tensor(work_table(items), dtype=torch.int32, device="cuda")
    ms = do_bench_cudagraph(lambda: paged_prefill(q, k_cache, v_cache, query_start, seq_lens, tables, work, out,
                                                  D**-0.5, len(items), **asdict(tiles)), return_mode="median")

    def heads_first(cache: torch.Tensor) -> torch.Tensor:  # [1, HQ, tokens, D], GQA heads repeated
        return cache[tables[0].long()].flatten(0, 1)[:tokens].transpose(0, 1).repeat_interleave(HQ // HKV, 0)[None]

    query, keys, values = q.transpose(0, 1).contiguous()[None], heads_first(k_cache), heads_first(v_cache)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_ms = do_bench_cudagraph(lambda: F.scaled_dot_product_attention(query, keys, values, is_causal=True),
                                     return_mode="median")
        expected = F.scaled_dot_product_attention(query, keys, values, is_causal=True)[0].transpose(0, 1).float()
    err = ((out.float() - expected).norm() / expected.norm()).item()
    flops = 2 * 2 * HQ * D * tokens * tokens / 2  # QK^T and PV, causal half
    return dict(tokens=tokens, **asdict(tiles), us=ms * 1e3, tflops=flops / ms / 1e9,
                sdpa_us=sdpa_ms * 1e3, sdpa_tflops=flops / sdpa_ms / 1e9, rel_err_vs_sdpa=err)


def fitting(run, configs: list) -> list[dict]:
    """Results of the configurations whose tiles fit the GPU's shared memory."""
    results = []
    for config in configs:
        try:
            results.append(run(config))
        except OutOfResources:
            continue
    return results


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["  ".join(f"{c:>10}" for c in columns)]
    for row in rows:
        lines.append("  ".join(f"{row[c]:>10.4g}" if isinstance(row[c], float) else f"{row[c]:>10}" for c in columns))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-configuration sweeps")
    args = parser.parse_args()

    copy_bw = copy_bandwidth()
    result: dict = dict(device=torch.cuda.get_device_name(), copy_gbs=copy_bw / 1e9)
    print(f"{result['device']}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    decode_cols = ["batch", "context", "num_splits", "block_n", "num_warps", "num_stages", "us", "gbs", "pct_copy"]
    prefill_cols = ["tokens", "block_m", "block_n", "num_warps", "num_stages", "us", "tflops", "sdpa_us", "sdpa_tflops",
                    "rel_err_vs_sdpa"]
    result["decode"] = [bench_decode(b, c, copy_bw) for b in (1, 32, 128) for c in (1024, 4096, 16384)]
    print(table(result["decode"], decode_cols))
    result["prefill"] = [bench_prefill(t) for t in (128, 1024, 4096)]
    print(table(result["prefill"], prefill_cols))
    if not args.no_sweep:
        default = DecodeTiles(**{k: result["decode"][4][k] for k in DecodeTiles.__dataclass_fields__})
        variants = [replace(default, num_splits=s) for s in (1, 2, 3, 4, 8)]
        variants += [replace(default, block_n=n, num_warps=w, num_stages=st) for n, w, st in
                     [(32, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (32, 2, 4)]]
        result["decode_sweep"] = fitting(lambda t: bench_decode(32, 4096, copy_bw, t), variants)
        result["decode_sweep"] += [bench_decode(1, 16384, copy_bw, replace(default, num_splits=s)) for s in (8, 16, 64)]
        result["decode_sweep"] += [bench_decode(128, 4096, copy_bw, replace(default, num_splits=2))]
        print(table(result["decode_sweep"], decode_cols + ["rel_err"]))
        prefill_variants = [PrefillTiles(*t) for t in [(32, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                                                       (128, 128, 8, 2)]]
        result["prefill_sweep"] = [row for tokens in (128, 4096)
                                   for row in fitting(lambda t, n=tokens: bench_prefill(n, t), prefill_variants)]
        print(table(result["prefill_sweep"], prefill_cols))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
