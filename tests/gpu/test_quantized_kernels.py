"""The fp8 and int4 weight kernels against float32 products of the dequantized weight, at decode and
prefill row counts, on the bench models' projections and ragged shapes, with every split of K, and
inside CUDA graphs."""

import functools

import pytest
import torch

pytest.importorskip("triton")

from graphkiln.errors import ConfigError  # noqa: E402
from graphkiln.kernels import fp8_linear as fp8_kernels  # noqa: E402
from graphkiln.kernels import fp8_mma as mma_kernels  # noqa: E402
from graphkiln.kernels import int4_linear as int4_kernels  # noqa: E402
from graphkiln.kernels import int4_words as word_kernels  # noqa: E402
from graphkiln.kernels.fp8_linear import (  # noqa: E402
    FP8, MMA_ROWS, fp8_linear, quantize_rows, quantize_static, scaled_mm_fits,
)
from graphkiln.kernels.int4_linear import int4_linear  # noqa: E402
from graphkiln.kernels.split_k import MIN_SPLIT_K, RESIDENT, k_steps, multiprocessors  # noqa: E402
from graphkiln.models.quantized_linear import tinygemm_inner_k_tiles, tinygemm_layout  # noqa: E402

ROWS = [1, 2, 8, 16, 17, 33, 64, 128, 1024]  # 17: the fewest rows fp8 quantizes in a kernel of its own
INT4_ROWS = sorted({*ROWS, 3, 4, 5, 32})  # our kernels at every row count (these calls give no tinygemm layout)
SPLITS = [1, 2, 3, 8]  # K splits forced on the few-row kernels (fewer where the K steps do not share evenly)
ROWS_AND_SWAPS = [(1, False), (5, False), (5, True), (64, False), (64, True)]  # swap_ab: tensor-core kernels only
MODEL_SHAPES = {  # (N, K) of q/k/v fused, o, gate/up fused, down
    "1b-qkv": (3072, 2048), "1b-o": (2048, 2048), "1b-gate_up": (16384, 2048), "1b-down": (2048, 8192),
    "8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
}
FP8_SHAPES = {**MODEL_SHAPES, "ragged": (1000, 3000), "tiny": (37, 100), "odd-blocks": (200, 1160)}
INT4_SHAPES = {**MODEL_SHAPES, "ragged": (1000, 2944), "tiny": (37, 384), "odd-tiles": (200, 1152)}
SPLIT_SHAPES = {"ragged": (1000, 3000), "odd-blocks": (200, 1160), "8b-down": (4096, 14336)}


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.float() - expected).norm() / expected.norm()).item()


@functools.cache
def fp8_weight(n: int, k: int, blocks: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, its scales, the dequantized float32 weight) of a random bf16-range weight."""
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k + blocks)
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    if blocks:
        rows, cols = -(-n // 128), -(-k // 128)
        padded = torch.zeros(rows * 128, cols * 128, device="cuda")
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
def int4_weight(n: int, k: int, group: int = 128) -> tuple[torch.Tensor, ...]:
    """(qweight [N, K/2] uint8, scales, zeros, the dequantized float32 weight)."""
    gen = torch.Generator(device="cuda").manual_seed(n * 5 + k)
    q = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // group, device="cuda", generator=gen) + 0.5) * (0.1 * k**-0.5)
    zeros = torch.randint(0, 16, (n, k // group), device="cuda", generator=gen).float()
    scales, zeros = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    w = (q.float() - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    return qweight, scales, zeros, w


def activation(m: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(m * 3 + k)
    return torch.randn(m, k, device="cuda", generator=gen).to(dtype)


@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", FP8_SHAPES.values(), ids=FP8_SHAPES.keys())
def test_fp8_linear_matches_float32(shape, rows, blocks):
    """The activation is quantized to fp8 (per 1 x 128 group from 2 to FEW_ROWS rows, per token or group above):
    within fp8's step of the float32 product. One row, and block weights beyond what _scaled_mm takes, are
    multiplied unquantized (bf16 output rounding only)."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(rows, k)
    y = fp8_linear(x, weight, scale)
    expected = x.float() @ reference_weight.t()
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    unquantized = rows == 1 or (blocks and rows > MMA_ROWS and not scaled_mm_fits(x, weight, blocks))
    assert relative_error(y, expected) < (0.005 if unquantized else 0.05)


