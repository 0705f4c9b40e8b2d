"""What the fp8 and int4 weight kernels share: tilings that occupy every multiprocessor at decode sizes, replays
inside CUDA graphs, clear errors for bad shapes, and empty products for zero rows."""

import pytest
import torch

pytest.importorskip("triton")

from graphkiln.errors import ConfigError  # noqa: E402
from graphkiln.kernels import fp8_linear as fp8_kernels  # noqa: E402
from graphkiln.kernels import fp8_mma as mma_kernels  # noqa: E402
from graphkiln.kernels import int4_linear as int4_kernels  # noqa: E402
from graphkiln.kernels.fp8_linear import fp8_linear  # noqa: E402
from graphkiln.kernels.int4_linear import int4_linear  # noqa: E402
from graphkiln.kernels.split_k import MIN_SPLIT_K, PARTIAL_SHARE, RESIDENT, k_steps, multiprocessors  # noqa: E402
from graphkiln.kernels.int4_dp4a import dp4a_tiling  # noqa: E402
from graphkiln.kernels.int4_words import dot_tiling  # noqa: E402
from kernel_weights import (  # noqa: E402
    MODEL_SHAPES, activation, captured, fp8_weight, int4_weight, relative_error, tinygemm, with_splits,
)


def _reached_tilings(rows: int, n: int, k: int, sms: int) -> dict[str, tuple[int, ...]]:
    """(BLOCK_N, BLOCK_K, splits, programs a multiprocessor aimed for, weight bytes) of the kernels fp8_linear and
    int4_linear send these rows to whose tiling aims for a residency: at one row the fp8 GEMV, the int4 dp4a GEMV
    (weights with words) and the byte GEMV (without); at 2-16 rows fp8_mma (block scales; per-channel weights on
    sm90+ take fp8_tma, whose tiling follows the waves instead), at 2-32 rows int4_dot, at 33-64 int4_mm."""
    fp8_bytes, int4_bytes = n * k, n * k // 2
    if rows == 1:
        fp8, dp4a = fp8_kernels.gemv_tiling(n, k, sms), dp4a_tiling(n, k, 128, sms)
        gemv = int4_kernels.gemv_tiling(n, k, sms)
        return {"fp8_gemv": (*fp8[:3], fp8_kernels.GEMV_RESIDENT, fp8_bytes),
                "int4_dp4a_gemv": (*dp4a[:3], 2, int4_bytes), "int4_gemv": (*gemv[:3], RESIDENT, int4_bytes)}
    tilings = {}
    if rows <= fp8_kernels.FEW_ROWS:
        mma = mma_kernels.mma_tiling(rows, n, k, sms, block_scales=True)
        tilings["fp8_mma"] = (*mma[1:4], RESIDENT, fp8_bytes)
    if rows <= int4_kernels.DOT_ROWS:
        dot = dot_tiling(rows, n, k, sms)
        tilings["int4_dot"] = (*dot[1:4], RESIDENT, int4_bytes)
    else:
        mm = int4_kernels.mm_tiling(rows, n, k, 128, sms)
        tilings["int4_mm"] = (mm[1], mm[2], mm[4], RESIDENT, int4_bytes)
    return tilings


@pytest.mark.parametrize("rows", [1, 2, 8, 32, 64])
@pytest.mark.parametrize("shape", MODEL_SHAPES.values(), ids=MODEL_SHAPES.keys())
def test_decode_tilings_put_enough_programs_on_every_multiprocessor(shape, rows):
    """The tiles of the kernels these rows reach: slabs x row tiles x K splits reach the programs a
    multiprocessor their rule aims for, unless K cannot be split further (twice the splits would cover fewer than
    MIN_SPLIT_K inputs or share unevenly) or twice the splits' float32 partials would pass 1/PARTIAL_SHARE of the
    weight's bytes."""
    n, k = shape
    sms = multiprocessors(torch.device("cuda"))
    row_tiles = -(-rows // 64)
    for kernel, (block_n, block_k, splits, resident, weight_bytes) in _reached_tilings(rows, n, k, sms).items():
        finest = k // (2 * splits) < max(MIN_SPLIT_K, block_k) or k_steps(k, 2 * splits, block_k)[0] == splits
        partials_capped = 2 * splits * PARTIAL_SHARE * 4 * rows * n > weight_bytes
        programs = -(-n // block_n) * row_tiles * splits
        assert programs >= resident * sms or finest or partials_capped, (kernel, block_n, block_k, splits)


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
    _replays_as_eager(fn, rows, k)


@pytest.mark.parametrize("splits", [1, 4])
def test_one_row_byte_gemv_replays_in_a_cuda_graph(splits):
    """The int4 byte GEMV (int4_linear's one-row kernel for weights without words) with and without K split."""
    n, k = 6144, 4096
    qweight, scales, zeros, reference = int4_weight(n, k)
    tiles = with_splits(int4_kernels.gemv_tiling(n, k), splits, False)

    def fn(x):
        return int4_kernels.int4_gemv(x, qweight, scales, zeros, 128, tiles=tiles)

    _replays_as_eager(fn, 1, k)
    x = activation(1, k)
    assert relative_error(fn(x), x.float() @ reference.t()) < 0.005


def _replays_as_eager(fn, rows: int, k: int) -> None:
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
