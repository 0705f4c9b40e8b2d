"""Read safetensors tensors straight into their destination tensors, reading only the bytes asked for.

A file's header (8-byte length, JSON: dtype, shape, data offsets) says where each tensor's bytes
are; nothing else of the file is read until a tensor is asked for. A `TensorRead` names one
tensor and, optionally, a range of its rows and of its columns (a tensor parallel shard, say):
only those bytes are read, a row range as one contiguous span, a column range one span per row.

Reads are `os.preadv` calls on a pool of threads (they release the GIL and copy from the page
cache without faulting pages in one at a time). On the CPU a read whose dtype matches lands in
the destination's own memory; otherwise it lands in one of a few staging buffers (pinned on
CUDA) that rotate: while threads fill the next buffers, the filled ones are copied to the device
with non-blocking copies on a side stream, and an event per buffer says when it may be reused.
The destination's dtype conversion runs on the device, after the copy.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from graphkiln.errors import ModelFileError, WeightMismatchError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 << 20
REDOWNLOAD = "download it again"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in its file: absolute offsets [start, end)."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_elements(self) -> int:
        """Elements per row: the product of every dimension after the first."""
        return math.prod(self.shape[1:]) if self.shape else 1


def indexed(device: torch.device) -> torch.device:
    """`device` with the index a bare "cuda" means in this thread, for another thread to select."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _corrupt(path: Path, why: str) -> ModelFileError:
    return ModelFileError(f"{path}: not a readable safetensors file ({why}); {REDOWNLOAD}")


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of a safetensors file by name, checked against the file's size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"{size} bytes, shorter than a header")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise _corrupt(path, f"header length {length} does not fit a file of {size} bytes")
            header = json.loads(f.read(length))
    except OSError as e:
        raise _corrupt(path, e.strerror or str(e)) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _corrupt(path, f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _corrupt(path, f"tensor {name!r} has an invalid header entry ({e!r})") from e
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise _corrupt(path, f"tensor {name!r}: offsets {begin}..{end} do not hold shape {shape} of {dtype}")
        if base + end > size:
            raise _corrupt(path, f"tensor {name!r} ends at byte {base + end}, past the file's end ({size} bytes)")
        entries[name] = TensorEntry(path, name, dtype, shape, base + begin, base + end)
    return entries


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
    """What one `WeightsReader.read` moved: bytes read from files, seconds, and the rate."""

    bytes: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


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
        for r in reads:
            self._check(r)
        start = time.perf_counter()
        widest = max((r.span()[3] * r.entry.dtype.itemsize for r in reads), default=0)
        buffer_bytes = max(self.buffer_bytes, widest)
        direct = [r for r in reads if self._direct(r)]
        staged = [c for r in reads if not self._direct(r) for c in _chunks(r, buffer_bytes)]
        fds: dict[Path, int] = {}
        try:
            for path in {r.entry.path for r in reads}:
                try:
                    fds[path] = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise _corrupt(path, e.strerror or str(e)) from e
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
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as err:
            raise _corrupt(e.path, f"reading tensor {e.name!r}: {err.strerror}") from err
        if n == 0:
            raise _corrupt(e.path, f"tensor {e.name!r} ends past the file's end")
        done += n
