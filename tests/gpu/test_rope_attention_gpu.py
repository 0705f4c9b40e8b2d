"""rope_attention on CUDA: the row decode kernel rotating q and the new key itself against the rope kernel and
then the kernel, and the tiny model compiled with the pass against the same model without it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from graphkiln import CompileConfig  # noqa: E402
from graphkiln.compiler.compile import compile_module  # noqa: E402
from graphkiln.kernels.decode_attention import paged_decode  # noqa: E402
from graphkiln.llm import resolve_model_dir  # noqa: E402
from graphkiln.models import load_model  # noqa: E402
from graphkiln.models.rope import rope  # noqa: E402
from graphkiln.models.tokenizer import Tokenizer  # noqa: E402
from graphkiln.runtime.kv_dtype import FP8  # noqa: E402
from tiny_engines import assert_compiled_agrees, engines  # noqa: E402

BLOCK = 16


def _decode(heads: tuple, lens: list[int], splits: int, fp8: bool, fused: bool) -> tuple[torch.Tensor, ...]:
    """One decode launch on a fresh random cache (the same for both ways): the kernel given q and k before rope
    (`fused`), or the rope kernel's rotation of them; (out, the cache's keys, the slots this step's keys went to)."""
    dtype, hq, hkv, d = heads
    gen = torch.Generator(device="cuda").manual_seed(len(lens) * d)
    blocks = [-(-n // BLOCK) for n in lens]
    keys, values = (torch.randn(sum(blocks) + 1, BLOCK, hkv, d, device="cuda", generator=gen).to(dtype)
                    for _ in range(2))
    scales = None
    if fp8:
        keys, values = keys.to(FP8), values.to(FP8)
        scales = tuple(torch.rand(sum(blocks) + 1, BLOCK, hkv, device="cuda", generator=gen) + 0.5 for _ in range(2))
    width = max(blocks)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    first = 1
    for i, b in enumerate(blocks):
        table[i, :b] = torch.arange(first, first + b, device="cuda")
        first += b
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    slots = torch.stack([table[i, (n - 1) // BLOCK].long() * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens)])
    qk = torch.randn(len(lens), hq + hkv, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(len(lens), hkv, d, device="cuda", generator=gen).to(dtype)
    rope_table = torch.randn(4096, 2 * d, device="cuda", generator=gen)
    positions = (seq_lens - 1).long()
    if not fused:
        qk = rope(qk, rope_table, positions)
    q, k = qk.split([hq, hkv], dim=1)
    out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype, device="cuda")
    counters = torch.zeros(keys.shape[0] * hkv, dtype=torch.int32, device="cuda")
    paged_decode(q, k, v, keys, values, seq_lens, table, slots, out, d**-0.5, counters, num_splits=splits, block_n=32,
                 num_warps=4, num_stages=2, scales=scales, rope=(rope_table, positions) if fused else None)
    return out, keys.view(torch.uint8) if fp8 else keys, slots


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("heads", [(torch.bfloat16, 32, 8, 128), (torch.float16, 8, 2, 64), (torch.bfloat16, 8, 2, 48),
                                   (torch.bfloat16, 16, 4, 80)], ids=lambda h: f"{h[0]}-{h[1]}x{h[2]}x{h[3]}")
def test_decode_kernel_rotating_q_and_k_matches_the_rope_kernel_first(heads, splits, fp8):
    """The same attention output and stored keys as the rope kernel's rotation followed by the kernel, up to
    the rotation's float32 rounding order (a fused multiply-add in one, not the other)."""
    lens = [1, 17, 300, 2049, 64]
    got_out, got_keys, slots = _decode(heads, lens, splits, fp8, fused=True)
    want_out, want_keys, _ = _decode(heads, lens, splits, fp8, fused=False)
    assert not got_out.isnan().any()
    torch.testing.assert_close(got_out.float(), want_out.float(), rtol=0, atol=2e-2)
    assert (got_out == want_out).float().mean() > 0.9
    got_keys, want_keys = got_keys.flatten(0, 1), want_keys.flatten(0, 1)  # [slots, KV heads, head size]
    assert (got_keys[slots] == want_keys[slots]).float().mean() > 0.9  # the keys this step stored, rotated alike
    untouched = torch.ones(got_keys.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(got_keys[untouched], want_keys[untouched])


def test_tiny_compiled_with_the_pass_decodes_as_without_it():
    """The tiny model compiled on CUDA with rope_attention (every layer's rope taken) against the compile without
    it: greedy tokens with CUDA graphs as without them and as the other compile's (up to near-ties, the rotation
    rounding as above), logits within bfloat16 rounding of its. Decode batches of 1 to 8 rows rotate in the kernel,
    prefill runs the rope kernel inside the op."""
    model_dir = resolve_model_dir("tiny")
    net, tok = load_model(model_dir, "cuda", "bfloat16"), Tokenizer.from_dir(model_dir)
    fused, report = compile_module(net, CompileConfig(device="cuda", dtype="bfloat16"))
    assert {r.name: r for r in report.passes}["rope_attention"].matches == net.cfg.num_layers
    default, _ = compile_module(net, CompileConfig(device="cuda", dtype="bfloat16",
                                                   disabled_passes=("rope_attention",)))
    _, plain, graphed = engines((net, fused, tok))
    _, reference, _ = engines((net, default, tok))
    assert_compiled_agrees(reference, plain, graphed, max_error=1e-2, max_tokens=24)
