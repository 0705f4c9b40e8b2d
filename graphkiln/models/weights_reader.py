"""Read safetensors tensors straight into their destination tensors, reading only the bytes asked for.

A file's header (safetensors_header.py) says where each tensor's bytes are; nothing else of the
file is read until a tensor is asked for. A `TensorRead` names one
tensor and, optionally, a range of its rows and of its columns (a tensor parallel shard, say):
only those bytes are read, a row range as one contiguous span, a column range row by row.

The reads are cut into units of work of up to a staging buffer's bytes (tens of MB: many small
tensors share one, a large one spans several), which a few threads take in file order. A thread
does all of a unit itself: one `os.preadv` per run of tensors adjacent in the file (a column range:
one strided numpy copy from the file's mapping), then one call that queues the unit's copies to
the device on the thread's own stream, from the thread's own two staging buffers (pinned on CUDA),
an event saying when a buffer may be filled again. The buffers are pinned by registering their pages
and unpinned once their copies are done, not taken from torch's pinned-memory cache: freed into it,
they would stay pinned until something empties it, as every CUDA graph capture does, holding the
interpreter lock for the tenth of a second that unpinning them takes, while the engine serves. On the
CPU a read whose dtype matches lands in the destination's own memory. Each of these calls releases Python's interpreter lock for its whole
length, and the long ones (a read, a wait for a buffer) are a few per unit, not per tensor or per
megabyte: a thread taking the lock back after one waits up to the switch interval while another
thread runs Python (a load imports Inductor beside the read; switch_interval.py), so the fewer
there are, the closer the read stays to the rate of the copies themselves. The destination's dtype
conversion runs on the device, after the copy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from graphkiln.compat import copy_tensors
from graphkiln.errors import CapacityError, WeightMismatchError

from .safetensors_header import TensorEntry, corrupt

IOV_MAX = 1024  # buffers one preadv takes on Linux


def indexed(device: torch.device) -> torch.device:
    """`device` with the index a bare "cuda" means in this thread, for another thread to select, found without
    initialising CUDA: before that no thread can have chosen a device (choosing one initialises it), so it is 0."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    return device


@dataclass(frozen=True)
class TensorRead:
    """Copy `entry` (or its rows [row_start, row_stop) and columns [col_start, col_stop) of each row, the
    row being every dimension after the first, flattened) into `dest`, a contiguous tensor of that many
    elements (any dtype: converted after the read)."""

    entry: TensorEntry
    dest: torch.Tensor
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None

    def span(self) -> tuple[int, int, int, int]:
        """(first row, row count, first column, column count) of the part read."""
        r0, r1 = self.rows or (0, self.entry.rows)
        c0, c1 = self.cols or (0, self.entry.row_elements)
        return r0, r1 - r0, c0, c1 - c0



@dataclass
class ReadStats:
    """What one `WeightsReader.read` moved: bytes read from files, seconds, and the rate; the staging memory
    its threads allocated and the longest one of them spent allocating it (pinning memory on CUDA costs time)."""

    bytes: int = 0
    seconds: float = 0.0
    staging_bytes: int = 0
    staging_s: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _Piece:
    """Rows [row, row + count) of one read, and (staged) where they land in the unit's staging buffer."""

    read: TensorRead
    row: int
    count: int
    at: int = 0

    @property
    def row_bytes(self) -> int:
        return self.read.span()[3] * self.read.entry.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.count * self.row_bytes

    @property
    def whole_rows(self) -> bool:
        return self.read.span()[3] == self.read.entry.row_elements

    @property
    def offset(self) -> int:
        """Where the piece's first byte is in its file."""
        e = self.read.entry
        return e.start + (self.row * e.row_elements + self.read.span()[2]) * e.dtype.itemsize

    def dest(self) -> torch.Tensor:
        """The (flat) part of the destination these rows fill."""
        r0, _, _, ncols = self.read.span()
        return self.read.dest.view(-1)[(self.row - r0) * ncols : (self.row - r0 + self.count) * ncols]


@dataclass
class _Unit:
    """The pieces one thread reads and copies at once; `direct`: straight into their destinations."""

    pieces: list[_Piece]
    direct: bool


@dataclass
class _File:
    fd: int
    mapping: mmap.mmap | None = None  # for column ranges