@pytest.mark.parametrize("rows", [1, 8, 33, 128])
def test_fp8_linear_float16_and_static_input_scale(rows):
    n, k = 4096, 4096
    weight, scale, reference_weight = fp8_weight(n, k, False)
    x = activation(rows, k, torch.float16)
    input_scale = (x.float().abs().amax() / 448).reshape(1)
    y = fp8_linear(x, weight, scale, input_scale)
    assert y.dtype == torch.float16  # up to FEW_ROWS rows the kernel's own groups quantize, not the static scale
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.06


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_is_within_half_an_fp8_step(group):
    x = activation(64, 4096) * 5
    q, scales = quantize_rows(x, group)
    per_element = scales if group is None else scales.repeat_interleave(group, 1)
    assert q.dtype == FP8 and scales.shape == ((64, 1) if group is None else (64, 32))
    amax = x.float().abs().amax(dim=1, keepdim=True) if group is None else x.float().abs().view(64, 32, 128).amax(2)
    torch.testing.assert_close(scales, amax / 448, rtol=1e-6, atol=0)
    error = (q.float() * per_element - x.float()).abs()
    assert (error <= x.float().abs() * 2**-4 + per_element * 2**-9).all()


@pytest.mark.parametrize("rows", INT4_ROWS)
@pytest.mark.parametrize("shape", INT4_SHAPES.values(), ids=INT4_SHAPES.keys())
def test_int4_linear_matches_float32(shape, rows):
    """Every path keeps the activation as it is: float32 accumulation and one rounding of the output (the
    prefill path's dequantized bf16 weight adds one rounding of the weight)."""
    n, k = shape
    qweight, scales, zeros, reference_weight = int4_weight(n, k)
    x = activation(rows, k)
    y = int4_linear(x, qweight, scales, zeros, 128)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.008


@pytest.mark.parametrize("group", [32, 64, 256])
@pytest.mark.parametrize("rows", [1, 3, 8, 512])
def test_int4_linear_other_group_sizes(group, rows):
    n, k = 1536, 2048
    qweight, scales, zeros, reference_weight = int4_weight(n, k, group)
    x = activation(rows, k, torch.float16)
    y = int4_linear(x, qweight, scales, zeros, group)
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.008


def tinygemm(qweight, scales, zeros, group) -> tuple[torch.Tensor, torch.Tensor]:
    tiles = tinygemm_inner_k_tiles(qweight, scales, group)
    assert tiles is not None
    return tinygemm_layout(qweight, scales, zeros, group, tiles)


@pytest.mark.parametrize("rows", range(1, int4_kernels.TINYGEMM_ROWS + 2))
@pytest.mark.parametrize("shape", [*MODEL_SHAPES.values(), (1000, 2944), (200, 1152), (64, 192), (64, 160)],
                         ids=[*MODEL_SHAPES, "ragged", "odd-tiles", "four-k-tiles", "two-k-tiles"])
def test_int4_linear_through_tinygemm_matches_float32(shape, rows):
    """With the layer's tinygemm layout (K a multiple of 128, 64 or 32: 8, 4 or 2 k-tiles a word), up to
    TINYGEMM_ROWS rows take torch's kernel, beyond them ours: both within the bf16 weight's rounding of float32."""
    n, k = shape
    group = 32 if k % 128 else 128
    qweight, scales, zeros, reference_weight = int4_weight(n, k, group)
    x = activation(rows, k)
    y = int4_linear(x, qweight, scales, zeros, group, *tinygemm(qweight, scales, zeros, group))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.008


@pytest.mark.parametrize("group", [32, 64, 256])
def test_int4_linear_through_tinygemm_other_group_sizes(group):
    n, k = 1536, 2048
    qweight, scales, zeros, reference_weight = int4_weight(n, k, group)
    x = activation(2, k)
    y = int4_linear(x, qweight, scales, zeros, group, *tinygemm(qweight, scales, zeros, group))
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.008


def test_tinygemm_layout_applies_only_where_its_kernel_runs():
    qweight, scales, zeros, _ = int4_weight(1536, 2048)
    assert tinygemm_inner_k_tiles(qweight, scales, 128) == 8
    assert tinygemm_inner_k_tiles(qweight, scales.half(), 128) is None  # bfloat16 only
    assert tinygemm_inner_k_tiles(qweight[:1532], scales[:1532], 128) is None  # N a multiple of 8
    assert tinygemm_inner_k_tiles(qweight, scales, 16) is None  # groups of 32 to 256
    assert tinygemm_inner_k_tiles(qweight.cpu(), scales.cpu(), 128) is None


