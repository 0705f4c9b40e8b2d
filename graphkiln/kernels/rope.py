"""Rotary position embedding of a token's query and key heads, one program per token.

out[t, h] = x[t, h] * cos + rotate_half(x[t, h]) * sin, with cos and sin the table's row at positions[t],
computed in float32 and rounded once to x's dtype (as Inductor's fused kernel for the model's ops computes
it). Inductor's kernel for these ops takes one element a thread over tens of thousands of small programs,
and with programmatic dependent launch each program waits on its own: at a 2048-token prefill chunk that
kernel took several times its bytes' time. Here a program reads its token's table row once and rotates
every head from it, and with PDL (kernels/pdl.py) lets the next kernel launch as soon as it begins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .launch import launch
from .pdl import pdl_on

TILE = 1024  # elements of one half of the heads a loop step rotates


@triton.jit
def _rope_kernel(x_ptr, table_ptr, pos_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_table,
                 HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                 PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    if PDL:  # the next kernel may start once every program has begun
        gdc_launch_dependents()
        gdc_wait()  # x (and positions, in general) come from the kernels before
    dims = tl.arange(0, HALF_PAD)
    lanes = dims < HALF
    row = table_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_table
    cos1 = tl.load(row + dims, mask=lanes, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(row + HALF + dims, mask=lanes, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(row + 2 * HALF + dims, mask=lanes, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(row + 3 * HALF + dims, mask=lanes, other=0.0).to(tl.float32)[None, :]
    for first in tl.static_range(0, HEADS, BLOCK_H):
        heads = first + tl.arange(0, BLOCK_H)
        mask = (heads < HEADS)[:, None] & lanes[None, :]
        src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, (x1 * cos1 - x2 * sin1).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (unit stride along D, D even) rotated by table [P, 2D] (cos then sin, unit stride) at
    positions [T]: a new contiguous [T, H, D] tensor in x's dtype."""
    tokens, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens:
        half = head_dim // 2
        half_pad = triton.next_power_of_2(half)
        launch_pdl = pdl_on(x.device)
        launch(_rope_kernel, (tokens,), x, table, positions, out, x.stride(0), x.stride(1), out.stride(0),
               out.stride(1), table.stride(0), HEADS=heads, HALF=half, HALF_PAD=half_pad,
               BLOCK_H=min(triton.next_power_of_2(heads), max(1, TILE // half_pad)), PDL=launch_pdl, num_warps=4,
               launch_pdl=launch_pdl)
    return out