class WeightsReader:
    """Reads `TensorRead`s to one device on `threads` threads, each with up to `buffers` staging buffers of
    `buffer_bytes` (fewer bytes when the reads are small; at least one row of the widest tensor)."""

    def __init__(
        self, device: torch.device, *, threads: int = 8, buffers: int = 2, buffer_bytes: int = 32 << 20
    ) -> None:
        self.device = torch.device(device)
        self.threads = threads
        self.buffers = buffers
        self.buffer_bytes = buffer_bytes

    def read(self, reads: list[TensorRead]) -> ReadStats:
        """Fill every destination; on CUDA the caller's stream waits for the copies (no host sync)."""
        for r in reads:
            self._check(r)
        if not reads:
            return ReadStats()
        start = time.perf_counter()
        total = sum(r.span()[1] * r.span()[3] * r.entry.dtype.itemsize for r in reads)
        widest = max(r.span()[3] * r.entry.dtype.itemsize for r in reads)
        unit_bytes = max(min(self.buffer_bytes, -(-total // self.threads)), widest)
        units = deque(_units(reads, unit_bytes, self._direct))
        device = indexed(self.device)
        cuda = device.type == "cuda"
        files: dict[Path, _File] = {}
        streams = []
        try:
            for path in {r.entry.path for r in reads}:
                files[path] = _open(path, any(r.entry.path == path and r.cols for r in reads))
            count = min(self.threads, len(units))
            if cuda:  # the destinations' memory may still be in use by work queued before
                streams = [torch.cuda.Stream(device) for _ in range(count)]
                for stream in streams:
                    stream.wait_stream(torch.cuda.current_stream(device))
            stop = threading.Event()
            convert = threading.Lock()  # CPU dtype conversions one at a time (each uses torch's own threads)
            with ThreadPoolExecutor(count, thread_name_prefix="graphkiln-weights") as pool:
                futures = [pool.submit(self._work, device, units, files, unit_bytes, s, convert, stop)
                           for s in streams or [None] * count]  # fmt: skip
                try:
                    wait(futures, return_when=FIRST_EXCEPTION)
                finally:  # a failed thread (or an interrupted caller) stops the others after their unit
                    stop.set()
                staging = [f.result() for f in futures]
        finally:
            for stream in streams:
                torch.cuda.current_stream(device).wait_stream(stream)
            for f in files.values():
                _close(f)
        return ReadStats(total, time.perf_counter() - start, sum(b for b, _ in staging), max(s for _, s in staging))

    def _direct(self, r: TensorRead) -> bool:
        """Read straight into the destination: on the CPU, same dtype (destinations are contiguous)."""
        return self.device.type == "cpu" and r.dest.dtype == r.entry.dtype

    def _check(self, r: TensorRead) -> None:
        e = r.entry
        r0, nrows, c0, ncols = r.span()
        if not (0 <= r0 and r0 + nrows <= e.rows and 0 <= c0 and c0 + ncols <= e.row_elements and nrows > 0 < ncols):
            raise WeightMismatchError(
                f"{e.path}: tensor {e.name!r} of shape {e.shape} has no rows {r.rows} / columns {r.cols}"
            )
        if r.dest.numel() != nrows * ncols or not r.dest.is_contiguous():
            raise WeightMismatchError(f"{e.path}: tensor {e.name!r}: destination of shape {tuple(r.dest.shape)} does not hold "
                             f"{nrows} x {ncols} elements contiguously")  # fmt: skip

    def _work(
        self, device: torch.device, units: deque[_Unit], files: dict[Path, _File], unit_bytes: int,
        stream: torch.cuda.Stream | None, convert: threading.Lock, stop: threading.Event,
    ) -> tuple[int, float]:  # fmt: skip
        """Take units until none is left (or another thread failed): read each and queue its copies. Returns the
        staging bytes this thread allocated and the seconds that took."""
        if stream is not None:
            torch.cuda.set_device(device)
            torch.cuda.set_stream(stream)
        buffers: list[torch.Tensor] = []
        done: list[torch.cuda.Event | None] = []
        staged = 0
        allocating = 0.0
        try:
            with torch.no_grad():  # this thread's grad mode: destinations are parameters
                while not stop.is_set():
                    try:
                        unit = units.popleft()
                    except IndexError:
                        break
                    if unit.direct:
                        _fill(unit, files, None)
                        continue
                    slot = staged % self.buffers
                    staged += 1
                    if slot == len(buffers):
                        t = time.perf_counter()
                        buffers.append(torch.empty(unit_bytes, dtype=torch.uint8))
                        if stream is not None:
                            _pin(buffers[-1])
                        allocating += time.perf_counter() - t
                        done.append(None)
                    elif (event := done[slot]) is not None and not event.query():
                        event.synchronize()
                    buffer = buffers[slot]
                    _fill(unit, files, buffer)
                    sources = [buffer[p.at : p.at + p.nbytes].view(p.read.entry.dtype) for p in unit.pieces]
                    dests = [p.dest() for p in unit.pieces]
                    if stream is None:
                        with convert:
                            copy_tensors(dests, sources)
                    else:
                        copy_tensors(dests, sources, non_blocking=True)
                        done[slot] = stream.record_event()
        finally:  # (a failed unit too) the copies are done before their buffers are unpinned
            if stream is not None:
                for buffer, event in zip(buffers, done):
                    if event is not None:
                        event.synchronize()
                    _unpin(buffer)
        return sum(b.numel() for b in buffers), allocating


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock a host buffer for asynchronous copies to the device (`_unpin` undoes it)."""
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    except torch.cuda.CudaError as e:
        raise CapacityError(f"pinning a {buffer.numel() >> 20} MiB staging buffer for the weights failed ({e}); "
                            "raise the locked-memory limit (ulimit -l) or free host memory") from e


def _unpin(buffer: torch.Tensor) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))


def _units(reads: list[TensorRead], unit_bytes: int, direct: Callable[[TensorRead], bool]) -> list[_Unit]:
    """The reads in file order, cut at rows into units of at most `unit_bytes` (a staged unit's pieces placed
    in its buffer at their dtype's alignment, back to back where the file has them back to back)."""
    units = []
    for is_direct in (True, False):
        pieces: list[_Piece] = []
        used = 0
        group = [r for r in reads if direct(r) == is_direct]
        for r in sorted(group, key=lambda r: (str(r.entry.path), _Piece(r, r.span()[0], 1).offset)):
            r0, nrows, _, ncols = r.span()
            item = r.entry.dtype.itemsize
            row = r0
            while row < r0 + nrows:
                at = -(-used // item) * item
                fit = (unit_bytes - at) // (ncols * item)
                if fit <= 0:
                    units.append(_Unit(pieces, is_direct))
                    pieces, used = [], 0
                    continue
                count = min(fit, r0 + nrows - row)
                pieces.append(_Piece(r, row, count, 0 if is_direct else at))
                used = at + count * ncols * item
                row += count
        if pieces:
            units.append(_Unit(pieces, is_direct))
    return units


def _fill(unit: _Unit, files: dict[Path, _File], buffer: torch.Tensor | None) -> None:
    """Read the unit's pieces into `buffer` at their places, or (None) into their destinations: one preadv per
    run of whole-row pieces that follow each other in one file (and in the buffer)."""
    run: list[_Piece] = []
    for piece in unit.pieces:
        if run and not _follows(run[-1], piece, buffer is not None):
            _read_run(run, files, buffer)
            run = []
        if piece.whole_rows:
            run.append(piece)
        else:
            target = piece.dest().view(torch.uint8) if buffer is None else buffer[piece.at : piece.at + piece.nbytes]
            _read_columns(piece, files[piece.read.entry.path], target)
    if run:
        _read_run(run, files, buffer)


def _follows(last: _Piece, piece: _Piece, staged: bool) -> bool:
    return (
        piece.whole_rows
        and piece.read.entry.path == last.read.entry.path
        and piece.offset == last.offset + last.nbytes
        and (not staged or piece.at == last.at + last.nbytes)
    )


def _read_run(run: list[_Piece], files: dict[Path, _File], buffer: torch.Tensor | None) -> None:
    fd = files[run[0].read.entry.path].fd
    if buffer is not None:
        first, last = run[0], run[-1]
        _preadv_exactly(fd, [_bytes(buffer[first.at : last.at + last.nbytes])], first.offset, run)
        return
    for i in range(0, len(run), IOV_MAX):
        part = run[i : i + IOV_MAX]
        _preadv_exactly(fd, [_bytes(p.dest().view(torch.uint8)) for p in part], part[0].offset, part)


def _read_columns(piece: _Piece, file: _File, target: torch.Tensor) -> None:
    """Columns of the piece's rows, one strided copy from the file's mapping (it releases the interpreter lock)."""
    e = piece.read.entry
    item = e.dtype.itemsize
    row_bytes = e.row_elements * item
    first = e.start + piece.row * row_bytes
    end = first + piece.count * row_bytes
    if end > len(file.mapping):
        raise corrupt(e.path, f"tensor {e.name!r} ends past the file's end")
    rows = np.frombuffer(file.mapping, np.uint8, end - first, first).reshape(piece.count, row_bytes)
    c0 = piece.read.span()[2] * item
    np.copyto(target.numpy().reshape(piece.count, piece.row_bytes), rows[:, c0 : c0 + piece.row_bytes])


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _preadv_exactly(fd: int, views: list[memoryview], offset: int, pieces: list[_Piece]) -> None:
    """Fill `views` from the file's bytes at `offset` on (the pieces they hold name the tensor at fault)."""
    done = 0
    while views:
        try:
            n = os.preadv(fd, views, offset + done)
        except OSError as err:
            at = _at(pieces, done)
            raise corrupt(at.path, f"reading tensor {at.name!r}: {err.strerror}") from err
        if n == 0:
            at = _at(pieces, done)
            raise corrupt(at.path, f"tensor {at.name!r} ends past the file's end")
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views:
            views[0] = views[0][n:]


def _at(pieces: list[_Piece], done: int) -> TensorEntry:
    """The tensor whose bytes are `done` bytes into a run of pieces."""
    for p in pieces:
        if done < p.nbytes:
            return p.read.entry
        done -= p.nbytes
    return pieces[-1].read.entry


def _open(path: Path, mapped: bool) -> _File:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise corrupt(path, e.strerror or str(e)) from e
    try:
        return _File(fd, mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if mapped else None)
    except (OSError, ValueError) as e:
        os.close(fd)
        raise corrupt(path, str(e)) from e


def _close(file: _File) -> None:
    os.close(file.fd)
    if file.mapping is not None:
        with contextlib.suppress(BufferError):  # a view still held by a failed read's traceback: freed with it
            file.mapping.close()