def with_splits(tiles: tuple, splits: int, swap_ab: bool) -> tuple:
    """A kernel's tiles with the split count (the third from the end) replaced, and for the tensor-core kernels
    (BLOCK_M first, seven tiles) whether the dot's operands swap (the fourth)."""
    if len(tiles) == 7:
        tiles = (*tiles[:3], swap_ab, *tiles[4:])
    return (*tiles[:-3], splits, *tiles[-2:])


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("shape", SPLIT_SHAPES.values(), ids=SPLIT_SHAPES.keys())
def test_fp8_gemv_matches_float32_with_every_split_of_k(shape, blocks, splits):
    """Each split's partial product, summed in the second kernel: the float32 product up to the output rounding."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(1, k)
    tiles = with_splits(fp8_kernels.gemv_tiling(n, k, multiprocessors(x.device)), splits, False)
    y = fp8_kernels.fp8_gemv(x, weight, scale, tiles=tiles)
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.005


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64, 100])
@pytest.mark.parametrize("shape", SPLIT_SHAPES.values(), ids=SPLIT_SHAPES.keys())
def test_fp8_mma_matches_float32_with_every_split_of_k(shape, rows, blocks, splits):
    """The fp8 tensor-core kernel, its activation rounded to fp8 per 1 x 128 group in registers: within fp8's
    step of the float32 product for every split of K and for rows beyond one row tile (100)."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(rows, k)
    tiles = mma_kernels.mma_tiling(rows, n, k, multiprocessors(x.device))
    y = mma_kernels.fp8_mma(x, weight, scale, tiles=(*tiles[:3], splits, *tiles[4:]))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.05


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_fp8_mma_rounds_the_activation_per_group(rows):
    """Against the float32 product of the weight and the activation rounded to fp8 per 1 x 128 group (as
    torch rounds): only accumulation order and the output rounding differ, so a kernel that quantized per
    token, or not at all, would fail this bound."""
    n, k = 4096, 4096
    weight, scale, reference_weight = fp8_weight(n, k, False)
    x = activation(rows, k) * torch.linspace(0.01, 4, k, device="cuda")  # groups of very different ranges
    groups = x.float().view(rows, k // 128, 128)
    group_scale = groups.abs().amax(-1, keepdim=True) / 448
    rounded = ((groups / group_scale).to(FP8).float() * group_scale).view(rows, k)
    y = mma_kernels.fp8_mma(x, weight, scale)
    assert relative_error(y, rounded @ reference_weight.t()) < 0.006


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "block"])
@pytest.mark.parametrize("rows", [17, 33, 64, 100])
@pytest.mark.parametrize("shape", SPLIT_SHAPES.values(), ids=SPLIT_SHAPES.keys())
def test_fp8_mma_on_quantized_rows_is_the_float32_product_of_what_it_reads(shape, rows, blocks, static, splits):
    """fp8_mma on x already in fp8 (scaled per token, per 1 x 128 group for block weights, or by one static
    scale, as fp8_linear hands it over above FEW_ROWS rows) against the float32 product of those fp8 rows
    times their scales and the dequantized weight: only accumulation order and the output rounding differ,
    so a scale read from the wrong row, group or split fails the bound."""
    n, k = shape
    weight, scale, reference_weight = fp8_weight(n, k, blocks)
    x = activation(rows, k) * torch.linspace(0.01, 4, k, device="cuda")  # groups of very different ranges
    if static:
        input_scale = (x.float().abs().amax() / 448).reshape(1)
        xq, x_scale = quantize_static(x, input_scale), input_scale.reshape(1, 1).expand(rows, 1)
        per_element = x_scale
    else:
        xq, x_scale = quantize_rows(x, 128 if blocks else None)
        per_element = x_scale.repeat_interleave(128, 1)[:, :k] if blocks else x_scale
    tiles = mma_kernels.mma_tiling(rows, n, k, multiprocessors(x.device), x_fp8=True, block_scales=blocks)
    y = mma_kernels.fp8_mma(xq, weight, scale, tiles=(*tiles[:3], splits, *tiles[4:]), x_scale=x_scale,
                            out_dtype=torch.bfloat16)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, (xq.float() * per_element) @ reference_weight.t()) < 0.006


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("rows,swap_ab", ROWS_AND_SWAPS)
@pytest.mark.parametrize("shape", [(1000, 2944), (200, 1152), (4096, 14336)], ids=["ragged", "odd-tiles", "8b-down"])
def test_int4_kernels_match_float32_with_every_split_of_k(shape, rows, swap_ab, splits):
    n, k = shape
    qweight, scales, zeros, reference_weight = int4_weight(n, k)
    x = activation(rows, k)
    sms = multiprocessors(x.device)
    if rows == 1:
        tiles = with_splits(int4_kernels.gemv_tiling(n, k, sms), splits, swap_ab)
        y = int4_kernels.int4_gemv(x, qweight, scales, zeros, 128, tiles=tiles)
    else:
        tiles = with_splits(int4_kernels.mm_tiling(rows, n, k, 128, sms), splits, swap_ab)
        y = int4_kernels.int4_mm(x, qweight, scales, zeros, 128, tiles=tiles)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.008


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,group", [((1000, 2944), 128), ((200, 1152), 32), ((4096, 14336), 128)],
                         ids=["ragged", "group-32", "8b-down"])
