"""The fixed device buffers a captured CUDA graph reads its batch from, refilled before every replay.

Sized once (tokens, sequences, block-table width), they hold token ids, positions, slot mapping,
sequence lengths, query start offsets and block tables. The first five are views of one packed
buffer, so `fill` sends them in one asynchronous copy from a pinned twin; block tables have their
own, sent only when the rows a batch uses changed since the last send (a decode step's tables
change once a block fills). Token rows past the batch go to the dummy slot. Each copy is a stream
operation of its own between graph replays, which is why there are few. The engine launches a
step before the previous one ran, so `staging_turn()` waits for the previous fill's copies (an
event recorded after them) before the staging buffers are rewritten.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from .attention.metadata import BatchMetadata, padded_slots
from .batch import Batch
from .kv_cache import DUMMY_BLOCK

ALIGN = 8  # int64 words: every packed field starts on a 64-byte boundary, as a buffer of its own would


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def packed_layout(max_tokens: int, max_seqs: int) -> tuple[int, int, int]:
    """(int64 words a token field spans, where query_start_loc starts among the int32 sequence fields,
    int64 words in all)."""
    row = _round_up(max_tokens, ALIGN)
    starts = _round_up(max_seqs, 2 * ALIGN)
    return row, starts, 3 * row + _round_up(starts + max_seqs + 1, 2) // 2


def packed_fields(packed: torch.Tensor, max_tokens: int, max_seqs: int) -> tuple[torch.Tensor, ...]:
    """Views of one int64 buffer: input_ids, positions, slot_mapping (int64 [max_tokens]), seq_lens
    (int32 [max_seqs]), query_start_loc (int32 [max_seqs + 1])."""
    row, starts, _ = packed_layout(max_tokens, max_seqs)
    ints = packed[3 * row :].view(torch.int32)
    return (packed[:max_tokens], packed[row : row + max_tokens], packed[2 * row : 2 * row + max_tokens],
            ints[:max_seqs], ints[starts : starts + max_seqs + 1])  # fmt: skip


class StaticBatch:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.cuda = device.type == "cuda"
        self.packed = torch.zeros(packed_layout(max_tokens, max_seqs)[2], dtype=torch.int64, device=device)
        fields = packed_fields(self.packed, max_tokens, max_seqs)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.query_start_loc = fields
        self.slot_mapping.fill_(DUMMY_BLOCK * block_size)
        self.seq_lens.fill_(1)
        self.query_start_loc.copy_(torch.arange(max_seqs + 1, dtype=torch.int32))
        self.block_tables = torch.full((max_seqs, max_blocks), DUMMY_BLOCK, dtype=torch.int32, device=device)
        self.packed_staging = self.pinned_like(self.packed)
        self.packed_staging.copy_(self.packed)
        self.tables_staging = self.pinned_like(self.block_tables)
        self.tables_staging.copy_(self.block_tables)
        self._host_fields = tuple(t.numpy() for t in packed_fields(self.packed_staging, max_tokens, max_seqs))
        self._host_tables = self.tables_staging.numpy()
        self._tables_sent = np.empty((0, max_blocks), dtype=np.int32)  # the rows the device got last
        self._staged: torch.cuda.Event | None = None

    @property
    def max_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def pinned_like(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.zeros_like(tensor, device="cpu")
        return host.pin_memory() if self.cuda else host

    def metadata(
        self, graph: str, tokens: int, seqs: int, query_lens: tuple[int, ...], seq_lens: tuple[int, ...]
    ) -> BatchMetadata:
        """Views for `tokens` token rows and `seqs` sequence rows, fed to a `graph` ("decode" or "prefill")
        graph; the host tuples describe the batch."""
        return BatchMetadata(
            query_lens=query_lens,
            seq_lens=seq_lens,
            num_tokens=sum(query_lens),
            block_size=self.block_size,
            query_start_loc=self.query_start_loc[: seqs + 1],
            seq_lens_t=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            slot_mapping=self.slot_mapping[:tokens],
            graph=graph,
        )

    @contextlib.contextmanager
    def staging_turn(self) -> Iterator[None]:
        """Rewrite pinned staging buffers (these or the caller's) only once the last turn's copies ran."""
        if self._staged is not None:
            self._staged.synchronize()
        yield
        if self.cuda:
            self._staged = torch.cuda.Event()
            self._staged.record()

    def fill(self, graph: str, batch: Batch, seqs: int) -> BatchMetadata:
        """Copy one batch, already padded to the graph's token rows (`Batch.padded`), in (call inside
        `staging_turn`) and return its metadata for a `graph` graph over those rows and `seqs` sequence
        rows. Sequence rows past the batch keep what the buffers hold there; kernels never read them."""
        tokens, count = batch.num_tokens, len(batch.slices)
        host_ids, host_positions, host_slots, host_lens, starts = self._host_fields
        host_ids[:tokens] = batch.ids
        host_positions[:tokens] = batch.positions
        host_slots[:tokens] = padded_slots(batch.slices, self.block_size, tokens)
        query_lens = tuple(s.query_len for s in batch.slices)
        seq_lens = tuple(s.seq_len for s in batch.slices)
        host_lens[:count] = seq_lens
        starts[0] = 0
        starts[1 : count + 1] = query_lens
        starts[: count + 1].cumsum(out=starts[: count + 1])
        width = max(len(s.blocks) for s in batch.slices)
        tables = self._host_tables
        tables[:count, :width] = DUMMY_BLOCK
        for row, s in enumerate(batch.slices):
            tables[row, : len(s.blocks)] = s.blocks
        self.packed.copy_(self.packed_staging, non_blocking=True)
        sent = self._tables_sent
        if count > sent.shape[0] or not np.array_equal(sent[:count], tables[:count]):
            self.block_tables[:count].copy_(self.tables_staging[:count], non_blocking=True)
            self._tables_sent = tables[:count].copy()
        return self.metadata(graph, tokens, seqs, query_lens, seq_lens)
