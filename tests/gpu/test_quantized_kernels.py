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
from graphkiln.kernels.split_k import MIN_SPLIT_K, RESIDENT, k_steps, multiprocessors  # noqa: E402
from kernel_weights import MODEL_SHAPES, activation, captured, fp8_weight, int4_weight, tinygemm  # noqa: E402

@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("shape", MODEL_SHAPES.values(), ids=MODEL_SHAPES.keys())
def test_decode_tilings_put_enough_programs_on_every_multiprocessor(shape, rows):
    """The rule's tiles at batch 1 to 8: slabs x K splits reach their kernel's programs a multiprocessor
    (GEMV_RESIDENT for the fp8 GEMV, RESIDENT for the others), unless K cannot be split further (twice the
    splits would cover fewer than MIN_SPLIT_K inputs or share unevenly)."""
    n, k = shape
    sms = multiprocessors(torch.device("cuda"))
    if rows == 1:
        fp8, int4 = fp8_kernels.gemv_tiling(n, k, sms), int4_kernels.gemv_tiling(n, k, sms)
        shapes = [(fp8[0], fp8[1], fp8[2], fp8_kernels.GEMV_RESIDENT), (int4[0], int4[1], int4[2], RESIDENT)]
    else:
        mma, mm = mma_kernels.mma_tiling(rows, n, k, sms), int4_kernels.mm_tiling(rows, n, k, 128, sms)
        shapes = [(mma[1], mma[2], mma[3], RESIDENT), (mm[1], mm[2], mm[4], RESIDENT)]
    for block_n, block_k, splits, resident in shapes:
        finest = k // (2 * splits) < max(MIN_SPLIT_K, block_k) or k_steps(k, 2 * splits, block_k)[0] == splits
        assert -(-n // block_n) * splits >= resident * sms or finest, (block_n, block_k, splits)


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
