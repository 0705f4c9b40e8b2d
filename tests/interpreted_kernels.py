"""Run graphkiln's attention kernels (decode, prefill), quantized products and RMSNorm under Triton's interpreter
(TRITON_INTERPRET=1, set by the caller before Triton is imported) on CPU tensors, and print one JSON line: each
case's relative error against float32 (attention over the cache as the kernel left it; the product of the
dequantized weight); for decode also the new key as stored and whether the split counters were zeros again.

The interpreter runs a grid's programs one after another, so it checks a kernel's arithmetic, masks, split
merge and cache write, not its concurrency or speed. Run by tests/test_kernels_interpreted.py in a fresh
process (a kernel is interpreted or compiled from its decoration on).
"""

from __future__ import annotations

import json
import random

import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interpreter

from graphkiln.kernels.block_decode_attention import block_paged_decode
from graphkiln.kernels.decode_attention import paged_decode
from graphkiln.kernels.fp8_linear import FEW_ROWS, fp8_linear, fp8_mlp, quantize_rows
from graphkiln.kernels.gemv import gemv, silu_mul
from graphkiln.kernels.int4_dp4a import int4_dp4a_gemv, x_words
from graphkiln.kernels.int4_linear import int4_linear
from graphkiln.kernels.int4_words import words
from graphkiln.kernels.int8_linear import int8_linear
from graphkiln.kernels.prefill_attention import paged_prefill
from graphkiln.kernels.rms_norm import add_rms_norm
from graphkiln.kernels.rope import rope
from graphkiln.kernels.split_k import split_counters
from graphkiln.kernels.tma_products import fp8_tma, tma_product
from graphkiln.models.int8_linear import quantize_activations_int8
from graphkiln.models.linear import silu_mul_reference
from graphkiln.models.norm import add_rms_norm_reference
from graphkiln.models.quantized_linear import quantize_activations_fp8
from graphkiln.models.rope import rope_reference
from graphkiln.runtime.attention.triton_backend import prefill_work, work_table
from graphkiln.runtime.kv_dtype import dequantize, quantize
from gpu.kernel_weights import fp8_weight, int4_weight, int8_weight

BLOCK = 16


