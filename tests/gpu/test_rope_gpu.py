"""graphkiln::rope on CUDA: the Triton kernel against float32 rotary embedding at the head sizes the models use,
on the query and key heads as the model passes them (a view of the qkv product), and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from graphkiln.models.rope import rope, rope_reference, rotate_half


def _inputs(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """The q and k heads of a qkv product's output (two more heads of v beside them), a cos/sin table of 4096
    positions and shuffled positions."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, device="cuda", dtype=dtype, generator=gen)
    table = torch.randn(4096, 2 * head_dim, device="cuda", generator=gen)
    positions = torch.randperm(4096, device="cuda", generator=gen)[:tokens]
    return qkv[:, : heads * head_dim].view(tokens, heads, head_dim), table, positions


def _float32(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = table[positions].double().unsqueeze(1).chunk(2, dim=-1)
    return x.double() * cos + rotate_half(x.double()) * sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 40, 64), (2048, 40, 64), (33, 48, 128), (5, 72, 128),
                                                   (7, 20, 80), (3, 12, 96), (2, 6, 256), (4, 3, 12)])
def test_kernel_matches_float32_rope(tokens, heads, head_dim, dtype):
    """Within one rounding of the output dtype of the float64 rotation. Against rope_reference (torch's ops on
    the same float32 arithmetic) a 16-bit output is nearly always the same number; a float32 one differs in its
    last bit wherever the two contract a product and a sum into one multiply-add differently."""
    x, table, positions = _inputs(tokens, heads, head_dim, dtype, tokens + heads + head_dim)
    got = rope(x, table, positions)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    want = _float32(x, table, positions)
    tolerance = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    if dtype != torch.float32:
        assert (got == rope_reference(x, table, positions)).float().mean() > 0.95


def test_kernel_replays_inside_a_cuda_graph_with_new_inputs():
    from graphkiln.kernels.rope import rope as kernel

    x, table, positions = _inputs(16, 40, 64, torch.bfloat16, 0)
    before = kernel(x, table, positions)  # built outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(x, table, positions)
    fresh_x, _, fresh_positions = _inputs(16, 40, 64, torch.bfloat16, 1)
    x.copy_(fresh_x)
    positions.copy_(fresh_positions)
    graph.replay()
    assert torch.equal(out, kernel(x, table, positions)) and not torch.equal(out, before)
