"""Weights and activations for the GPU tests of the quantized kernels (test_fp8_kernels.py, test_int4_kernels.py,
test_int8_kernels.py, test_quantized_kernels.py; the weights also for tests/interpreted_kernels.py, on the CPU):
random weights quantized the way the kernels read them, with their dequantized float32 reference, the shapes and
splits the tests share, and a CUDA-graph capture of a product."""

import functools

import torch

from graphkiln.models.quantized_linear import tinygemm_inner_k_tiles, tinygemm_layout

FP8 = torch.float8_e4m3fn

ROWS = [1, 2, 8, 16, 17, 33, 64, 128, 1024]  # 17: the fewest rows fp8 quantizes in a kernel of its own
SPLITS = [1, 2, 3, 8]  # K splits forced on the few-row kernels (fewer where the K steps do not share evenly)
MODEL_SHAPES = {  # (N, K) of q/k/v fused, o, gate/up fused, down
    "1b-qkv": (3072, 2048), "1b-o": (2048, 2048), "1b-gate_up": (16384, 2048), "1b-down": (2048, 8192),
    "8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
}


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.float() - expected).norm() / expected.norm()).item()


@functools.cache
def fp8_weight(n: int, k: int, blocks: bool, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, its scales, the dequantized float32 weight) of a random bf16-range weight."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k + blocks)
    w = torch.randn(n, k, device=device, generator=gen) * k**-0.5
    if blocks:
        rows, cols = -(-n // 128), -(-k // 128)
        padded = torch.zeros(rows * 128, cols * 128, device=device)
        padded[:n, :k] = w
        amax = padded.abs().view(rows, 128, cols, 128).amax(dim=(1, 3))
        scale = (amax / 448).clamp(min=1e-12)
        full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    else:
        scale = (w.abs().amax(dim=1) / 448).clamp(min=1e-12)
        full = scale[:, None]
    q = (w / full).to(FP8)
    return q, scale.float().contiguous(), q.float() * full


@functools.cache
def int8_weight(n: int, k: int, device: str = "cuda", groups: bool = False) -> tuple[torch.Tensor, ...]:
    """(int8 weight, its float32 scales per row [N] or, with `groups`, per row and 128 inputs [N, ceil(K/128)], the
    dequantized float32 weight) of a random bf16-range weight."""
    gen = torch.Generator(device=device).manual_seed(n * 11 + k + groups)
    w = torch.randn(n, k, device=device, generator=gen) * k**-0.5
    if groups:
        padded = torch.nn.functional.pad(w, (0, -k % 128)).unflatten(1, (-1, 128))
        scale = (padded.abs().amax(dim=2) / 127).clamp(min=1e-12)
        full = scale.repeat_interleave(128, 1)[:, :k]
    else:
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        full = scale[:, None]
    q = (w / full).round().clamp(-127, 127).to(torch.int8)
    return q, scale.contiguous(), q.float() * full


@functools.cache
def int4_weight(n: int, k: int, group: int = 128, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """(qweight [N, K/2] uint8, scales, zeros, the dequantized float32 weight)."""
    gen = torch.Generator(device=device).manual_seed(n * 5 + k)
    q = torch.randint(0, 16, (n, k), device=device, generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // group, device=device, generator=gen) + 0.5) * (0.1 * k**-0.5)
    zeros = torch.randint(0, 16, (n, k // group), device=device, generator=gen).float()
    scales, zeros = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    w = (q.float() - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    return qweight, scales, zeros, w


def activation(m: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(m * 3 + k)
    return torch.randn(m, k, device="cuda", generator=gen).to(dtype)


def tinygemm(qweight, scales, zeros, group) -> tuple[torch.Tensor, torch.Tensor]:
    tiles = tinygemm_inner_k_tiles(qweight, scales, group)
    assert tiles is not None
    return tinygemm_layout(qweight, scales, zeros, group, tiles)


def with_splits(tiles: tuple, splits: int, swap_ab: bool) -> tuple:
    """A kernel's tiles with the split count (the third from the end) replaced, and for the tensor-core kernels
    (BLOCK_M first, seven tiles) whether the dot's operands swap (the fourth)."""
    if len(tiles) == 7:
        tiles = (*tiles[:3], swap_ab, *tiles[4:])
    return (*tiles[:-3], splits, *tiles[-2:])


def captured(fn, x: torch.Tensor):
    """fn(x) captured in a CUDA graph after a warm-up: (static input, static output, replay)."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_y = fn(static_x)
    return static_x, static_y, graph.replay
