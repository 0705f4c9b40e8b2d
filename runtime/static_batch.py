"""The fixed device buffers a captured CUDA graph reads its batch from, refilled before every replay.

Sized once (tokens, sequences, block-table width), they hold token ids, positions, slot mapping,
sequence lengths, query start offsets and block tables. `fill` writes a batch through pinned
staging buffers, one asynchronous copy per field; token rows past the batch go to the dummy slot.
The engine launches a step before the previous one ran, so `staging()` waits for the previous
fill's copies (an event recorded after them) before the staging buffers are rewritten.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .attention.metadata import BatchMetadata, SequenceSlice, slot_list
from .kv_cache import DUMMY_BLOCK


class StaticBatch:
    FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables")

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), DUMMY_BLOCK * block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_seqs, max_blocks), DUMMY_BLOCK, dtype=torch.int32, device=device)
        self.cuda = device.type == "cuda"
        self.staging = {name: self.pinned_like(getattr(self, name)) for name in self.FIELDS}
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

    def fill(
        self, graph: str, ids: list[int], positions: list[int], slices: list[SequenceSlice], tokens: int, seqs: int
    ) -> BatchMetadata:
        """Copy one batch in (call inside `staging_turn`) and return its metadata for a `graph` graph over
        `tokens` rows and `seqs` sequence rows. Sequence rows past the batch keep what they held; kernels
        never read them."""
        n, count = len(ids), len(slices)
        host = {name: t.numpy() for name, t in self.staging.items()}
        host["input_ids"][:tokens] = ids + [0] * (tokens - n)
        host["positions"][:tokens] = positions + [0] * (tokens - n)
        host["slot_mapping"][:tokens] = slot_list(slices, self.block_size) + [DUMMY_BLOCK * self.block_size] * (tokens - n)
        query_lens = tuple(s.query_len for s in slices)
        seq_lens = tuple(s.seq_len for s in slices)
        host["seq_lens"][:count] = seq_lens
        starts = host["query_start_loc"]
        starts[0] = 0
        starts[1 : count + 1] = query_lens
        starts[: count + 1].cumsum(out=starts[: count + 1])
        width = max(len(s.blocks) for s in slices)
        tables = host["block_tables"]
        tables[:count, :width] = DUMMY_BLOCK
        for row, s in enumerate(slices):
            tables[row, : len(s.blocks)] = s.blocks
        for name, rows in (("input_ids", tokens), ("positions", tokens), ("slot_mapping", tokens), ("seq_lens", count)):
            getattr(self, name)[:rows].copy_(self.staging[name][:rows], non_blocking=True)
        self.query_start_loc[: count + 1].copy_(self.staging["query_start_loc"][: count + 1], non_blocking=True)
        self.block_tables[:count, :width].copy_(self.staging["block_tables"][:count, :width], non_blocking=True)
        return self.metadata(graph, tokens, seqs, query_lens, seq_lens)
