"""The header of a safetensors file: where each tensor's bytes are, checked against the file's size.

An 8-byte little-endian length, then that many bytes of JSON naming every tensor's dtype, shape and
data offsets (relative to the header's end); `__metadata__` is skipped. A header that does not parse,
names a dtype safetensors does not have, or points past the file's end is a ModelFileError naming
the file and what is wrong with it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from graphkiln.errors import ModelFileError

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


def corrupt(path: Path, why: str) -> ModelFileError:
    return ModelFileError(f"{path}: not a readable safetensors file ({why}); {REDOWNLOAD}")


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of a safetensors file by name, checked against the file's size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise corrupt(path, f"{size} bytes, shorter than a header")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise corrupt(path, f"header length {length} does not fit a file of {size} bytes")
            header = json.loads(f.read(length))
    except OSError as e:
        raise corrupt(path, e.strerror or str(e)) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise corrupt(path, f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise corrupt(path, "header is not a JSON object")
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
            raise corrupt(path, f"tensor {name!r} has an invalid header entry ({e!r})") from e
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise corrupt(path, f"tensor {name!r}: offsets {begin}..{end} do not hold shape {shape} of {dtype}")
        if base + end > size:
            raise corrupt(path, f"tensor {name!r} ends at byte {base + end}, past the file's end ({size} bytes)")
        entries[name] = TensorEntry(path, name, dtype, shape, base + begin, base + end)
    return entries
