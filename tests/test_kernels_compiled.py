"""What the decode kernel compiles to for sm90 (Triton's own ptxas, no GPU): properties of the code that the
interpreter cannot see."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from bench.resources import compiled_for, decode_launches  # noqa: E402
from graphkiln.kernels import decode_attention  # noqa: E402
from graphkiln.runtime.attention.triton_backend import FLAGGED_ROWS  # noqa: E402


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


@pytest.mark.parametrize("rows", [1, FLAGGED_ROWS])
def test_few_rows_merge_their_splits_without_a_fence(rows, monkeypatch):
    """Up to FLAGGED_ROWS rows a split takes its ticket after the PDL wait with a relaxed atomic and publishes its
    partial by relaxed exchanges, so nothing on the way to the merge waits for a fence, and the merging split reads
    the words with volatile loads (a plain load could be hoisted out of its wait); more rows keep the count after
    the partials (acquire-release, which fences)."""
    ptx = _decode_ptx(monkeypatch, "1b", rows)
    after_wait = ptx[ptx.index("griddepcontrol.wait"):]
    assert "atom.global.gpu.relaxed.add" in after_wait
    assert "atom.global.gpu.relaxed.exch" in after_wait
    assert "ld.volatile.global" in after_wait  # the merge's loads of the words, read anew each time round
    assert not re.search(r"acq_rel|fence\.|membar", ptx)
    more = _decode_ptx(monkeypatch, "1b", FLAGGED_ROWS + 1)
    assert "atom.global.gpu.acq_rel.add" in more and "exch" not in more
