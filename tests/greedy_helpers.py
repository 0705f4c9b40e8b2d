"""Greedy agreement in low precision: identical tokens, except where the reference itself is tied.

bfloat16 logits carry 8 significant bits: on the random-weight tiny model some positions have
their top two logits exactly equal (6% of a 16-token sequence in places) and more are one or two
ulps apart, so any change in summation order (a fused kernel, another GEMM algorithm) may pick
the other token there. `python -m bench bf16-ties` prints each such divergence and its gap. The rule: the candidate's
tokens equal the reference's until the first position where they differ; there, the reference's
own logit for the candidate's token must be within `ulps` bfloat16 ulps of its best logit (or within
`tolerance`, where the two paths differ by design by more: a measured bound). The comparison stops at that
position, since both continuations are then legitimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def bf16_ulp(value: float) -> float:
    """Spacing of bfloat16 numbers near `value` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - 7)


def first_divergence(want: Sequence[int], got: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:
            return i
    return None


def assert_greedy_agrees(reference, prompts: Sequence[Sequence[int]], want: Sequence[Sequence[int]],
                         got: Sequence[Sequence[int]], ulps: int = 2, tolerance: float = 0.0) -> int:
    """Check `got` against the reference LLM's greedy `want`; return how many sequences match exactly. A
    divergence passes within max(`ulps` bfloat16 ulps of the best logit, `tolerance`)."""
    exact = 0
    for prompt, w, g in zip(prompts, want, got, strict=True):
        k = first_divergence(w, g)
        if k is None:
            exact += 1
            continue
        logits = reference.score(list(prompt) + list(w[:k]))[-1]
        best = logits.max().item()
        margin = best - logits[g[k]].item()
        bound = max(ulps * bf16_ulp(best), tolerance)
        assert margin <= bound, (
            f"prompt of {len(prompt)} tokens: token {k} is {g[k]}, reference {w[k]}; the reference scores it "
            f"{margin:.4g} below its best logit {best:.4g}, more than {bound:.4g} ({ulps} bfloat16 ulps or the "
            f"tolerance {tolerance:.4g}): not a near-tie"
        )
    return exact
