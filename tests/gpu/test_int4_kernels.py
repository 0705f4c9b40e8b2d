"""The int4 weight kernels (torch's tinygemm where it runs, our byte, word and dp4a kernels, dequantize + cuBLAS,
and int4_linear's choice among them) against float32 products of the dequantized weight, at decode and prefill row
counts, on the bench models' projections and ragged shapes, with every split of K."""

import pytest
import torch

pytest.importorskip("triton")

from graphkiln.errors import ConfigError  # noqa: E402
from graphkiln.kernels import int4_dp4a as dp4a_kernels  # noqa: E402
from graphkiln.kernels import int4_linear as int4_kernels  # noqa: E402
from graphkiln.kernels import int4_words as word_kernels  # noqa: E402
from graphkiln.kernels.int4_linear import int4_linear  # noqa: E402
from graphkiln.kernels.split_k import MIN_SPLIT_K, RESIDENT, k_steps, multiprocessors  # noqa: E402
from graphkiln.models.quantized_linear import tinygemm_inner_k_tiles  # noqa: E402
from kernel_weights import (  # noqa: E402
    MODEL_SHAPES, ROWS, SPLITS, activation, captured, int4_weight, relative_error, tinygemm, with_splits,
)

INT4_ROWS = sorted({*ROWS, 3, 4, 5, 32})  # our kernels at every row count (these calls give no tinygemm layout)
ROWS_AND_SWAPS = [(1, False), (5, False), (5, True), (64, False), (64, True)]  # swap_ab: tensor-core kernels only
INT4_SHAPES = {**MODEL_SHAPES, "ragged": (1000, 2944), "tiny": (37, 384), "odd-tiles": (200, 1152)}
WORD_SHAPES = {"ragged": (1000, 2944), "odd-tiles": (200, 1152), "tiny": (37, 384), "8b-down": (4096, 14336)}


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


@pytest.mark.parametrize("rows", range(1, int4_kernels.TINYGEMM_ROWS + 2))
@pytest.mark.parametrize("shape", [*MODEL_SHAPES.values(), (1000, 2944), (200, 1152), (64, 192), (64, 160)],
                         ids=[*MODEL_SHAPES, "ragged", "odd-tiles", "four-k-tiles", "two-k-tiles"])
def test_int4_linear_through_tinygemm_matches_float32(shape, rows):
    """With the layer's tinygemm layout (K a multiple of 128, 64 or 32: 8, 4 or 2 k-tiles a word), one row takes
    the dp4a GEMV where N and K reach DP4A_SIDE (the 1B- and 8B-like shapes), torch's kernel elsewhere and up to
    TINYGEMM_ROWS rows, ours beyond them: all within the bf16 weight's rounding of float32."""
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


DP4A_SHAPES = {**WORD_SHAPES, **MODEL_SHAPES}


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", DP4A_SHAPES.values(), ids=DP4A_SHAPES.keys())
def test_int4_dp4a_gemv_matches_float32_with_every_split_of_k(shape, dtype, splits):
    """The dp4a GEMV (x in 16-bit fixed point per group, exact integer sums) within one rounding of the output."""
    n, k = shape
    qweight, scales, zeros, reference_weight = int4_weight(n, k)
    x = activation(1, k, dtype)
    tiles = dp4a_kernels.dp4a_tiling(n, k, 128, multiprocessors(x.device))
    y = dp4a_kernels.int4_dp4a_gemv(x, qwords(qweight), scales, zeros, 128, tiles=with_splits(tiles, splits, False))
    assert y.shape == (1, n) and y.dtype == dtype
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.008


@pytest.mark.parametrize("group", [16, 32, 64, 256, 1024])
def test_int4_dp4a_gemv_other_group_sizes(group):
    n, k = 1536, 2048
    qweight, scales, zeros, reference_weight = int4_weight(n, k, group)
    x = activation(1, k)
    y = dp4a_kernels.int4_dp4a_gemv(x, qwords(qweight), scales, zeros, group)
    assert relative_error(y, x.float() @ reference_weight.t()) < 0.008