def _index_any_scalar() -> None:
    """The interpreter holds a loaded scalar as a 1-element array, which `range()` cannot take as an index under
    NumPy 2 (int() of a 1-d array); index it by its one element."""
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _round_to_fp8_as_the_gpu_does() -> None:
    """The interpreter's float8_e4m3 rounding drops the carry of a value rounded up to the next power of two
    (31.4 becomes 16, not 32); round float32 and float16 by torch's conversion instead, which the GPU matches."""
    convert = interpreter._convert_float

    def patched(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16) and rounding_mode is not None:
            rounded = torch.from_numpy(np.ascontiguousarray(values)).to(torch.float8_e4m3fn)
            return rounded.view(torch.uint8).numpy().reshape(values.shape)
        return convert(values, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = patched


def random_cache(hkv: int, d: int, seq_lens: list[int], dtype: torch.dtype, fp8: bool, seed: int):
    """(keys, values, fp8 scales or None, block tables): a paged cache of random rows holding the sequences in
    shuffled blocks (block 0 unused)."""
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 1
    shape = (num_blocks, BLOCK, hkv, d)
    keys, values = torch.randn(shape), torch.randn(shape) * 3
    scales = None
    if fp8:
        (keys, k_scales), (values, v_scales) = quantize(keys), quantize(values)
        scales = (k_scales, v_scales)
    else:
        keys, values = keys.to(dtype), values.to(dtype)
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = torch.zeros(len(seq_lens), max(-(-n // BLOCK) for n in seq_lens), dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        for j in range(-(-n // BLOCK)):
            tables[i, j] = free.pop()
    return keys, values, scales, tables


def stored(keys: torch.Tensor, values: torch.Tensor, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache as the kernels read it, in float32."""
    if scales is None:
        return keys.float(), values.float()
    return dequantize(keys, scales[0], torch.float32), dequantize(values, scales[1], torch.float32)


def context(keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, n: int, group: int):
    """A sequence's first n keys and values [n, Hq, D] (each KV head repeated for its query heads)."""
    rows = [int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
    hkv, d = keys.shape[2:]
    return tuple(x.reshape(-1, hkv, d)[rows].repeat_interleave(group, 1) for x in (keys, values))


def run_decode(kernel: str, dtype: torch.dtype, hq: int, hkv: int, d: int, lens: list[int], splits: int, fp8: bool,
               unsplit_tiles: int = 1, seed: int = 0) -> dict:
    """One decode launch over sequences of `lens` tokens, the last of each the step's new row; the row kernel
    runs a sequence of at most `unsplit_tiles` tiles in one split. "rows-rope": the row kernel given q and k before
    the rotary embedding (strided views of one qk tensor, as the model's projection leaves them), which it applies;
    the reference attends rope_reference's rotation of them, and the new key is stored rotated."""
    torch.manual_seed(seed)
    keys, values, scales, tables = random_cache(hkv, d, lens, dtype, fp8, seed)
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens)])
    q, k = torch.randn(len(lens), hq + hkv, d).to(dtype).split([hq, hkv], dim=1)
    v = torch.randn(len(lens), hkv, d).to(dtype)
    out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype)
    counters = torch.zeros(keys.shape[0] * hkv, dtype=torch.int32)
    args = (q, k, v, keys, values, torch.tensor(lens, dtype=torch.int32), tables, slots, out, d**-0.5, counters)
    rope = None
    if kernel == "rows-rope":
        rope = torch.randn(128, 2 * d), torch.tensor(lens) - 1  # any table: the kernel reads both halves of a row
    if kernel.startswith("rows"):
        paged_decode(*args, num_splits=splits, block_n=32, num_warps=4, num_stages=2, unsplit_tiles=unsplit_tiles,
                     scales=scales, rope=rope)
    else:
        block_paged_decode(*args, num_splits=splits, heads=2, num_warps=4, num_stages=2, scales=scales)
    if rope is not None:
        q, k = rope_reference(q, *rope), rope_reference(k, *rope)
    stored_k, stored_v = stored(keys, values, scales)
    errors = []
    for i, n in enumerate(lens):
        ctx_k, ctx_v = context(stored_k, stored_v, tables[i], n, hq // hkv)
        weights = (torch.einsum("hd,thd->ht", q[i].float(), ctx_k) * d**-0.5).softmax(-1)
        want = torch.einsum("ht,thd->hd", weights, ctx_v)
        errors.append(((out[i].float() - want).norm() / want.norm()).item())
    written = keys.reshape(-1, hkv, d)[slots].float()
    want, want_scale = quantize(k) if fp8 else (k.to(keys.dtype), None)
    scale_error = 0.0
    if fp8:
        scale_error = ((scales[0].reshape(-1, hkv)[slots] - want_scale).abs().max() / want_scale.abs().max()).item()
    return {"error": max(errors), "new_key_equal": (written == want.float()).float().mean().item(),
            "new_key_scale_error": scale_error, "counters_zero": not counters.any().item()}


def run_prefill(dtype: torch.dtype, hq: int, hkv: int, d: int, lens: list[tuple[int, int]], block_m: int,
                fp8: bool, heads: int = 1, seed: int = 0) -> dict:
    """One prefill launch: sequence i's query_len last tokens of its seq_len attend causally over the cache, the
    work table planned as the backend plans it, fewer programs than items (each takes several), `heads` query
    heads a program."""
    torch.manual_seed(seed)
    seq_lens = [s for _, s in lens]
    keys, values, scales, tables = random_cache(hkv, d, seq_lens, dtype, fp8, seed)
    query_lens = [q for q, _ in lens]
    q = torch.randn(sum(query_lens), hq, d).to(dtype)
    out = torch.full_like(q, float("nan"))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    items = work_table(prefill_work(tuple(query_lens), tuple(seq_lens), block_m))
    paged_prefill(q, keys, values, starts, torch.tensor(seq_lens, dtype=torch.int32), tables,
                  torch.tensor(items, dtype=torch.int32), out, d**-0.5, 2, block_m=block_m, block_n=32, num_warps=4,
                  num_stages=2, heads=heads, scales=scales)  # fmt: skip
    stored_k, stored_v = stored(keys, values, scales)
    errors = []
    for i, (q_len, s_len) in enumerate(lens):
        ctx_k, ctx_v = context(stored_k, stored_v, tables[i], s_len, hq // hkv)
        logits = torch.einsum("thd,shd->hts", q[starts[i]:starts[i + 1]].float(), ctx_k) * d**-0.5
        causal = torch.arange(s_len)[None, :] <= (s_len - q_len + torch.arange(q_len))[:, None]
        want = torch.einsum("hts,shd->thd", logits.masked_fill(~causal, float("-inf")).softmax(-1), ctx_v)
        errors.append(((out[starts[i]:starts[i + 1]].float() - want).norm() / want.norm()).item())
    return {"error": max(errors)}


def run_product(kind: str, rows: int, n: int, k: int, seed: int = 0) -> dict:
    """fp8_linear ("fp8-channel", "fp8-block"), the TMA-fed fp8 product on quantized rows ("fp8-tma", "-split"
    with K in three), int8_linear ("w8a8", "w8a8-static", "w8a16", "w8a16-groups": scales per 128 inputs),
    int4_linear ("int4", groups of 128) or the int4 dp4a GEMV ("int4-dp4a", "-g32": groups of 32) of `rows`
    float16 rows, as they dispatch that many, on the GPU tests' weights (gpu/kernel_weights.py), against float32
    products of the dequantized weight and of x as the kernels round it (models/quantized_linear.py): unquantized
    at one row, per 1 x 128 group in registers up to FEW_ROWS, per token (channel scales) or group (block scales)
    by a kernel of its own up to MMA_ROWS; int8's W8A8 rounds x to int8 likewise, per 1 x 128 group in registers
    from 2 to FEW_ROWS rows and per token (or by the static scale) past them; W8A16 and int4 keep x (the dp4a
    GEMV's 16-bit fixed point per group is finer than float16 for all but a group's smallest inputs). "-activated"
    kinds (fp8, int8, and "half" for the float16 GEMV of one row) are silu(gate) * up of the product's halves,
    against that of the float16 product; "-mlp" kinds (fp8) are fp8_mlp, the down product of that activation
    rounded as its row count rounds x; "half-tma" is the TMA-fed kernel on float16 x and weight (tma_product), with
    "-activated" in its epilogue, which must equal the SiLU-and-mul kernel after the plain product (to a unit in the
    last place here, bit for bit on the GPU: tests/gpu/test_fp8_kernels.py)."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(torch.float16)
    activated = kind.endswith("-activated")
    extra: dict = {}
    if kind.startswith("int4"):
        group = 32 if kind.endswith("g32") else 128
        qweight, scales, zeros, reference = int4_weight(n, k, group, "cpu")
        if kind.startswith("int4-dp4a"):
            got = int4_dp4a_gemv(x, words(qweight), scales, zeros, group)
        else:
            got = int4_linear(x, qweight, scales, zeros, group)
        want = x.float() @ reference.t()
    elif kind.startswith("w8"):
        weight, scale, reference = int8_weight(n, k, "cpu", groups=kind.endswith("groups"))
        static = torch.tensor([x.float().abs().max().item() / 127]) if "static" in kind else None
        got = int8_linear(x, weight, scale, static, quantize_input=kind.startswith("w8a8"), activated=activated)
        want = _int8_rounded(x, rows, static) if kind.startswith("w8a8") else x.float()
        want = want @ reference.t()
    elif kind.startswith("fp8-tma"):  # the TMA-fed product on rows quantized per token (-split: K in three)
        weight, scale, reference = fp8_weight(n, k, False, "cpu")
        xq, x_scale = quantize_rows(x)
        tiles = (max(16, 1 << (rows - 1).bit_length()), 64, 256, 3, 4, 4) if kind.endswith("split") else None
        got = fp8_tma(xq, x_scale, weight, scale, torch.float16, tiles)
        want = (xq.float() * x_scale) @ reference.t()
    elif kind.startswith("half"):  # "half-activated": the one-row GEMV; "half-tma": the TMA-fed kernel, no scales
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1)).to(torch.float16) / k**0.5
        if kind.startswith("half-tma"):
            got = tma_product(x, weight, activated=activated)
            extra = {"ulps_from_two_launches": _ulps(got, silu_mul(tma_product(x, weight)))} if activated else {}
        else:
            got = gemv(x, weight, activated=True)
        want = x.float() @ weight.float().t()
    elif kind.endswith("-mlp"):  # N: the MLP's inner width; K: its input's and output's
        block = kind.startswith("fp8-block")
        (gate_up, gate_up_scale, gate_up_ref), (down, down_scale, down_ref) = (
            fp8_weight(2 * n, k, block, "cpu"), fp8_weight(k, n, block, "cpu"))
        got = fp8_mlp(x, gate_up, gate_up_scale, None, down, down_scale)
        rounded = quantize_activations_fp8(x, rows <= FEW_ROWS or block, None)
        h = silu_mul_reference((rounded @ gate_up_ref.t()).to(torch.float16))
        want = quantize_activations_fp8(h, rows <= FEW_ROWS or block, None) @ down_ref.t()
    else:
        block = kind.startswith("fp8-block")
        weight, scale, reference = fp8_weight(n, k, block, "cpu")
        got = fp8_linear(x, weight, scale, activated=activated)
        rounded = x.float() if rows == 1 else quantize_activations_fp8(x, rows <= 16 or block, None)
        want = rounded @ reference.t()
    if activated:
        want = silu_mul_reference(want.to(torch.float16)).float()
    return {"error": ((got.float() - want).norm() / want.norm()).item(),
            "counters_zero": bool((split_counters(torch.device("cpu"), 0) == 0).all()), **extra}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most units in the last place that two float16 tensors differ by anywhere."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()


def _int8_rounded(x: torch.Tensor, rows: int, static: torch.Tensor | None) -> torch.Tensor:
    """x as int8_linear rounds it for W8A8 at `rows` rows: not at one, per 1 x 128 group up to FEW_ROWS, else
    per token or by the static scale."""
    if rows == 1:
        return x.float()
    if rows <= FEW_ROWS:
        return quantize_activations_int8(x.unflatten(-1, (-1, 128)), None).flatten(-2)
    return quantize_activations_int8(x, static)


def run_norm(dtype: torch.dtype, rows: int, width: int, seed: int = 0) -> dict:
    """The residual add and RMSNorm kernel against the model's own ops (add_rms_norm_reference): whether the sums
    are equal, the norm's relative error and the fraction of its outputs equal to the reference's; and whether,
    quantizing, its fp8 rows and scales are quantize_rows' of its output, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, width, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    total, out = add_rms_norm(x, residual, weight, 1e-5)
    want_total, want = add_rms_norm_reference(x, residual, weight, 1e-5)
    *same, q, scale = add_rms_norm(x, residual, weight, 1e-5, quantize=True)
    want_q, want_scale = quantize_rows(out)
    return {"sum_equal": bool(torch.equal(total, want_total)),
            "error": ((out.double() - want.double()).norm() / want.double().norm()).item(),
            "equal": (out == want).float().mean().item(),
            "quantized_as_quantize_rows": bool(all(torch.equal(a, b) for a, b in zip(same, (total, out)))
                                               and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
                                               and torch.equal(scale, want_scale))}


def run_words(width: int, group: int, seed: int = 0) -> dict:
    """The int4 words made by the kernel before the product, against the words kernel's own: of the SiLU-and-mul's
    output, made from the gate/up row (gated), and of the RMSNorm's output, made by the norm; and the dp4a
    product of each, against the product making its own words. Each pair must be equal, bit for bit, and the norm's
    five outputs tensors of their own (the op returning them may not return aliases)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up, x, residual = (torch.randn(1, n, generator=gen).to(torch.float16) for n in (2 * width, width, width))
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(torch.float16)
    qweight, scales, zeros, _ = int4_weight(160, width, group, "cpu")
    product = lambda x, **kw: int4_dp4a_gemv(x, words(qweight), scales, zeros, group, **kw)  # noqa: E731
    *norm, xw, xs, xf = add_rms_norm(x, residual, weight, 1e-5, words_group=group)
    same = lambda a, b: all(torch.equal(u, v) for u, v in zip(a, b))  # noqa: E731
    return {"gated_words": same(x_words(gate_up, group, gated=True), x_words(silu_mul(gate_up), group)),
            "gated_product": same([product(gate_up, gated=True)], [product(silu_mul(gate_up))]),
            "norm_unchanged": same(norm, add_rms_norm(x, residual, weight, 1e-5)),
            "norm_words": same((xw, xs, xf), x_words(norm[1], group)),
            "norm_outputs_apart": len({t.untyped_storage().data_ptr() for t in (*norm, xw, xs, xf)}) == 5,
            "norm_product": same([product(norm[1], words=(xw, xs, xf))], [product(norm[1])])}


def run_rope(dtype: torch.dtype, tokens: int, heads: int, head_dim: int, seed: int = 0) -> dict:
    """The rope kernel on the query and key heads of a qkv product's output (a strided view, as the model passes
    them) at shuffled positions, against rope_reference: relative error and the fraction of outputs equal."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen).to(dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    table = torch.randn(64, 2 * head_dim, generator=gen)  # any table: the kernel reads both halves of each row
    positions = torch.randperm(64, generator=gen)[:tokens]
    got, want = rope(x, table, positions), rope_reference(x, table, positions)
    return {"error": ((got.double() - want.double()).norm() / want.double().norm()).item(),
            "equal": (got == want).float().mean().item(), "contiguous": got.is_contiguous()}


CASES = {  # name: (kernel, query dtype, q heads, kv heads, head_dim, lengths, splits, fp8 cache[, unsplit tiles])
    "rows-gqa4-splits": ("rows", torch.float16, 8, 2, 64, [1, 17, 100, 33], 4, False),
    "rows-one-split": ("rows", torch.float16, 4, 4, 32, [40, 1], 1, False),
    "rows-more-splits-than-tiles": ("rows", torch.float32, 8, 2, 64, [70, 5], 16, False),
    "rows-padded-head": ("rows", torch.float16, 8, 2, 48, [50, 16], 2, False),
    "rows-fp8": ("rows", torch.float16, 8, 2, 64, [90, 1, 32], 4, True),
    "rows-fp8-bf16-query": ("rows", torch.bfloat16, 4, 1, 64, [65], 2, True),
    "rows-many-tiles-a-split": ("rows", torch.float16, 8, 2, 64, [300, 150, 33], 2, False),
    "rows-fp8-many-tiles": ("rows", torch.float16, 4, 2, 64, [230], 1, True),
    "rows-unsplit-short": ("rows", torch.float16, 8, 2, 64, [300, 96, 65, 1], 8, False, 3),  # 5, 1, 1, 1 splits
    "rows-fp8-unsplit-short": ("rows", torch.float16, 8, 2, 64, [200, 64], 16, True, 2),  # 7 splits, 1
    "rows-merge-chunks-odd-group": ("rows", torch.float32, 6, 2, 64, [1000, 40], 32, False),  # merges of 32 splits
    "rows-rope-gqa4-splits": ("rows-rope", torch.float16, 8, 2, 64, [1, 17, 100, 33], 4, False),
    "rows-rope-padded-head-fp8": ("rows-rope", torch.float16, 8, 2, 48, [50, 16], 2, True),
    "rows-rope-fp32": ("rows-rope", torch.float32, 4, 1, 64, [65, 3], 2, False),  # the interpreter rounds bf16 off
    "blocks-gqa4-splits": ("blocks", torch.float16, 8, 2, 64, [1, 17, 100, 33], 4, False),
    "blocks-fp8": ("blocks", torch.float16, 8, 4, 64, [90, 1, 32], 2, True),
    "blocks-merge-chunks-odd-group": ("blocks", torch.float16, 6, 2, 64, [700, 20], 24, False),
}
PREFILL_CASES = {  # name: (query dtype, q heads, kv heads, head_dim, (query_len, seq_len) each, block_m, fp8 cache
    # [, query heads a program])
    "prefill-fresh-and-chunked": (torch.float16, 8, 2, 64, [(16, 16), (20, 50), (1, 33), (40, 40)], 16, False),
    "prefill-padded-head-fp8": (torch.float16, 4, 2, 48, [(17, 17), (9, 70)], 16, True),
    "prefill-group-of-4-a-program": (torch.float16, 8, 2, 64, [(16, 16), (20, 50), (1, 33), (40, 40)], 16, False, 4),
    "prefill-2-heads-a-program-fp8": (torch.float16, 8, 2, 48, [(17, 17), (9, 70)], 16, True, 2),
}
PRODUCT_CASES = {  # name: (kind, rows, N, K); the rows pick each path fp8_linear and int4_linear dispatch
    **{f"{kind}-{rows}-rows": (kind, rows, 200, 384) for kind in ("fp8-channel", "fp8-block") for rows in (1, 8, 24)},
    **{f"int4-{rows}-rows": ("int4", rows, 160, 512) for rows in (1, 8, 48, 80)},
    "int4-dp4a-1-row": ("int4-dp4a", 1, 160, 512),
    "int4-dp4a-1-row-11-groups": ("int4-dp4a", 1, 100, 1408),  # K steps halved to one group, a partial slab
    "int4-dp4a-1-row-g32": ("int4-dp4a-g32", 1, 72, 8192),  # K split in four, groups of 32
    "int4-dp4a-1-row-wide": ("int4-dp4a", 1, 8200, 512),  # past N = 8192 at a short K: 32-row slabs
    **{f"{kind}-activated-{rows}-rows": (f"{kind}-activated", rows, 200, 384) for kind in ("fp8-channel", "fp8-block")
       for rows in (1, 8)},
    "half-activated-1-row": ("half-activated", 1, 200, 384),
    **{f"fp8-tma-{rows}-rows": ("fp8-tma", rows, 200, 1168) for rows in (3, 40)},  # a partial slab and K step
    "fp8-tma-split-40-rows": ("fp8-tma-split", 40, 200, 1424),  # 6 K steps in 3 splits, the last step partial
    **{f"half-tma-{rows}-rows": ("half-tma", rows, 200, 1168) for rows in (3, 40)},  # 16-bit, no scales
    **{f"half-tma-activated-{rows}-rows": ("half-tma-activated", rows, 200, 1168) for rows in (3, 40)},  # 100 wide
    **{f"{kind}-mlp-{rows}-rows": (f"{kind}-mlp", rows, 200, 384) for kind in ("fp8-channel", "fp8-block")
       for rows in (8, 24)},  # 24: the activation applied in the down product's quantization
    **{f"{kind}-{rows}-rows": (kind, rows, 200, 384) for kind in ("w8a8", "w8a16") for rows in (1, 8, 24, 80)},
    **{f"w8a16-groups-{rows}-rows": ("w8a16-groups", rows, 200, 320) for rows in (1, 8, 80)},  # a partial group
    "w8a8-static-80-rows": ("w8a8-static", 80, 200, 384),
    "w8a8-static-24-rows": ("w8a8-static", 24, 200, 384),
    "w8a8-activated-8-rows": ("w8a8-activated", 8, 200, 384),
    "w8a8-80-rows-k-not-8": ("w8a8", 80, 200, 388),  # no torch._int_mm: fp8_mma on the int8 rows
    # K = 4096: every one-row and few-row kernel splits K in 2 to 8, the last split of a tile summing them
    **{f"{kind}-{rows}-rows-k-split": (kind, rows, 200, 4096) for kind in ("fp8-channel", "fp8-block", "w8a8")
       for rows in (1, 8, 24)},
    **{f"int4-{rows}-rows-k-split": ("int4", rows, 160, 4096) for rows in (1, 8, 48)},
    "int4-dp4a-1-row-k-split": ("int4-dp4a", 1, 160, 4096),
}
NORM_CASES = {  # name: (dtype, rows, width); float16: the interpreter does not round to bfloat16 as torch does
    "norm-fp16-3x4096": (torch.float16, 3, 4096),
    "norm-fp16-2x1000": (torch.float16, 2, 1000),  # a width short of its power of two: masked lanes
}

WORDS_CASES = {  # name: (width, group)
    "words-512-g128": (512, 128),
    "words-1408-g128": (1408, 128),  # 11 groups in the norm's 16-group row: the last five not stored
    "words-256-g32": (256, 32),
}

ROPE_CASES = {  # name: (dtype, tokens, heads, head_dim)
    "rope-fp16-40-heads-of-64": (torch.float16, 5, 40, 64),  # heads past one loop step of 32
    "rope-fp32-6-heads-of-80": (torch.float32, 3, 6, 80),  # a half of 40 lanes: masked to 64
    "rope-fp16-3-heads-of-12": (torch.float16, 2, 3, 12),
}

if __name__ == "__main__":
    _index_any_scalar()
    _round_to_fp8_as_the_gpu_does()
    results = {name: run_decode(*case) for name, case in CASES.items()}
    results |= {name: run_prefill(*case) for name, case in PREFILL_CASES.items()}
    results |= {name: run_product(*case) for name, case in PRODUCT_CASES.items()}
    results |= {name: run_norm(*case) for name, case in NORM_CASES.items()}
    results |= {name: run_words(*case) for name, case in WORDS_CASES.items()}
    results |= {name: run_rope(*case) for name, case in ROPE_CASES.items()}
    print(json.dumps(results))
