"""The Triton attention kernels on one GPU: paged decode against the copy rate, prefill against torch
SDPA's flash kernel, and tile sweeps (a few minutes).

    python -m bench attention --out $OUT [--no-sweep]

Decode: the 8B-like heads (32 query, 8 KV, head_dim 128, bf16) at batch 1/32/128 and context
1k/4k/16k, every sequence at full context in shuffled 16-token blocks; bandwidth counts the K and
V bytes read, against a device-to-device copy of 1 GiB (bytes read and written); each launch is
timed from a cold L2. Prefill: one causal sequence of 128, 1024 and 4096 tokens, timed in a CUDA
graph as the engine replays it (a 128-token call takes microseconds), against SDPA's flash
kernel. The sweeps: decode tiles at batch 32 / 4k (and splits at 1 / 16k, 128 / 4k) and prefill
tiles at 128 and 4096 tokens, each checked against float32 attention. On the CPU (--smoke,
smoke heads and lengths) the caches, the planning and SDPA run; the Triton kernels need CUDA.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace

from .common import Study, add_study_arguments, log
from .measure import copy_rate, flush_l2, in_graph, time_ms
from .models import shape_of
from .report import text_table

BLOCK = 16
DECODE_COLUMNS = ["batch", "context", "num_splits", "block_n", "num_warps", "num_stages", "us", "gbs", "pct_copy"]
PREFILL_COLUMNS = ["tokens", "block_m", "block_n", "num_warps", "num_stages", "us", "tflops", "sdpa_us", "sdpa_tflops",
                   "rel_err_vs_sdpa"]


class Heads:
    """Query heads, KV heads and head size of the model, and where the tensors live."""

    def __init__(self, study: Study) -> None:
        shape = shape_of(study.model)
        self.hq, self.hkv, self.d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
        self.device, self.dtype = study.device, study.dtype
        self.block, self.head_major = BLOCK, False

    def paged_cache(self, num_seqs: int, context: int):
        """K/V caches holding num_seqs sequences of `context` tokens in shuffled blocks; lengths; block tables."""
        import torch

        per_seq = -(-context // self.block)
        if self.head_major:  # [blocks, heads, block, dim] in memory, seen as [blocks, block, heads, dim]
            shape = (num_seqs * per_seq + 1, self.hkv, self.block, self.d)
            k_cache, v_cache = (torch.randn(shape, dtype=self.dtype, device=self.device).transpose(1, 2)
                                for _ in range(2))
        else:
            shape = (num_seqs * per_seq + 1, self.block, self.hkv, self.d)
            k_cache, v_cache = (torch.randn(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        tables = (torch.randperm(num_seqs * per_seq, device=self.device) + 1).view(num_seqs, per_seq).int()
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=self.device)
        return k_cache, v_cache, seq_lens, tables

    def gathered(self, cache, table, tokens: int):
        """[tokens, hq, d] of one sequence's cache rows, the KV heads repeated for their query heads."""
        return cache[table.long()].flatten(0, 1)[:tokens].float().repeat_interleave(self.hq // self.hkv, 1)


def bench_decode(h: Heads, num_seqs: int, context: int, copy_bw: float, num_sms: int, tiles=None) -> dict:
    """One decode launch, timed from a cold L2; explicit (swept) tiles are also checked against float32."""
    import torch

    from graphkiln.kernels.decode_attention import paged_decode
    from graphkiln.runtime.attention.triton_backend import decode_tiles

    k_cache, v_cache, seq_lens, tables = h.paged_cache(num_seqs, context)
    planned = decode_tiles(num_seqs, h.hkv, tables.shape[1] * h.block, h.d, k_cache.element_size(), num_sms)
    q = torch.randn(num_seqs, h.hq, h.d, dtype=h.dtype, device=h.device)
    out = torch.empty_like(q)
    last = context - 1  # the step's new key and value: rewritten in place with what the slot holds already
    slots = (tables[:, last // h.block].long() * h.block + last % h.block).contiguous()
    k, v = k_cache[slots // h.block, slots % h.block], v_cache[slots // h.block, slots % h.block]
    counters = torch.zeros(num_seqs * h.hkv, dtype=torch.int32, device=h.device)
    chosen = asdict(tiles or planned)
    timing = time_ms(lambda: paged_decode(q, k, v, k_cache, v_cache, seq_lens, tables, slots, out, h.d**-0.5, counters,
                                          **chosen), h.device, reps=50, before=lambda: flush_l2(h.device))
    bw = 2 * num_seqs * context * h.hkv * h.d * k_cache.element_size() / (timing.median_ms * 1e-3)
    row = dict(batch=num_seqs, context=context, **chosen, us=timing.us, gbs=bw / 1e9, pct_copy=100 * bw / copy_bw)
    if tiles:
        scores = torch.stack([torch.einsum("hd,lhd->hl", q[i].float(), h.gathered(k_cache, tables[i], context))
                              for i in range(num_seqs)]) * h.d**-0.5
        values = torch.stack([h.gathered(v_cache, tables[i], context) for i in range(num_seqs)])
        want = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values)
        row["rel_err"] = ((out.float() - want).norm() / want.norm()).item()
    return row


def bench_prefill(h: Heads, tokens: int, tiles=None) -> dict:
    """One causal prefill in a CUDA graph (the Triton kernel on the GPU) and SDPA's, checked against each other."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from graphkiln.runtime.attention.triton_backend import prefill_tiles, prefill_work, work_table

    k_cache, v_cache, seq_lens, tables = h.paged_cache(1, tokens)
    tiles = tiles or prefill_tiles(tokens, h.d, k_cache.element_size())
    q = torch.randn(tokens, h.hq, h.d, dtype=h.dtype, device=h.device)
    query, keys, values = (t.transpose(0, 1)[None].to(h.dtype).contiguous()  # [1, hq, tokens, d]
                           for t in (q, h.gathered(k_cache, tables[0], tokens), h.gathered(v_cache, tables[0], tokens)))
    flops = 2 * 2 * h.hq * h.d * tokens * tokens / 2  # QK^T and PV, the causal half
    backends = [SDPBackend.FLASH_ATTENTION] if h.device == "cuda" else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        sdpa = time_ms(in_graph(lambda: F.scaled_dot_product_attention(query, keys, values, is_causal=True), h.device),
                       h.device, reps=20)
        expected = F.scaled_dot_product_attention(query, keys, values, is_causal=True)[0].transpose(0, 1).float()
    row = dict(tokens=tokens, **asdict(tiles), sdpa_us=sdpa.us, sdpa_tflops=flops / sdpa.median_ms / 1e9)
    if h.device == "cuda":
        from graphkiln.kernels.prefill_attention import paged_prefill

        out = torch.empty_like(q)
        query_start = torch.tensor([0, tokens], dtype=torch.int32, device=h.device)
        items = prefill_work((tokens,), (tokens,), tiles.block_m)
        work = torch.tensor(work_table(items), dtype=torch.int32, device=h.device)
        replay = in_graph(lambda: paged_prefill(q, k_cache, v_cache, query_start, seq_lens, tables, work, out, h.d**-0.5,
                                                len(items), **asdict(tiles)), h.device)
        timing = time_ms(replay, h.device, reps=20)
        row.update(us=timing.us, tflops=flops / timing.median_ms / 1e9,
                   rel_err_vs_sdpa=((out.float() - expected).norm() / expected.norm()).item())
    return row


def fitting(run, configs: list) -> list[dict]:
    """Results of the configurations whose tiles fit the GPU's shared memory."""
    from triton.runtime.errors import OutOfResources

    results = []
    for config in configs:
        try:
            results.append(run(config))
        except OutOfResources:
            continue
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p, model="8b")
    p.add_argument("--no-sweep", action="store_true", help="skip the tile sweeps")
    p.add_argument("--serving-sweep", default="",
                   help="BATCHxCONTEXT list: sweep decode splits and tiles at each of these shapes only")
    p.add_argument("--block-size", type=int, default=BLOCK, help=f"KV cache block size (default {BLOCK})")
    p.add_argument("--head-major", action="store_true",
                   help="cache blocks laid out [heads, block, dim] (each head's rows contiguous)")


SERVING_TILES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 2),
                 (128, 8, 3), (16, 2, 4), (32, 2, 4)]  # (block_n, num_warps, num_stages)


