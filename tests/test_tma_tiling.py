"""The TMA-fed product's tiling rule (kernels/tma_products.py) on the bench models' projections: the steps, stages
and K splits README's sweeps and whole-model runs chose, always within a program's shared memory. Plain Python,
but the module imports Triton."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from graphkiln.kernels.tma_products import (  # noqa: E402
    HOPPER_SHARED,
    HOPPER_SMS,
    SHARED_RESERVE,
    TMA_MIN_N,
    TMA_ROWS,
    tma_takes,
    tma_tiling,
)

PROJECTIONS = {  # (n, k) of the 1B- and 8B-like models' projections
    "1b-qkv": (3072, 2048), "1b-o": (2048, 2048), "1b-gate_up": (16384, 2048), "1b-down": (2048, 8192),
    "8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
}


@pytest.mark.parametrize("itemsize", [1, 2], ids=["fp8", "bf16"])
@pytest.mark.parametrize("rows", [2, 8, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("shape", PROJECTIONS.values(), ids=PROJECTIONS.keys())
def test_every_tiling_fits_a_programs_shared_memory(shape, rows, itemsize):
    n, k = shape
    block_m, block_n, block_k, splits, warps, stages = tma_tiling(rows, n, k, itemsize=itemsize)
    assert block_m >= rows and block_m in (16, 32, 64) and block_n == 64 and warps == 4
    assert 2 <= stages <= 6 and splits in (1, 2)
    assert (block_m + block_n) * block_k * itemsize * stages <= HOPPER_SHARED - SHARED_RESERVE
    assert tma_takes(rows, n, k, itemsize=itemsize)


@pytest.mark.parametrize("itemsize", [1, 2], ids=["fp8", "bf16"])
def test_one_row_a_row_past_the_tile_and_narrow_weights_are_not_taken(itemsize):
    """cuBLAS (or the GEMV) keeps one row, 65 rows and weights of fewer than TMA_MIN_N rows: 16-bit products of
    65-128 rows in a 128-row tile measured slower on the 8B-like model (README, "bf16 products fed by TMA")."""
    assert tma_takes(TMA_ROWS, 4096, 4096, itemsize=itemsize)
    assert not tma_takes(TMA_ROWS + 1, 4096, 4096, itemsize=itemsize)
    assert not tma_takes(1, 4096, 4096, itemsize=itemsize)
    assert not tma_takes(8, TMA_MIN_N - 64, 4096, itemsize=itemsize)


@pytest.mark.parametrize("itemsize", [1, 2], ids=["fp8", "bf16"])
def test_one_wave_of_slabs_takes_deep_steps_at_few_rows_and_many_stages_at_more(itemsize):
    """qkv, o and down of the 8B-like model are 64-96 slabs, one wave of 132 multiprocessors: up to 32 rows take
    512-byte steps 4 deep, more rows 256-byte steps 6 deep."""
    for name in ("8b-qkv", "8b-o", "8b-down"):
        n, k = PROJECTIONS[name]
        assert tma_tiling(16, n, k, itemsize=itemsize)[2:] == (512 // itemsize, 1, 4, 4), name
        assert tma_tiling(32, n, k, itemsize=itemsize)[2:] == (512 // itemsize, 1, 4, 4), name
        assert tma_tiling(64, n, k, itemsize=itemsize)[2:] == (256 // itemsize, 1, 4, 6), name


def test_several_waves_of_slabs_take_fewer_stages_so_two_programs_share_a_multiprocessor():
    n, k = PROJECTIONS["8b-gate_up"]  # 448 slabs
    for rows, stages in ((8, 4), (32, 4), (64, 3)):
        assert tma_tiling(rows, n, k)[2:] == (256, 1, 4, stages), rows


def test_few_slabs_of_long_rows_split_k_in_two():
    """The 1B-like down projection in bf16 (32 slabs, rows of 16 KiB) splits K at every row count; in fp8 its rows
    are 8 KiB and it does not, nor does a narrow weight of short rows, nor an activated product."""
    n, k = PROJECTIONS["1b-down"]
    for rows in (2, 16, 64):
        assert tma_tiling(rows, n, k, itemsize=2)[2:4] == (128, 2), rows
        assert tma_tiling(rows, n, k, itemsize=1)[3] == 1, rows
    assert tma_tiling(16, 2048, 2048, itemsize=2)[3] == 1
    assert tma_tiling(16, 4096, 8192, itemsize=2, activated=True)[3] == 1
    assert tma_tiling(16, 2048, 8192, sms=HOPPER_SMS // 2, itemsize=2)[3] == 1  # half the machine: 32 slabs fill it
