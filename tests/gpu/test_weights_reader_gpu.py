"""The weights reader to a CUDA device: whole tensors, many small ones, row and column ranges and conversions
against safetensors' own reader; the caller's stream waits for the copies, and they wait for the work the
caller's stream had queued on the destinations before."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphkiln.models.safetensors_header import read_header
from graphkiln.models.weights_reader import TensorRead, WeightsReader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL = dict(threads=3, buffers=2, buffer_bytes=4096)


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {f"small.{i}": torch.randn(1 + i % 9, 3, generator=g).to(torch.bfloat16) for i in range(100)}
    tensors.update(
        big=torch.randn(1024, 1000, generator=g).to(torch.bfloat16),
        cube=torch.randn(6, 10, 7, generator=g),
        half=torch.randn(333, generator=g).to(torch.float16),
        ids=torch.arange(17, dtype=torch.int64),
    )
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("options", [{}, SMALL], ids=["default", "small-buffers"])
def test_reads_match_safetensors(weights: Path, options: dict) -> None:
    expected = load_file(str(weights))
    entries = read_header(weights)
    big, cube = expected["big"], expected["cube"].reshape(6, 70)
    cases = [(entries[n], None, None, t, t.dtype) for n, t in expected.items()]
    cases += [
        (entries["big"], (100, 900), None, big[100:900], torch.float32),
        (entries["big"], None, (500, 1000), big[:, 500:], torch.bfloat16),
        (entries["big"], (3, 1000), (1, 333), big[3:1000, 1:333], torch.float16),
        (entries["cube"], (1, 5), (7, 63), cube[1:5, 7:63], torch.bfloat16),
        (entries["half"], (10, 300), None, expected["half"][10:300], torch.float32),
    ]
    reads = [TensorRead(e, torch.full(want.shape, 7, dtype=dtype, device="cuda"), rows, cols)
             for e, rows, cols, want, dtype in cases]  # fmt: skip
    stats = WeightsReader(torch.device("cuda"), **options).read(reads)
    for read, (e, rows, cols, want, dtype) in zip(reads, cases):
        assert torch.equal(read.dest.cpu(), want.to(dtype)), (e.name, rows, cols, dtype)
    assert stats.bytes == sum(want.numel() * want.element_size() for *_, want, _ in cases)


def test_streams_wait_for_each_other(weights: Path) -> None:
    """On a side stream of the caller: the destination's earlier readers finish before it is overwritten, and
    work queued after `read` sees the new values, with no synchronisation by the test in between."""
    expected = load_file(str(weights))["big"]
    entry = read_header(weights)["big"]
    caller = torch.cuda.Stream()
    dest = torch.zeros(1024, 1000, dtype=torch.bfloat16, device="cuda")
    slow = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(caller):
        for _ in range(30):  # queued work that keeps the stream busy before it reads the old values
            slow = slow @ slow / 64
        before = dest.float().sum()
        WeightsReader(torch.device("cuda"), **SMALL).read([TensorRead(entry, dest)])
        after = dest.clone()
    torch.cuda.synchronize()
    assert before.item() == 0
    assert torch.equal(after.cpu(), expected)


def test_read_beside_a_thread_running_python(weights: Path) -> None:
    """Correct bytes while another thread holds the interpreter lock whenever the readers let go of it."""
    expected = load_file(str(weights))
    entries = read_header(weights)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    busy = threading.Thread(target=spin)
    busy.start()
    try:
        dests = {n: torch.empty(t.shape, dtype=torch.float32, device="cuda") for n, t in expected.items()}
        WeightsReader(torch.device("cuda")).read([TensorRead(entries[n], d) for n, d in dests.items()])
        torch.cuda.synchronize()
    finally:
        stop.set()
        busy.join()
    for name, t in expected.items():
        assert torch.equal(dests[name].cpu(), t.float()), name
