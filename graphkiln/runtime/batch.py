"""One step's batch on the host: the packed token rows of its chunks, and padding them to a size.

Every path that pads (decode and prefill graphs, the compiled forward without graphs) pads
here: padded token rows carry id 0 at position 0; a decode batch also gets one one-token
sequence per padded row, in the dummy block, since its kernels take one row per sequence. A
prefill batch's padded rows belong to no sequence (their keys and values go to the dummy slot,
`attention.metadata.padded_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .attention.metadata import SequenceSlice, pad_decode
from .scheduler import ScheduledChunk
from .transfer import upload


def is_decode(chunks: list[ScheduledChunk]) -> bool:
    """A pure decode step: one new token per sequence, each continuing a cached context."""
    return all(c.num_tokens == 1 and c.seq.num_computed > 0 for c in chunks)


@dataclass(frozen=True)
class Batch:
    ids: list[int]
    positions: list[int]
    slices: list[SequenceSlice]
    decode: bool

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def padded(self, size: int) -> Batch:
        """This batch grown to `size` token rows (unchanged when it already has that many)."""
        pad = size - len(self.ids)
        if pad < 0:
            raise ValueError(f"a batch of {len(self.ids)} tokens does not fit {size} rows")
        if pad == 0:
            return self
        slices = pad_decode(self.slices, size) if self.decode else self.slices
        return Batch(self.ids + [0] * pad, self.positions + [0] * pad, slices, self.decode)


def pack(chunks: list[ScheduledChunk]) -> Batch:
    ids: list[int] = []
    positions: list[int] = []
    slices = []
    for c in chunks:
        start = c.seq.num_computed
        ids += c.seq.tokens[start : start + c.num_tokens]
        positions += range(start, start + c.num_tokens)
        slices.append(SequenceSlice(c.num_tokens, start + c.num_tokens, tuple(c.seq.blocks)))
    return Batch(ids, positions, slices, is_decode(chunks))


class InputIds(Protocol):
    """Input ids a step's host batch does not hold: `fill` writes them into the device buffer the step reads
    (PendingIds; on a tensor-parallel rank, ids sent to or received from rank 0: lockstep.py)."""

    def fill(self, input_ids: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class PendingIds:
    """Input tokens still on the device: batch rows `targets` take the previous step's `source[rows]`."""

    source: torch.Tensor
    targets: tuple[int, ...]
    rows: tuple[int, ...]

    def fill(self, input_ids: torch.Tensor) -> None:
        """Write them into a device buffer of input ids (queued on the stream, no host sync)."""
        n = len(self.targets)
        if self.targets == self.rows == tuple(range(n)):  # steady decode: the same sequences, in order
            input_ids[:n].copy_(self.source[:n])
            return
        device = input_ids.device
        input_ids[upload(self.targets, torch.int64, device)] = self.source[upload(self.rows, torch.int64, device)]
