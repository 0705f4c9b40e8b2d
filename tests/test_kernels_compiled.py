"""What the decode kernel compiles to for sm90 (Triton's own ptxas, no GPU): properties of the code that the
interpreter cannot see."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from bench.resources import compiled_for, decode_launches  # noqa: E402
from graphkiln.kernels import decode_attention  # noqa: E402


def _decode_ptx(monkeypatch: pytest.MonkeyPatch, model: str, rows: int, **launch) -> str:
    """The PTX of the row decode kernel for `rows` rows of an 8192-token table of `model`'s heads, with PDL
    (`launch`: decode_launches' rope and head_dim)."""
    monkeypatch.setattr(decode_attention, "pdl_on", lambda device: True)
    with compiled_for(90) as built:
        decode_launches(model, rows, 8192, **launch)
    [(_, _, kernel)] = built
    return kernel.asm["ptx"]


@pytest.mark.parametrize("head_dim", [128, 80])
def test_rotating_decode_kernel_issues_its_loads_after_the_wait_before_any_barrier(head_dim, monkeypatch):
    """After the PDL wait every global load up to the first tile's dot comes before the first barrier: a load behind
    a layout conversion's barrier would wait for the loads before it, one L2 round trip after another."""
    ptx = _decode_ptx(monkeypatch, "8b", 1, rope=True, head_dim=head_dim)
    after_wait = ptx[ptx.index("griddepcontrol.wait"):]
    to_first_dot = after_wait[:after_wait.index("mma.sync")]
    first_barrier = to_first_dot.index("bar.sync")
    assert re.search(r"ld\.global", to_first_dot[:first_barrier])  # q, k and their halves
    assert not re.search(r"ld\.global", to_first_dot[first_barrier:])


@pytest.mark.parametrize("model,batch", [("8b", 1), ("1b", 8)])
def test_row_decode_kernel_asks_l2_for_its_later_tiles_before_the_wait(model, batch, monkeypatch):
    """Up to PREFETCH_ROWS rows, a split's tiles after the first (its first is loaded before the wait) are asked
    of L2 before the PDL wait and never after it; past that many rows, not at all."""
    for rows, wanted in ((batch, True), (decode_attention.PREFETCH_ROWS + 1, False)):
        ptx = _decode_ptx(monkeypatch, model, rows)
        wait = ptx.index("griddepcontrol.wait")
        assert ("prefetch.global.L2" in ptx[:wait]) is wanted
        assert "prefetch.global.L2" not in ptx[wait:]
