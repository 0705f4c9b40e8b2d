"""The weights reader against safetensors' own reader: whole tensors, row and column slices, dtype conversion,
and corrupt files refused naming the file."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphkiln.errors import ModelFileError, WeightMismatchError
from graphkiln.models.weights_reader import TensorRead, WeightsReader, read_header


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
