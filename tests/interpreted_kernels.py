"""Run graphkiln's decode attention kernels under Triton's interpreter (TRITON_INTERPRET=1, set by the caller
before Triton is imported) on CPU tensors, and print one JSON line: each case's relative error against float32
attention over the cache as the kernel left it, and whether its split counters were zeros again.

The interpreter runs a grid's programs one after another, so it checks a kernel's arithmetic, masks, split
merge and cache write, not its concurrency or speed. Run by tests/test_kernels_interpreted.py in a fresh
process (a kernel is interpreted or compiled from its decoration on).
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import torch
import triton.runtime.interpreter as interpreter

from graphkiln.kernels.block_decode_attention import block_paged_decode
from graphkiln.kernels.decode_attention import paged_decode
from graphkiln.runtime.kv_dtype import dequantize, quantize

BLOCK = 16
FP8 = torch.float8_e4m3fn


def _index_any_scalar() -> None:
    """The interpreter holds a loaded scalar as a 1-element array, which `range()` cannot take as an index under
    NumPy 2 (int() of a 1-d array); index it by its one element."""
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def run_case(kernel: str, dtype: torch.dtype, hq: int, hkv: int, d: int, lens: list[int], splits: int, fp8: bool,
             seed: int = 0) -> dict:
    """One decode launch over sequences of `lens` tokens (the last of each the step's new row) in shuffled
    blocks of a cache of random rows."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 1
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
    tables = torch.zeros(len(lens), max(-(-n // BLOCK) for n in lens), dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // BLOCK)):
            tables[i, j] = free.pop()
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens)])
    q = torch.randn(len(lens), hq, d).to(dtype)
    k, v = torch.randn(len(lens), hkv, d).to(dtype), torch.randn(len(lens), hkv, d).to(dtype)
    out = torch.full_like(q, float("nan"))
    counters = torch.zeros(num_blocks * hkv, dtype=torch.int32)
    args = (q, k, v, keys, values, torch.tensor(lens, dtype=torch.int32), tables, slots, out, d**-0.5, counters)
    if kernel == "rows":
        paged_decode(*args, num_splits=splits, block_n=32, num_warps=4, num_stages=2, scales=scales)
    else:
        block_paged_decode(*args, num_splits=splits, heads=2, num_warps=4, num_stages=2, scales=scales)
    stored_k = dequantize(keys, scales[0], torch.float32) if fp8 else keys.float()
    stored_v = dequantize(values, scales[1], torch.float32) if fp8 else values.float()
    errors = []
    for i, n in enumerate(lens):
        rows = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
        ctx_k = stored_k.reshape(-1, hkv, d)[rows].repeat_interleave(hq // hkv, 1)
        ctx_v = stored_v.reshape(-1, hkv, d)[rows].repeat_interleave(hq // hkv, 1)
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


CASES = {  # name: (kernel, query dtype, q heads, kv heads, head_dim, lengths, splits, fp8 cache)
    "rows-gqa4-splits": ("rows", torch.float16, 8, 2, 64, [1, 17, 100, 33], 4, False),
    "rows-one-split": ("rows", torch.float16, 4, 4, 32, [40, 1], 1, False),
    "rows-more-splits-than-tiles": ("rows", torch.float32, 8, 2, 64, [70, 5], 16, False),
    "rows-padded-head": ("rows", torch.float16, 8, 2, 48, [50, 16], 2, False),
    "rows-fp8": ("rows", torch.float16, 8, 2, 64, [90, 1, 32], 4, True),
    "rows-fp8-bf16-query": ("rows", torch.bfloat16, 4, 1, 64, [65], 2, True),
    "blocks-gqa4-splits": ("blocks", torch.float16, 8, 2, 64, [1, 17, 100, 33], 4, False),
    "blocks-fp8": ("blocks", torch.float16, 8, 4, 64, [90, 1, 32], 2, True),
}

if __name__ == "__main__":
    _index_any_scalar()
    names = sys.argv[1:] or list(CASES)
    print(json.dumps({name: run_case(*CASES[name]) for name in names}))