def test_int4_dequantize_is_the_rounded_float32_weight(shape, group, dtype):
    """The prefill path's dequantized weight (stored as 32-bit pairs of 16-bit floats) is the float32 weight
    rounded once: bit for bit, in order along K."""
    qweight, scales, zeros, reference_weight = int4_weight(*shape, group)
    got = int4_kernels.dequantize(qweight, scales, zeros, group, dtype)
    assert got.shape == shape and got.dtype == dtype
    assert torch.equal(got, reference_weight.to(dtype))


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("shape", MODEL_SHAPES.values(), ids=MODEL_SHAPES.keys())
def test_decode_tilings_put_enough_programs_on_every_multiprocessor(shape, rows):
    """The rule's tiles at batch 1 to 8: slabs x K splits reach RESIDENT programs a multiprocessor, unless K
    cannot be split further (twice the splits would cover fewer than MIN_SPLIT_K inputs or share unevenly)."""
    n, k = shape
    sms = multiprocessors(torch.device("cuda"))
    if rows == 1:
        tilings = [fp8_kernels.gemv_tiling(n, k, sms), int4_kernels.gemv_tiling(n, k, sms)]
        shapes = [(t[0], t[1], t[2]) for t in tilings]
    else:
        mma, mm = mma_kernels.mma_tiling(rows, n, k, sms), int4_kernels.mm_tiling(rows, n, k, 128, sms)
        shapes = [(mma[1], mma[2], mma[3]), (mm[1], mm[2], mm[4])]
    for block_n, block_k, splits in shapes:
        finest = k // (2 * splits) < max(MIN_SPLIT_K, block_k) or k_steps(k, 2 * splits, block_k)[0] == splits
        assert -(-n // block_n) * splits >= RESIDENT * sms or finest, (block_n, block_k, splits)


WORD_SHAPES = {"ragged": (1000, 2944), "odd-tiles": (200, 1152), "tiny": (37, 384), "8b-down": (4096, 14336)}


def qwords(qweight: torch.Tensor) -> torch.Tensor:
    words = word_kernels.words(qweight)
    assert words is not None and words.dtype == torch.int32 and words.shape == (qweight.shape[0], qweight.shape[1] // 4)
    return words


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("rows", [2, 5, 16, 17, 32, 64, 100])
@pytest.mark.parametrize("shape", WORD_SHAPES.values(), ids=WORD_SHAPES.keys())
def test_int4_dot_word_kernel_matches_float32_with_every_split_of_k(shape, rows, splits):
    """The tensor-core word kernel: rows padded to the dot's 16 and beyond one row tile (100), every split of K."""
    n, k = shape
    qweight, scales, zeros, reference_weight = int4_weight(n, k)
    x = activation(rows, k)
    tiles = word_kernels.dot_tiling(rows, n, k, multiprocessors(x.device))
    y = word_kernels.int4_dot(x, qwords(qweight), scales, zeros, 128, tiles=(*tiles[:3], splits, *tiles[4:]))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.008


@pytest.mark.parametrize("rows,group", [(2, 128), (8, 256), (32, 1024)])
def test_int4_dot_word_kernel_takes_every_group_size_from_a_dot_step(rows, group):
    """Groups of one K step and wider (a step inside one group), in float16."""
    n, k = 1000, 4096
    qweight, scales, zeros, reference_weight = int4_weight(n, k, group)
    x = activation(rows, k, torch.float16)
    y = word_kernels.int4_dot(x, qwords(qweight), scales, zeros, group)
    assert y.dtype == torch.float16 and relative_error(y, x.float() @ reference_weight.t()) < 0.008


def test_int4_dot_refuses_groups_under_a_dot_step():
    qweight, scales, zeros, _ = int4_weight(256, 256, 64)
    with pytest.raises(ConfigError, match="group_size 64: int4_linear takes smaller groups"):
        word_kernels.int4_dot(activation(8, 256), qwords(qweight), scales, zeros, 64)


@pytest.mark.parametrize("rows", [1, 8])
def test_int4_linear_takes_a_qweight_off_4_byte_boundaries(rows):
    """A qweight view starting one byte into its storage cannot be read as words: the byte kernels take it."""
    n, k = 1000, 2944
    qweight, scales, zeros, reference_weight = int4_weight(n, k)
    shifted = torch.empty(qweight.numel() + 1, dtype=torch.uint8, device="cuda")[1:].view(qweight.shape)
    shifted.copy_(qweight)
    assert word_kernels.words(shifted) is None
    x = activation(rows, k)
    assert relative_error(int4_linear(x, shifted, scales, zeros, 128), x.float() @ reference_weight.t()) < 0.008


@pytest.mark.parametrize("rows", [2, 4, 8, 16])
@pytest.mark.parametrize("shape", MODEL_SHAPES.values(), ids=MODEL_SHAPES.keys())
def test_int4_dot_tiling_puts_enough_programs_on_every_multiprocessor(shape, rows):
    """As for the byte kernels: slabs x K splits (one row tile up to 16 rows) reach RESIDENT programs a
    multiprocessor, unless K cannot be split further."""
    n, k = shape
    sms = multiprocessors(torch.device("cuda"))
    _, block_n, block_k, splits = word_kernels.dot_tiling(rows, n, k, sms)[:4]
    finest = k // (2 * splits) < max(MIN_SPLIT_K, block_k) or k_steps(k, 2 * splits, block_k)[0] == splits
    assert -(-n // block_n) * splits >= RESIDENT * sms or finest, (block_n, block_k, splits)


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


@pytest.mark.parametrize("rows", [1, 3, 8, 32, 64, 1024])
@pytest.mark.parametrize("kind", ["fp8-per-channel", "fp8-block", "int4", "int4-tinygemm"])
def test_kernels_replay_in_a_cuda_graph(kind, rows):
    """Captured once, replayed on new activations: the eager result of those activations, bit for bit (the
    split-K partials are summed in a fixed order, so the replay cannot differ)."""
    n, k = 6144, 4096
    if kind.startswith("int4"):
        qweight, scales, zeros, _ = int4_weight(n, k)
        layout = tinygemm(qweight, scales, zeros, 128) if kind == "int4-tinygemm" else ()

        def fn(x):
            return int4_linear(x, qweight, scales, zeros, 128, *layout)
    else:
        weight, scale, _ = fp8_weight(n, k, kind == "fp8-block")

        def fn(x):
            return fp8_linear(x, weight, scale)
    static_x, static_y, replay = captured(fn, activation(rows, k))
    for seed in (1, 2):
        fresh = activation(rows + seed, k)[:rows]
        static_x.copy_(fresh)
        replay()
        assert torch.equal(static_y, fn(fresh))


def test_bad_shapes_are_config_errors_naming_what_to_give():
    weight, scale, _ = fp8_weight(256, 256, False)
    x = activation(1, 256)
    with pytest.raises(ConfigError, match=r"\(256,\) or one per 128 x 128 block \(2, 2\)"):
        fp8_linear(x, weight, scale[:100])
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        fp8_linear(x, weight.float(), scale)
    qweight, scales, zeros, _ = int4_weight(256, 256)
    with pytest.raises(ConfigError, match="group_size 96"):
        int4_linear(x, qweight, scales, zeros, 96)
    with pytest.raises(ConfigError, match=r"zeros has shape \(256, 1\).*needs \(256, 2\)"):
        int4_linear(x, qweight, scales, zeros[:, :1], 128)


def test_zero_rows_give_an_empty_product():
    weight, scale, _ = fp8_weight(256, 256, True)
    qweight, scales, zeros, _ = int4_weight(256, 256)
    x = activation(1, 256)[:0]
    assert fp8_linear(x, weight, scale).shape == (0, 256)
    assert int4_linear(x, qweight, scales, zeros, 128).shape == (0, 256)
