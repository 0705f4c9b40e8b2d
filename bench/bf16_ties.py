"""Why bfloat16 greedy tokens may differ between the eager and compiled engines (CPU, about a minute).

    python -m bench bf16-ties [--emulate-precision-casts] [--smoke]

Generates greedily with both engines on the built-in tiny model in bfloat16 and prints, for every
sequence that differs, the reference's gap between its best logit and its logit for the compiled
engine's token at the first difference, next to the share of exact ties among the reference's
top-two logits. tests/greedy_helpers.py states the rule this supports.
"""

from __future__ import annotations

import argparse


def prompts(count: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(count)
    return [torch.randint(3, 4096, (1 + 7 * i,), generator=g).tolist() for i in range(count)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate-precision-casts", action="store_true",
                   help="Inductor rounds intermediates to bfloat16 where eager does")
    p.add_argument("--smoke", action="store_true", help="one batch of three prompts, eight tokens each")


def main(a: argparse.Namespace) -> int:
    from graphkiln import LLM, CompileConfig, SamplingParams

    options = {"emulate_precision_casts": True} if a.emulate_precision_casts else {}
    engine = dict(decode_batch_sizes=(1, 2, 4, 8), kv_cache_tokens=8192)
    compiled = LLM.compile("tiny", CompileConfig(dtype="bfloat16", inductor_options=options), **engine)
    compiled.wait_ready()
    eager = LLM.eager("tiny", dtype="bfloat16", **engine)
    params = SamplingParams(max_tokens=8 if a.smoke else 16, ignore_eos=True)
    total = identical = 0
    for count in (3,) if a.smoke else (3, 5, 8):
        batch = prompts(count)
        want = [o.token_ids for o in eager.generate(batch, params)]
        got = [o.token_ids for o in compiled.generate(batch, params)]
        for prompt, w, g in zip(batch, want, got):
            total += 1
            if w == g:
                identical += 1
                continue
            k = next(i for i, (x, y) in enumerate(zip(w, g)) if x != y)
            logits = eager.score(prompt + w[:-1])[len(prompt) - 1 :]
            top2 = logits.topk(2, dim=-1).values
            ties = (top2[:, 0] == top2[:, 1]).float().mean().item()
            gap = (logits[k].max() - logits[k, g[k]]).item()
            print(f"prompt {len(prompt):3d} tokens: differs at token {k}, reference gap {gap:.4g} "
                  f"(best logit {logits[k].max().item():.4g}); exact top-2 ties in this sequence {ties:.0%}")
    print(f"identical sequences: {identical} / {total}")
    return 0
