"""A cheap identity of a model directory: config.json's and the tokenizer files' hashes, and each weight
file's name, size and header hash.

Reading only safetensors headers keeps it fast for multi-GB checkpoints while still catching a
swapped, re-saved, truncated or resized weight file.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from graphkiln.errors import ModelFileError

from .loader import check_model_dir, weight_files
from .tokenizer import tokenizer_files


def _header_sha256(path: Path) -> str:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFileError(f"{path}: shorter than a safetensors header; download it again")
        (length,) = struct.unpack("<Q", raw)
        header = f.read(length)
        if len(header) != length:
            raise ModelFileError(f"{path}: truncated safetensors header; download it again")
    return hashlib.sha256(header).hexdigest()


def model_fingerprint(model_dir: Path) -> dict:
    config = check_model_dir(model_dir) / "config.json"
    if not config.is_file():
        raise ModelFileError(f"{config}: missing; a Hugging Face model directory needs config.json")
    files = sorted(set(weight_files(model_dir).values()))
    return {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
        "weights": [
            {"file": p.name, "size": p.stat().st_size, "header_sha256": _header_sha256(p)} for p in files
        ],
        "tokenizer_files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tokenizer_files(model_dir)},
    }
