"""What the decode kernel compiles to for sm90 (Triton's own ptxas, no GPU): properties of the code that the
interpreter cannot see."""

from __future__ import annotations

import re
from dataclasses import asdict

import pytest
import torch

pytest.importorskip("triton")

from bench.resources import compiled_for  # noqa: E402
from graphkiln.kernels import decode_attention  # noqa: E402
from graphkiln.runtime.attention.triton_backend import decode_tiles, padded_head_dim  # noqa: E402


def _rotating_decode_ptx(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """The PTX of the row decode kernel at one row of an 8192-token table, with PDL, rotating q and k itself."""
    monkeypatch.setattr(decode_attention, "pdl_on", lambda device: True)
    heads, kv_heads, block, context = 32, 8, 16, 8192
    tiles = decode_tiles(1, kv_heads, context, padded_head_dim(head_dim), 2, 132)
    blocks = context // block
    q = torch.zeros(1, heads, head_dim, dtype=torch.bfloat16)
    k = torch.zeros(1, kv_heads, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(blocks, block, kv_heads, head_dim, dtype=torch.bfloat16)
    with compiled_for(90) as built:
        decode_attention.paged_decode(
            q, k, k.clone(), cache, cache.clone(), torch.full((1,), 200, dtype=torch.int32),
            torch.arange(blocks, dtype=torch.int32).view(1, -1), torch.zeros(1, dtype=torch.int64), torch.empty_like(q),
            head_dim ** -0.5, torch.zeros(kv_heads, dtype=torch.int32),
            rope=(torch.zeros(context, 2 * head_dim), torch.zeros(1, dtype=torch.int64)), **asdict(tiles))
    [(_, _, kernel)] = built
    return kernel.asm["ptx"]


@pytest.mark.parametrize("head_dim", [128, 80])
def test_rotating_decode_kernel_issues_its_loads_after_the_wait_before_any_barrier(head_dim, monkeypatch):
    """After the PDL wait every global load up to the first tile's dot comes before the first barrier: a load behind
    a layout conversion's barrier would wait for the loads before it, one L2 round trip after another."""
    ptx = _rotating_decode_ptx(head_dim, monkeypatch)
    after_wait = ptx[ptx.index("griddepcontrol.wait"):]
    to_first_dot = after_wait[:after_wait.index("mma.sync")]
    first_barrier = to_first_dot.index("bar.sync")
    assert re.search(r"ld\.global", to_first_dot[:first_barrier])  # q, k and their halves
    assert not re.search(r"ld\.global", to_first_dot[first_barrier:])
