"""The weights reader against safetensors' own reader: whole tensors, row and column slices, dtype conversion,
many small tensors sharing a unit of work, tensors larger than a staging buffer, several files at once, and
corrupt or truncated files refused naming the file and the tensor."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphkiln.errors import ModelFileError, WeightMismatchError
from graphkiln.models.safetensors_header import read_header
from graphkiln.models.weights_reader import TensorRead, WeightsReader


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "wide": torch.randn(37, 129, generator=g).to(torch.bfloat16),
        "cube": torch.randn(5, 6, 7, generator=g),
        "norm": torch.randn(300, generator=g).to(torch.float16),
        "ids": torch.arange(11, dtype=torch.int64),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


# Small buffers, so one tensor spans several of them and every buffer is reused.
SMALL = dict(threads=3, buffers=2, buffer_bytes=512)


@pytest.mark.parametrize("options", [{}, SMALL], ids=["default", "small-buffers"])
def test_whole_tensors_match_safetensors(weights: Path, options: dict) -> None:
    expected = load_file(str(weights))
    entries = read_header(weights)
    assert set(entries) == set(expected)
    dests = {name: torch.empty_like(t) for name, t in expected.items()}
    stats = WeightsReader(torch.device("cpu"), **options).read([TensorRead(entries[n], d) for n, d in dests.items()])
    for name, t in expected.items():
        assert torch.equal(dests[name], t), name
    assert stats.bytes == sum(t.numel() * t.element_size() for t in expected.values())


@pytest.mark.parametrize("options", [{}, SMALL], ids=["default", "small-buffers"])
def test_slices_and_conversion(weights: Path, options: dict) -> None:
    """Rows, columns (of the flattened trailing dims), both, and a dtype change on the way."""
    expected = load_file(str(weights))
    entries = read_header(weights)
    reader = WeightsReader(torch.device("cpu"), **options)
    wide = expected["wide"]
    cases = [
        (entries["wide"], (3, 20), None, wide[3:20]),
        (entries["wide"], None, (64, 129), wide[:, 64:]),
        (entries["wide"], (30, 37), (1, 9), wide[30:, 1:9]),
        (entries["cube"], (1, 4), (7, 30), expected["cube"].reshape(5, 42)[1:4, 7:30]),
        (entries["norm"], (100, 250), None, expected["norm"][100:250]),
    ]
    for entry, rows, cols, want in cases:
        for dtype in (want.dtype, torch.float32):
            dest = torch.empty(want.shape, dtype=dtype)
            stats = reader.read([TensorRead(entry, dest, rows, cols)])
            assert torch.equal(dest, want.to(dtype)), (entry.name, rows, cols, dtype)
            assert stats.bytes == want.numel() * want.element_size()


def test_slice_outside_the_tensor(weights: Path) -> None:
    entry = read_header(weights)["wide"]
    with pytest.raises(WeightMismatchError, match="'wide'.*rows \\(30, 40\\)"):
        WeightsReader(torch.device("cpu")).read([TensorRead(entry, torch.empty(10, 129), (30, 40))])


def test_truncated_file(weights: Path) -> None:
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ModelFileError, match=re.escape(str(weights)) + ".*past the file's end"):
        read_header(weights)


@pytest.mark.parametrize("header", [b"\xff" * 20, b"[1, 2]", json.dumps({"t": {"dtype": "F32", "shape": [2],
                                                                                 "data_offsets": [0, 4]}}).encode()])
def test_corrupt_headers(tmp_path: Path, header: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ModelFileError, match=re.escape(str(path)) + ": not a readable safetensors file"):
        read_header(path)


def test_header_length_beyond_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelFileError, match="header length"):
        read_header(path)


def _many_small(tmp_path: Path, name: str = "small.safetensors", seed: int = 1) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8)
    tensors = {}
    for i in range(150):
        shape = [(1 + i % 7,), (3, 1 + i % 5), (), (2, 3, 1 + i % 3)][i % 4]
        t = torch.randn(shape, generator=g) * 100
        tensors[f"t{i}"] = t.to(dtypes[i % len(dtypes)])
    path = tmp_path / name
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("options", [{}, SMALL, dict(threads=1, buffers=1, buffer_bytes=64)],
                         ids=["default", "small-buffers", "one-thread-one-buffer"])  # fmt: skip
@pytest.mark.parametrize("convert", [False, True], ids=["same-dtype", "to-float64"])
def test_many_small_tensors(tmp_path: Path, options: dict, convert: bool) -> None:
    """150 tensors of five dtypes (scalars among them), most far smaller than a unit: read in one call."""
    path, tensors = _many_small(tmp_path)
    entries = read_header(path)
    dests = {n: torch.empty(t.shape, dtype=torch.float64 if convert else t.dtype) for n, t in tensors.items()}
    stats = WeightsReader(torch.device("cpu"), **options).read([TensorRead(entries[n], d) for n, d in dests.items()])
    for name, t in tensors.items():
        assert torch.equal(dests[name], t.to(dests[name].dtype)), name
    assert stats.bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_small_tensors_adjacent_in_the_file_share_one_read_call(tmp_path: Path, monkeypatch) -> None:
    """Tensors that follow each other in the file are read by one preadv per unit of work, not one per tensor:
    each call is a release and a new acquisition of the interpreter lock."""
    path, tensors = _many_small(tmp_path)
    entries = read_header(path)
    calls = []
    preadv = os.preadv

    def counted(fd, buffers, offset):
        calls.append(len(buffers))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    for dtype in (None, torch.float64):  # straight into the destinations, then through staging buffers
        calls.clear()
        dests = {n: torch.empty(t.shape, dtype=dtype or t.dtype) for n, t in tensors.items()}
        WeightsReader(torch.device("cpu"), threads=4).read([TensorRead(entries[n], d) for n, d in dests.items()])
        assert 1 <= len(calls) <= 4 + 4, calls  # a unit per thread, plus where dtype alignment breaks a run
        assert all(torch.equal(dests[n], t.to(dests[n].dtype)) for n, t in tensors.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tensor_larger_than_a_buffer_and_a_row_larger_than_one(weights: Path, dtype: torch.dtype) -> None:
    """A buffer smaller than one row grows to a row; a tensor of many rows spans many buffers and units."""
    expected = load_file(str(weights))
    entries = read_header(weights)
    for buffer_bytes in (16, 300, 1000):
        reader = WeightsReader(torch.device("cpu"), threads=3, buffers=2, buffer_bytes=buffer_bytes)
        dest = torch.empty(37, 129, dtype=dtype)
        cols = torch.empty(37, 100, dtype=dtype)
        stats = reader.read([TensorRead(entries["wide"], dest), TensorRead(entries["wide"], cols, cols=(29, 129))])
        assert torch.equal(dest, expected["wide"].to(dtype)), buffer_bytes
        assert torch.equal(cols, expected["wide"][:, 29:].to(dtype)), buffer_bytes
        assert stats.bytes == 37 * 229 * 2


@pytest.mark.parametrize("options", [{}, SMALL], ids=["default", "small-buffers"])
def test_slices_of_several_files_in_one_read(weights: Path, tmp_path: Path, options: dict) -> None:
    """Row and column ranges, whole tensors and conversions of two files, all in one call (as a tensor-parallel
    rank reads them)."""
    expected = load_file(str(weights))
    small_path, small = _many_small(tmp_path)
    entries, small_entries = read_header(weights), read_header(small_path)
    cube = expected["cube"].reshape(5, 42)
    cases = [
        (entries["wide"], (3, 20), None, expected["wide"][3:20], torch.float32),
        (entries["wide"], None, (64, 129), expected["wide"][:, 64:], torch.bfloat16),
        (entries["wide"], (30, 37), (1, 9), expected["wide"][30:, 1:9], torch.float16),
        (entries["cube"], (1, 4), (7, 30), cube[1:4, 7:30], torch.float32),
        (entries["cube"], None, (0, 21), cube[:, :21], torch.float64),
        (entries["norm"], (100, 250), None, expected["norm"][100:250], torch.float16),
        (small_entries["t1"], (1, 3), (1, 2), small["t1"][1:3, 1:2], torch.float32),
        *[(small_entries[n], None, None, t, t.dtype) for n, t in small.items()],
    ]
    reads = [TensorRead(entry, torch.empty(want.shape, dtype=dtype), rows, cols)
             for entry, rows, cols, want, dtype in cases]  # fmt: skip
    stats = WeightsReader(torch.device("cpu"), **options).read(reads)
    for read, (entry, rows, cols, want, dtype) in zip(reads, cases):
        assert torch.equal(read.dest, want.to(dtype)), (entry.name, rows, cols, dtype)
    assert stats.bytes == sum(want.numel() * want.element_size() for *_, want, _ in cases)


@pytest.mark.parametrize("cols", [None, (1, 100)], ids=["whole-rows", "columns"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["direct", "staged"])
def test_file_truncated_after_its_header_was_read(weights: Path, cols, dtype: torch.dtype) -> None:
    """A file cut short between reading its header and reading its tensors: an error naming file and tensor."""
    entries = read_header(weights)
    entry = entries["wide"]
    with open(weights, "r+b") as f:
        f.truncate(entry.start + 10 * 129 * 2)  # 10 of its 37 rows left
    dest = torch.empty(37 * (99 if cols else 129), dtype=dtype)
    with pytest.raises(ModelFileError, match=re.escape(str(weights)) + ".*'wide' ends past the file's end"):
        WeightsReader(torch.device("cpu"), **SMALL).read([TensorRead(entry, dest, None, cols)])


def test_missing_file_names_it(weights: Path) -> None:
    entry = read_header(weights)["wide"]
    weights.unlink()
    with pytest.raises(ModelFileError, match=re.escape(str(weights))):
        WeightsReader(torch.device("cpu")).read([TensorRead(entry, torch.empty(37, 129, dtype=torch.bfloat16))])


def test_nothing_to_read() -> None:
    assert WeightsReader(torch.device("cpu")).read([]).bytes == 0