def serving_sweep(h: Heads, shapes: str, copy_bw: float, num_sms: int) -> list[dict]:
    """Every split count and tiling of SERVING_TILES at each BATCHxCONTEXT shape, the planned one first."""
    from graphkiln.runtime.attention.triton_backend import DecodeTiles

    rows = []
    for item in filter(None, shapes.split(",")):
        batch, context = (int(x) for x in item.lower().split("x"))
        planned = bench_decode(h, batch, context, copy_bw, num_sms)
        rows.append(dict(planned, planned=True))
        variants = [DecodeTiles(s, n, w, st) for s in (1, 2, 4, 8, 16, 32) for n, w, st in SERVING_TILES
                    if s * 64 <= context]
        best = fitting(lambda t, b=batch, c=context: bench_decode(h, b, c, copy_bw, num_sms, t), variants)
        best.sort(key=lambda r: r["us"])
        rows += best[:8]
        log(f"{item}: planned {planned['us']:.1f} us ({planned['pct_copy']:.0f}% copy), best {best[0]}")
    return rows


def main(a: argparse.Namespace) -> int:
    import torch

    study = Study.of("attention", a)
    h = Heads(study)
    h.block, h.head_major = a.block_size, a.head_major
    copy_bw = copy_rate(study.device, (64 << 20) if study.smoke else (1 << 30))
    result: dict = {"heads": [h.hq, h.hkv, h.d], "copy_gbs": copy_bw / 1e9}
    log(f"device-to-device copy {copy_bw / 1e9:.0f} GB/s; heads {h.hq} query, {h.hkv} KV, head_dim {h.d}")
    prefill_lengths = (16, 48) if study.smoke else (128, 1024, 4096)
    if a.serving_sweep and study.gpu_only("the serving sweep"):
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        result["serving_sweep"] = serving_sweep(h, a.serving_sweep, copy_bw, num_sms)
        print(text_table(result["serving_sweep"], DECODE_COLUMNS + ["rel_err"]))
        layout = f"{'hnd' if h.head_major else 'nhd'}{h.block}"
        log(f"wrote {study.save(result, f'serving-{study.model}-{layout}')}")
        return 0
    if study.gpu_only("the Triton decode kernel"):
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        result["decode"] = [bench_decode(h, b, c, copy_bw, num_sms) for b in (1, 32, 128) for c in (1024, 4096, 16384)]
        print(text_table(result["decode"], DECODE_COLUMNS))
    result["prefill"] = [bench_prefill(h, n) for n in prefill_lengths]
    print(text_table(result["prefill"], [c for c in PREFILL_COLUMNS if c in result["prefill"][0]]))
    if not a.no_sweep and study.gpu_only("the tile sweeps"):
        from graphkiln.runtime.attention.triton_backend import DecodeTiles, PrefillTiles

        default = DecodeTiles(**{k: result["decode"][4][k] for k in DecodeTiles.__dataclass_fields__})  # 32 / 4k
        variants = [replace(default, num_splits=s) for s in (1, 2, 3, 4, 8)]
        variants += [replace(default, block_n=n, num_warps=w, num_stages=st) for n, w, st in
                     [(32, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (32, 2, 4)]]
        sweep = fitting(lambda t: bench_decode(h, 32, 4096, copy_bw, num_sms, t), variants)
        sweep += [bench_decode(h, 1, 16384, copy_bw, num_sms, replace(default, num_splits=s)) for s in (8, 16, 64)]
        sweep += [bench_decode(h, 128, 4096, copy_bw, num_sms, replace(default, num_splits=2))]
        result["decode_sweep"] = sweep
        print(text_table(sweep, DECODE_COLUMNS + ["rel_err"]))
        prefill_variants = [PrefillTiles(*t) for t in [(32, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                                                       (128, 128, 8, 2)]]
        result["prefill_sweep"] = [row for tokens in (128, 4096)
                                   for row in fitting(lambda t, n=tokens: bench_prefill(h, n, t), prefill_variants)]
        print(text_table(result["prefill_sweep"], PREFILL_COLUMNS))
    log(f"wrote {study.save(result)}")
    return 0