def fixed_point(words: torch.Tensor) -> torch.Tensor:
    """f [K] from x_words' words: the bytes of its four arrays (little-endian), f = 256 h + l."""
    high_even, high_odd, low_even, low_odd = words.contiguous().view(torch.uint8).view(4, -1)
    high = torch.stack((high_even.view(torch.int8), high_odd.view(torch.int8)), 1).reshape(-1).int()
    return 256 * high + torch.stack((low_even, low_odd), 1).reshape(-1).int()


def test_int4_dp4a_x_words_round_each_group_to_its_own_fixed_point():
    """Every input within half a step of its group's fixed point (its largest input / 32767): a group of zeros,
    one of inputs near 1e-3, one with an input of 60000 (near float16's largest), the rest normal."""
    k = 2944
    x = activation(1, k, torch.float16)
    x[0, :128] = 0
    x[0, 128:256] *= 1e-3
    x[0, 1000] = 60000.0
    words, scales, sums = dp4a_kernels.x_words(x, 128)
    largest = x.float().abs().view(-1, 128).amax(1)
    assert torch.allclose(scales, torch.where(largest > 0, largest / 32767, 1.0), rtol=1e-6, atol=0)
    f = fixed_point(words)
    error = (f.float() * scales.repeat_interleave(128) - x.float()[0]).abs().view(-1, 128).amax(1)
    assert (error <= 0.51 * scales).all()
    assert torch.equal(sums, f.view(-1, 128).sum(1).float())


def test_int4_dp4a_gemv_carries_a_non_finite_input_to_the_outputs():
    qweight, scales, zeros, _ = int4_weight(1000, 2944)
    x = activation(1, 2944)
    x[0, 300] = float("inf")
    assert not torch.isfinite(dp4a_kernels.int4_dp4a_gemv(x, qwords(qweight), scales, zeros, 128)).any()


def test_int4_dp4a_gemv_replays_in_a_cuda_graph():
    """Captured once (the x-words kernel, the product and the split sum), replayed on new inputs: equal to the
    eager call bit for bit."""
    n, k = 4096, 14336
    qweight, scales, zeros, _ = int4_weight(n, k)
    words = qwords(qweight)
    tiles = with_splits(dp4a_kernels.dp4a_tiling(n, k, 128, multiprocessors(torch.device("cuda"))), 2, False)

    def fn(x):
        return dp4a_kernels.int4_dp4a_gemv(x, words, scales, zeros, 128, tiles=tiles)

    static_x, static_y, replay = captured(fn, activation(1, k))
    for seed in (1, 2):
        x = torch.randn(1, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).bfloat16()
        static_x.copy_(x)
        replay()
        assert torch.equal(static_y, fn(x))


def test_int4_dp4a_gemv_refuses_more_rows_unaligned_weights_and_partial_groups():
    qweight, scales, zeros, _ = int4_weight(256, 1024)
    with pytest.raises(ConfigError, match="takes one row"):
        dp4a_kernels.int4_dp4a_gemv(activation(2, 1024), qwords(qweight), scales, zeros, 128)
    with pytest.raises(ConfigError, match="4-byte boundaries"):
        dp4a_kernels.int4_dp4a_gemv(activation(1, 1024), None, scales, zeros, 128)
    with pytest.raises(ConfigError, match="BLOCK_K 192"):
        dp4a_kernels.int4_dp4a_gemv(activation(1, 1024), qwords(qweight), scales, zeros, 128,
                                    tiles=(8, 192, 1, 4, 2))


@pytest.mark.parametrize("shape", MODEL_SHAPES.values(), ids=MODEL_SHAPES.keys())
def test_int4_dp4a_tiling_takes_whole_groups_and_fills_the_multiprocessors(shape):
    """K steps of whole groups; slabs x K splits reach two programs a multiprocessor (the sweep's best: the
    1B-like down projection gained by two splits, no 8B-like one by any), unless K cannot be split further."""
    n, k = shape
    sms = multiprocessors(torch.device("cuda"))
    block_n, block_k, splits = dp4a_kernels.dp4a_tiling(n, k, 128, sms)[:3]
    assert k % block_k == 0 and block_k % 128 == 0
    finest = k // (2 * splits) < max(MIN_SPLIT_K, block_k) or k_steps(k, 2 * splits, block_k)[0] == splits
    assert -(-n // block_n) * splits >= 2 * sms or finest, (block_n, block_k, splits)
