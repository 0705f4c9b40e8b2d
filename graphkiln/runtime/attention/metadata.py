"""Batch metadata every attention backend plans from: lengths, block tables and slot mapping."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from graphkiln.runtime.kv_cache import DUMMY_BLOCK
from graphkiln.runtime.transfer import upload


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a batch: `query_len` new tokens ending at context length `seq_len`."""

    query_len: int
    seq_len: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class BatchMetadata:
    """Host lists for planning plus device tensors for kernels. Rows past `num_tokens` are padding."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_tokens: int
    block_size: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens_t: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_padded_tokens]
    graph: str | None = None  # "decode" or "prefill": views of that captured graph's buffers (see base.py)
    long_prefill: bool = False  # a step the runner runs outside graphs for its attention work (base.py)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def decode(self) -> bool:
        """Plan with the decode kernel: in a decode graph, or outside graphs when every sequence adds
        exactly one token (padded decode rows included). A prefill graph's batch never is."""
        if self.graph is not None:
            return self.graph == "decode"
        return all(q == 1 for q in self.query_lens)


def attention_work(query_lens: Iterable[int], seq_lens: Iterable[int]) -> int:
    """The (query token, context token) pairs a step's attention scores, causal masking aside: its work grows
    with this, whatever the split into sequences (runtime/attention/long_prefill.py)."""
    return sum(q * s for q, s in zip(query_lens, seq_lens, strict=True))


def pad_decode(slices: list[SequenceSlice], batch_size: int) -> list[SequenceSlice]:
    """Fill a decode batch up to `batch_size` with one-token sequences that live in the dummy block."""
    return slices + [SequenceSlice(1, 1, (DUMMY_BLOCK,))] * (batch_size - len(slices))


def padded_slots(slices: list[SequenceSlice], block_size: int, rows: int) -> list[int]:
    """The KV cache slot of every new token, in batch order, then the dummy slot up to `rows` (prefill
    padding: rows that belong to no sequence)."""
    slots = []
    for s in slices:
        for pos in range(s.seq_len - s.query_len, s.seq_len):
            slots.append(s.blocks[pos // block_size] * block_size + pos % block_size)
    if rows < len(slots):
        raise ValueError(f"{rows} rows do not hold the {len(slots)} tokens of the batch")
    return slots + [DUMMY_BLOCK * block_size] * (rows - len(slots))


def build_metadata(
    slices: list[SequenceSlice], block_size: int, num_padded_tokens: int, device: torch.device,
    long_prefill: bool = False,
) -> BatchMetadata:
    """Pack sequences in order; token rows past the sequences (prefill padding) map to the dummy slot."""
    query_lens = tuple(s.query_len for s in slices)
    seq_lens = tuple(s.seq_len for s in slices)
    slots = padded_slots(slices, block_size, num_padded_tokens)
    width = max((len(s.blocks) for s in slices), default=1)
    tables = [list(s.blocks) + [DUMMY_BLOCK] * (width - len(s.blocks)) for s in slices]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)

    return BatchMetadata(
        query_lens=query_lens,
        seq_lens=seq_lens,
        num_tokens=sum(query_lens),
        block_size=block_size,
        query_start_loc=upload(starts, torch.int32, device),
        seq_lens_t=upload(list(seq_lens), torch.int32, device),
        block_tables=upload(tables, torch.int32, device),
        slot_mapping=upload(slots, torch.int64, device),
        long_prefill=long_prefill,
    )
