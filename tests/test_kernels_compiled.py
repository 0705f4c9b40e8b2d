"""What the decode kernel compiles to for sm90 (Triton's own ptxas, no GPU): properties of the code that the
interpreter cannot see."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from bench.resources import compiled_for, decode_launches  # noqa: E402
from graphkiln.kernels import decode_attention  # noqa: E402


def _rotating_decode_ptx(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """The PTX of the row decode kernel at one row of an 8192-token table (the 8B-like model's heads), with PDL,
    rotating q and k itself."""
    monkeypatch.setattr(decode_attention, "pdl_on", lambda device: True)
    with compiled_for(90) as built:
        decode_launches("8b", 1, 8192, rope=True, head_dim=head_dim)
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
