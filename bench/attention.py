"""The Triton attention kernels on one GPU: paged decode against the copy rate, prefill against torch
SDPA's flash kernel, and tile sweeps (a few minutes).

    python -m bench attention --out $OUT [--no-sweep]

Decode: the 8B-like heads (32 query, 8 KV, head_dim 128, bf16) at batch 1/32/128 and context
1k/4k/16k, every sequence at full context in shuffled 16-token blocks; bandwidth counts the K and
V bytes read, against a device-to-device copy of 1 GiB (bytes read and written); each launch is
replayed from a CUDA graph and timed from a cold L2. The decode plans follow the block tables'
width, the context's unless `--table-tokens` widens them as an engine's max_seq_len does. Prefill:
one causal sequence of 128, 1024 and 4096 tokens, timed in a CUDA graph as the engine replays it
(a 128-token call takes microseconds), against SDPA's flash kernel. The sweeps: decode tiles at
batch 32 / 4k (and splits at 1 / 16k, 128 / 4k) and prefill tiles at 128 and 4096 tokens, each
checked against float32 attention. On the CPU (--smoke,
smoke heads and lengths) the caches, the planning and SDPA run; the Triton kernels need CUDA.

    python -m bench attention --model 1b --decode-ab 1x16,1x2000,16x4000,64x2000,128x1000 --out $OUT

`--decode-ab`: the two decode kernels side by side at each BATCHxCONTEXT shape, each at its plan
(the row kernel, `decode_kernel="rows"`, and the block kernel, `"blocks"`), then the block kernel
at other tilings (BLOCK_TILES) and split counts; every row checked against float32. One line per
shape ("A/B ...") gives both plans' times and shares of the copy rate, and the best block tiling.
`--serving-sweep` times the row kernel at every split count of `--splits` and tiling of SERVING_TILES,
then the block kernel's plan and tilings.

    python -m bench attention --model 1b --decode-ab 16x4000,64x2000 --kv-cache-dtype fp8_e4m3 --out $OUT

`--kv-cache-dtype fp8_e4m3`: the caches in fp8 with a float32 scale per token and KV head (what the
engine's option stores); bandwidth counts one byte an element and the scales, the float32
reference reads the dequantized cache.

    python -m bench attention --model 1b --prefill-sweep 4096,16384 --out $OUT

`--prefill-sweep`: one causal prompt of each length through the prefill kernel at its plan and at every
tiling of PREFILL_TILES, against SDPA's flash kernel, and nothing else.

    python -m bench attention --model 1b --latency 1x200,1x2000 --table-tokens 8192 --out $OUT

`--latency`: where a short decode launch's time goes. The row kernel at its plan, at each `--unsplit-tiles`
(contexts of at most that many tiles run in one split) and unsplit, each timed three ways from its CUDA
graph: from a cold L2 (as everywhere here), with its inputs read into L2 just before, and warm (the launch
before it read the same); beside a one-element launch timed cold, the cost of a replay itself. A sleep
queued ahead of every sample keeps the replay's launch out of the time.
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
AB_COLUMNS = ["kernel", "batch", "context", "num_splits", "block_n", "heads", "num_warps", "num_stages",
              "unsplit_tiles", "us", "pct_copy", "rel_err"]
BLOCK_TILES = [(2, 4, 5), (2, 8, 5), (4, 4, 7), (8, 4, 5), (8, 8, 5)]  # block kernel: heads, warps, stages
PREFILL_COLUMNS = ["tokens", "block_m", "block_n", "num_warps", "num_stages", "heads", "max_registers", "us", "tflops",
                   "sdpa_us", "sdpa_tflops", "rel_err_vs_sdpa"]


class Heads:
    """Query heads, KV heads and head size of the model, and where the tensors live."""

    def __init__(self, study: Study) -> None:
        shape = shape_of(study.model)
        self.hq, self.hkv, self.d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
        self.device, self.dtype = study.device, study.dtype
        self.block, self.head_major, self.fp8 = BLOCK, False, False
        self.table_tokens = 0  # block tables this wide at least (an engine's are max_seq_len wide)

    def paged_cache(self, num_seqs: int, context: int):
        """K/V caches holding num_seqs sequences of `context` tokens in shuffled blocks; lengths; block tables;
        the fp8 caches' (key, value) row scales, or None."""
        import torch

        per_seq = -(-context // self.block)
        if self.head_major:  # [blocks, heads, block, dim] in memory, seen as [blocks, block, heads, dim]
            shape = (num_seqs * per_seq + 1, self.hkv, self.block, self.d)
            k_cache, v_cache = (torch.randn(shape, dtype=self.dtype, device=self.device).transpose(1, 2)
                                for _ in range(2))
        else:
            shape = (num_seqs * per_seq + 1, self.block, self.hkv, self.d)
            k_cache, v_cache = (torch.randn(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        scales = None
        if self.fp8:
            from graphkiln.runtime.kv_dtype import quantize

            (k_cache, k_scales), (v_cache, v_scales) = quantize(k_cache), quantize(v_cache)
            scales = (k_scales, v_scales)
        tables = (torch.randperm(num_seqs * per_seq, device=self.device) + 1).view(num_seqs, per_seq).int()
        width = -(-self.table_tokens // self.block)
        if width > per_seq:  # columns past the context: block 0, which no sequence holds
            tables = torch.nn.functional.pad(tables, (0, width - per_seq))
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=self.device)
        return k_cache, v_cache, seq_lens, tables, scales

    def gathered(self, cache, row_scales, table, tokens: int):
        """[tokens, hq, d] of one sequence's cache rows (dequantized by their `row_scales` where fp8), the KV
        heads repeated for their query heads."""
        rows = cache[table.long()].flatten(0, 1)[:tokens].float()
        if row_scales is not None:
            rows = rows * row_scales[table.long()].flatten(0, 1)[:tokens, :, None]
        return rows.repeat_interleave(self.hq // self.hkv, 1)

    def row_bytes(self, cache) -> int:
        """Bytes read per cached row of one KV head: its elements and, for fp8, its float32 scale."""
        return self.d * cache.element_size() + (4 if self.fp8 else 0)


def decode_inputs(h: Heads, num_seqs: int, context: int) -> tuple[tuple, tuple | None]:
    """The arguments of a decode launch over `num_seqs` sequences of `context` tokens, as paged_decode takes
    them (q, k, v, caches, lengths, tables, slots, out, scale, counters), and the fp8 caches' row scales."""
    import torch

    k_cache, v_cache, seq_lens, tables, scales = h.paged_cache(num_seqs, context)
    q = torch.randn(num_seqs, h.hq, h.d, dtype=h.dtype, device=h.device)
    last = context - 1  # the step's new key and value: rewritten in place with what the slot holds already
    slots = (tables[:, last // h.block].long() * h.block + last % h.block).contiguous()
    at = (slots // h.block, slots % h.block)
    k, v = k_cache[at], v_cache[at]
    if scales:  # the step's key and value come in the model's dtype: the stored rows dequantized
        k_scales, v_scales = scales
        k, v = (k.float() * k_scales[at][..., None]).to(h.dtype), (v.float() * v_scales[at][..., None]).to(h.dtype)
    counters = torch.zeros(num_seqs * h.hkv, dtype=torch.int32, device=h.device)
    return (q, k, v, k_cache, v_cache, seq_lens, tables, slots, torch.empty_like(q), h.d**-0.5, counters), scales


def bench_decode(h: Heads, num_seqs: int, context: int, copy_bw: float, num_sms: int, tiles=None, kernel: str = "rows",
                 check: bool = False) -> dict:
    """One decode launch of `kernel` ("rows" or "blocks"), replayed from a CUDA graph as the engine runs it (so
    Python's launch cost stays out) and timed from a cold L2; explicit (swept) tiles, or `check`, are also
    checked against float32."""
    import torch

    args, scales = decode_inputs(h, num_seqs, context)
    q, _, _, k_cache, v_cache, _, tables, _, out = args[:9]
    k_scales, v_scales = scales or (None, None)
    planned, make_call = decode_kernel(h, kernel, num_seqs, tables.shape[1] * h.block, k_cache, num_sms)
    chosen = asdict(tiles or planned)
    call = make_call(args, chosen, scales)
    timing = time_ms(in_graph(call, h.device), h.device, reps=50, before=lambda: flush_l2(h.device))
    bw = 2 * num_seqs * context * h.hkv * h.row_bytes(k_cache) / (timing.median_ms * 1e-3)
    row = dict(kernel=kernel, batch=num_seqs, context=context, **chosen, us=timing.us, gbs=bw / 1e9,
               pct_copy=100 * bw / copy_bw)
    if tiles or check:
        scores = torch.stack([torch.einsum("hd,lhd->hl", q[i].float(), h.gathered(k_cache, k_scales, tables[i], context))
                              for i in range(num_seqs)]) * h.d**-0.5
        values = torch.stack([h.gathered(v_cache, v_scales, tables[i], context) for i in range(num_seqs)])
        want = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values)
        row["rel_err"] = ((out.float() - want).norm() / want.norm()).item()
    return row


def decode_kernel(h: Heads, kernel: str, num_seqs: int, max_context: int, k_cache, num_sms: int):
    """(the planned tiles, make_call(args, tiles, scales) -> the timed call) of a decode kernel, planned as the
    Triton backend plans it; the block kernel's cache descriptors are built in make_call, outside the timed
    call, as a captured graph keeps them."""
    from graphkiln.runtime.attention.triton_backend import decode_tiles, padded_head_dim

    if kernel == "rows":
        from graphkiln.kernels.decode_attention import paged_decode

        def make_rows_call(args: tuple, tiles: dict, scales):
            return lambda: paged_decode(*args, **tiles, scales=scales)

        return decode_tiles(num_seqs, h.hkv, max_context, h.d, k_cache.element_size(), num_sms), make_rows_call
    from graphkiln.kernels.block_decode_attention import block_paged_decode, cache_descriptor
    from graphkiln.runtime.attention.block_decode import block_decode_tiles, lane_bytes

    def make_blocks_call(args: tuple, tiles: dict, scales):
        descriptors = tuple(cache_descriptor(cache, tiles["heads"]) for cache in args[3:5])
        return lambda: block_paged_decode(*args, **tiles, descriptors=descriptors, scales=scales)

    planned = block_decode_tiles(num_seqs, h.hkv, max_context, h.block, padded_head_dim(h.d), lane_bytes(k_cache.dtype),
                                 num_sms)
    return planned, make_blocks_call


def bench_prefill(h: Heads, tokens: int, tiles=None) -> dict:
    """One causal prefill in a CUDA graph (the Triton kernel on the GPU) and SDPA's, checked against each other."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from graphkiln.runtime.attention.triton_backend import prefill_tiles, prefill_work, work_table

    k_cache, v_cache, seq_lens, tables, scales = h.paged_cache(1, tokens)
    k_scales, v_scales = scales or (None, None)
    tiles = tiles or prefill_tiles(tokens, h.d, k_cache.element_size())
    q = torch.randn(tokens, h.hq, h.d, dtype=h.dtype, device=h.device)
    query, keys, values = (t.transpose(0, 1)[None].to(h.dtype).contiguous()  # [1, hq, tokens, d]
                           for t in (q, h.gathered(k_cache, k_scales, tables[0], tokens),
                                     h.gathered(v_cache, v_scales, tables[0], tokens)))
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
                                                len(items), scales=scales, **asdict(tiles)), h.device)
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
    p.add_argument("--splits", default="1,2,4,8,16,32,64",
                   help="split counts --serving-sweep tries at each tiling (comma list)")
    p.add_argument("--unsplit-tiles", default="",
                   help="tile counts up to which a context runs unsplit (comma list): --serving-sweep and "
                        "--latency try each with the plan's grid")
    p.add_argument("--decode-ab", default="",
                   help="BATCHxCONTEXT list: both decode kernels (rows, blocks) at each of these shapes only")
    p.add_argument("--latency", default="",
                   help="BATCHxCONTEXT list: the row kernel's plan and one split timed cold, inputs in L2 and warm")
    p.add_argument("--prefill-sweep", default="",
                   help="prompt lengths (comma list): the prefill kernel's plan and PREFILL_TILES at each only")
    p.add_argument("--table-tokens", type=int, default=0,
                   help="block tables this many tokens wide at least, as an engine's are max_seq_len wide: the "
                        "decode plans follow the width (default: the context)")
    p.add_argument("--block-size", type=int, default=BLOCK, help=f"KV cache block size (default {BLOCK})")
    p.add_argument("--head-major", action="store_true",
                   help="cache blocks laid out [heads, block, dim] (each head's rows contiguous)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                   help="the caches in the model's dtype (auto) or in fp8 with a scale per token and KV head")


SERVING_TILES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 2),
                 (128, 8, 3), (16, 2, 4), (32, 2, 4)]  # (block_n, num_warps, num_stages)
SHOWN = 8  # the serving sweep's fastest row tilings a shape in the printed table (the results keep all)


def serving_sweep(h: Heads, shapes: str, copy_bw: float, num_sms: int, splits: tuple[int, ...],
                  unsplit_tiles: tuple[int, ...]) -> list[dict]:
    """Every split count of `splits` at every tiling of SERVING_TILES at each BATCHxCONTEXT shape, and the plan at
    each of `unsplit_tiles`; the planned one first, the rest ranked fastest first (the table shows
    the first SHOWN); then the block kernel's plan and tilings."""
    from graphkiln.runtime.attention.triton_backend import DecodeTiles

    rows = []
    for batch, context in parse_shapes(shapes):
        planned = bench_decode(h, batch, context, copy_bw, num_sms)
        rows.append(dict(planned, planned=True))
        plan = DecodeTiles(**{k: planned[k] for k in DecodeTiles.__dataclass_fields__})
        variants = [DecodeTiles(s, n, w, st, plan.unsplit_tiles) for s in splits for n, w, st in SERVING_TILES
                    if s * 32 <= context]  # splits down to 32 tokens: a lone sequence's latency, below the plan's floor
        variants += [replace(plan, unsplit_tiles=m) for m in unsplit_tiles if m != plan.unsplit_tiles]
        best = fitting(lambda t, b=batch, c=context: bench_decode(h, b, c, copy_bw, num_sms, t), variants)
        best.sort(key=lambda r: r["us"])
        rows += [dict(r, rank=i) for i, r in enumerate(best, 1)]
        log(f"{batch}x{context}: planned {planned['us']:.1f} us ({planned['pct_copy']:.0f}% copy), "
            f"best {best[0] if best else 'the plan (no other split fits the context)'}")
        if not h.head_major:  # the block kernel reads the block-major layout only
            rows += block_sweep(h, batch, context, copy_bw, num_sms)
    return rows


PREFILL_TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2),
                 (16, 64, 4, 2, 4), (16, 128, 4, 2, 4), (64, 64, 4, 2, 1, 128), (128, 64, 8, 2, 1, 128),
                 (128, 64, 8, 3, 1, 128)]
# (block_m, block_n, num_warps, num_stages[, query heads a program[, registers a thread]]); the heads divide the
# models' groups of 4; a register cap lets a multiprocessor hold one program more


def prefill_sweep(h: Heads, lengths: list[int]) -> list[dict]:
    """The prefill kernel at every tiling of PREFILL_TILES that fits, at each prompt length."""
    from graphkiln.runtime.attention.triton_backend import PrefillTiles

    variants = [PrefillTiles(*t) for t in PREFILL_TILES]
    return [row for tokens in lengths for row in fitting(lambda t, n=tokens: bench_prefill(h, n, t), variants)]


def parse_shapes(shapes: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.lower().split("x")) for item in filter(None, shapes.split(","))]


def block_sweep(h: Heads, batch: int, context: int, copy_bw: float, num_sms: int) -> list[dict]:
    """The block kernel at its plan, then at BLOCK_TILES and at half and twice the planned splits, fastest first."""
    from graphkiln.runtime.attention.block_decode import BlockDecodeTiles

    planned = bench_decode(h, batch, context, copy_bw, num_sms, kernel="blocks", check=True)
    plan = BlockDecodeTiles(**{k: planned[k] for k in BlockDecodeTiles.__dataclass_fields__})
    variants = [replace(plan, heads=n, num_warps=w, num_stages=st) for n, w, st in BLOCK_TILES if n <= h.hkv]
    variants += [replace(plan, num_splits=s) for s in (max(1, plan.num_splits // 2), min(64, 2 * plan.num_splits))]
    variants = [v for v in dict.fromkeys(variants) if v != plan]
    swept = fitting(lambda t: bench_decode(h, batch, context, copy_bw, num_sms, t, kernel="blocks"), variants)
    return [dict(planned, planned=True)] + sorted(swept, key=lambda r: r["us"])


def decode_ab(h: Heads, shapes: str, copy_bw: float, num_sms: int) -> list[dict]:
    """Both decode kernels at their plans at each shape, then the block kernel's tilings; one A/B line a shape."""
    rows = []
    for batch, context in parse_shapes(shapes):
        row_plan = dict(bench_decode(h, batch, context, copy_bw, num_sms, check=True), planned=True)
        blocks = block_sweep(h, batch, context, copy_bw, num_sms)
        best = min(blocks, key=lambda r: r["us"])
        log(f"A/B {batch}x{context} (heads {h.hq}/{h.hkv}, D {h.d}{', fp8 cache' if h.fp8 else ''}): rows {row_plan['us']:.1f} us "
            f"({row_plan['pct_copy']:.0f}% copy) | blocks {blocks[0]['us']:.1f} us ({blocks[0]['pct_copy']:.0f}% copy) "
            f"| best blocks {best['us']:.1f} us ({best['pct_copy']:.0f}%) splits {best['num_splits']} heads "
            f"{best['heads']} warps {best['num_warps']} stages {best['num_stages']} | rows/blocks "
            f"{row_plan['us'] / blocks[0]['us']:.2f}x")
        rows += [row_plan, *blocks]
    return rows


def main(a: argparse.Namespace) -> int:
    import torch

    study = Study.of("attention", a)
    h = Heads(study)
    h.block, h.head_major, h.fp8 = a.block_size, a.head_major, a.kv_cache_dtype == "fp8_e4m3"
    h.table_tokens = a.table_tokens
    if h.fp8 and h.head_major:
        raise SystemExit("--kv-cache-dtype fp8_e4m3 stores the block-major layout only; drop --head-major")
    copy_bw = copy_rate(study.device, (64 << 20) if study.smoke else (1 << 30))
    result: dict = {"heads": [h.hq, h.hkv, h.d], "copy_gbs": copy_bw / 1e9, "kv_cache_dtype": a.kv_cache_dtype}
    cache = "-fp8" if h.fp8 else ""
    log(f"device-to-device copy {copy_bw / 1e9:.0f} GB/s; heads {h.hq} query, {h.hkv} KV, head_dim {h.d}")
    prefill_lengths = (16, 48) if study.smoke else (128, 1024, 4096)
    unsplit_tiles = tuple(int(x) for x in a.unsplit_tiles.split(",") if x.strip())
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if study.cuda else 1

    def report(key: str, rows: list[dict], columns: list[str], suffix: str, shown: list[dict] | None = None) -> int:
        result[key] = rows
        print(text_table(rows if shown is None else shown, columns))
        log(f"wrote {study.save(result, suffix)}")
        return 0

    if a.decode_ab and study.gpu_only("the decode A/B"):
        return report("decode_ab", decode_ab(h, a.decode_ab, copy_bw, num_sms), AB_COLUMNS,
                      f"decode-ab-{study.model}{cache}")
    if a.latency and study.gpu_only("the decode latency study"):
        from .latency import LATENCY_COLUMNS, decode_latency

        return report("latency", decode_latency(h, a.latency, num_sms, unsplit_tiles), LATENCY_COLUMNS,
                      f"latency-{study.model}{cache}")
    if a.prefill_sweep and study.gpu_only("the prefill sweep"):
        lengths = [int(n) for n in a.prefill_sweep.split(",") if n.strip()]
        result["prefill"] = [bench_prefill(h, n) for n in lengths]  # the plans
        sweep = prefill_sweep(h, lengths)
        return report("prefill_sweep", sweep, PREFILL_COLUMNS, f"prefill-sweep-{study.model}{cache}",
                      shown=result["prefill"] + sweep)
    if a.serving_sweep and study.gpu_only("the serving sweep"):
        splits = tuple(int(x) for x in a.splits.split(",") if x.strip())
        rows = serving_sweep(h, a.serving_sweep, copy_bw, num_sms, splits, unsplit_tiles)
        layout = f"{'hnd' if h.head_major else 'nhd'}{h.block}"
        return report("serving_sweep", rows, AB_COLUMNS, f"serving-{study.model}-{layout}{cache}",
                      shown=[r for r in rows if r.get("rank", 0) <= SHOWN])
    if study.gpu_only("the Triton decode kernel"):
        result["decode"] = [bench_decode(h, b, c, copy_bw, num_sms) for b in (1, 32, 128) for c in (1024, 4096, 16384)]
        print(text_table(result["decode"], DECODE_COLUMNS))
    result["prefill"] = [bench_prefill(h, n) for n in prefill_lengths]
    print(text_table(result["prefill"], [c for c in PREFILL_COLUMNS if c in result["prefill"][0]]))
    if not a.no_sweep and study.gpu_only("the tile sweeps"):
        from graphkiln.runtime.attention.triton_backend import DecodeTiles

        default = DecodeTiles(**{k: result["decode"][4][k] for k in DecodeTiles.__dataclass_fields__})  # 32 / 4k
        variants = [replace(default, num_splits=s) for s in (1, 2, 3, 4, 8)]
        variants += [replace(default, block_n=n, num_warps=w, num_stages=st) for n, w, st in
                     [(32, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (32, 2, 4)]]
        sweep = fitting(lambda t: bench_decode(h, 32, 4096, copy_bw, num_sms, t), variants)
        sweep += [bench_decode(h, 1, 16384, copy_bw, num_sms, replace(default, num_splits=s)) for s in (8, 16, 64)]
        sweep += [bench_decode(h, 128, 4096, copy_bw, num_sms, replace(default, num_splits=2))]
        result["decode_sweep"] = sweep
        print(text_table(sweep, DECODE_COLUMNS + ["rel_err"]))
        result["prefill_sweep"] = prefill_sweep(h, [128, 4096])
        print(text_table(result["prefill_sweep"], PREFILL_COLUMNS))
    log(f"wrote {study.save(result, cache.lstrip('-'))}")
    return 0
