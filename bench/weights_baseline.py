"""The weights reader as it was before each reading thread did its own copies: a coordinator thread hands
32 MB chunks to a thread pool, waits for each, and copies it to the device from rotating pinned buffers on a
side stream. Kept as the baseline `python -m bench weights` measures the reader against (`--ways baseline`).
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from graphkiln.models.safetensors_header import TensorEntry
from graphkiln.models.weights_reader import ReadStats, TensorRead


@dataclass
class _Chunk:
    """Rows [row, row + count) of one read: what one staging buffer (or one direct read) holds."""

    read: TensorRead
    row: int
    count: int


class WeightsReader:
    """Reads `TensorRead`s to one device with `threads` reading threads and `buffers` staging buffers of
    `buffer_bytes` each (a buffer grows to hold one row of the widest tensor)."""

    def __init__(
        self, device: torch.device, *, threads: int = 8, buffers: int = 8, buffer_bytes: int = 32 << 20
    ) -> None:
        self.device = torch.device(device)
        self.threads = threads
        self.buffers = buffers
        self.buffer_bytes = buffer_bytes

    def read(self, reads: list[TensorRead]) -> ReadStats:
        """Fill every destination; on CUDA the caller's stream waits for the copies (no host sync)."""
        start = time.perf_counter()
        widest = max((r.span()[3] * r.entry.dtype.itemsize for r in reads), default=0)
        buffer_bytes = max(self.buffer_bytes, widest)
        direct = [r for r in reads if self._direct(r)]
        staged = [c for r in reads if not self._direct(r) for c in _chunks(r, buffer_bytes)]
        fds: dict[Path, int] = {}
        try:
            for path in {r.entry.path for r in reads}:
                fds[path] = os.open(path, os.O_RDONLY)
            with ThreadPoolExecutor(self.threads, thread_name_prefix="graphkiln-weights") as pool:
                futures = [pool.submit(_read_into, fds, c, _flat_bytes(c.read.dest, c, c.read.span()[3]))
                           for r in direct for c in _chunks(r, buffer_bytes)]  # fmt: skip
                self._staged(pool, fds, staged, buffer_bytes)
                for f in futures:
                    f.result()
        finally:
            for fd in fds.values():
                os.close(fd)
        total = sum(r.span()[1] * r.span()[3] * r.entry.dtype.itemsize for r in reads)
        return ReadStats(total, time.perf_counter() - start)

    def _direct(self, r: TensorRead) -> bool:
        """Read straight into the destination: on the CPU, same dtype, contiguous."""
        return self.device.type == "cpu" and r.dest.dtype == r.entry.dtype and r.dest.is_contiguous()

    def _staged(self, pool: ThreadPoolExecutor, fds: dict[Path, int], chunks: list[_Chunk], buffer_bytes: int) -> None:
        """Reads into rotating staging buffers, each filled buffer copied to the destination as it is ready."""
        if not chunks:
            return
        cuda = self.device.type == "cuda"
        count = min(self.buffers, len(chunks))
        staging = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(count)]
        stream = torch.cuda.Stream(self.device) if cuda else None
        if stream is not None:  # the destinations' memory may still be in use by work queued before
            stream.wait_stream(torch.cuda.current_stream(self.device))
        done: list[torch.cuda.Event | None] = [None] * count
        queued: deque[tuple[Future, int, _Chunk]] = deque()

        def land(future: Future, slot: int, chunk: _Chunk) -> None:
            future.result()
            r0, _, _, ncols = chunk.read.span()
            n = chunk.count * ncols
            src = staging[slot][: n * chunk.read.entry.dtype.itemsize].view(chunk.read.entry.dtype)
            dest = chunk.read.dest.view(-1)[(chunk.row - r0) * ncols : (chunk.row - r0) * ncols + n]
            if stream is None:
                dest.copy_(src)
                return
            with torch.cuda.stream(stream):
                if dest.dtype == src.dtype:
                    dest.copy_(src, non_blocking=True)
                else:
                    dest.copy_(src.to(self.device, non_blocking=True))
                done[slot] = torch.cuda.Event()
                done[slot].record(stream)

        for i, chunk in enumerate(chunks):
            slot = i % count
            if len(queued) == count:
                land(*queued.popleft())
            if done[slot] is not None:
                done[slot].synchronize()
            r0, _, _, ncols = chunk.read.span()
            target = staging[slot][: chunk.count * ncols * chunk.read.entry.dtype.itemsize]
            queued.append((pool.submit(_read_into, fds, chunk, target), slot, chunk))
        while queued:
            land(*queued.popleft())
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)


def _chunks(r: TensorRead, buffer_bytes: int) -> list[_Chunk]:
    r0, nrows, _, ncols = r.span()
    per = max(1, buffer_bytes // (ncols * r.entry.dtype.itemsize))
    return [_Chunk(r, row, min(per, r0 + nrows - row)) for row in range(r0, r0 + nrows, per)]


def _flat_bytes(dest: torch.Tensor, chunk: _Chunk, ncols: int) -> torch.Tensor:
    """The bytes of `dest` that chunk's rows fill (dest contiguous, same dtype as the file)."""
    r0 = chunk.read.span()[0]
    flat = dest.view(-1)[(chunk.row - r0) * ncols : (chunk.row - r0 + chunk.count) * ncols]
    return flat.view(torch.uint8) if flat.numel() else flat


def _read_into(fds: dict[Path, int], chunk: _Chunk, target: torch.Tensor) -> None:
    """pread the chunk's rows (their columns) into the contiguous byte tensor `target`."""
    e = chunk.read.entry
    _, _, c0, ncols = chunk.read.span()
    item = e.dtype.itemsize
    row_bytes, part = e.row_elements * item, ncols * item
    view = memoryview(target.numpy()).cast("B")
    fd = fds[e.path]
    if ncols == e.row_elements:  # whole rows: one contiguous span
        _pread_exactly(fd, view, e.start + chunk.row * row_bytes, e)
        return
    for i in range(chunk.count):
        _pread_exactly(fd, view[i * part : (i + 1) * part], e.start + (chunk.row + i) * row_bytes + c0 * item, e)


def _pread_exactly(fd: int, view: memoryview, offset: int, e: TensorEntry) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"{e.path}: tensor {e.name!r} ends past the file's end")
        done += n
