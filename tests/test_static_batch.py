"""StaticBatch (the buffers captured graphs read) and the dummy batch prefill graphs are captured with, on the CPU."""

from __future__ import annotations

import torch

from graphkiln.runtime.attention.metadata import SequenceSlice, build_metadata, pad_decode
from graphkiln.runtime.batch import Batch
from graphkiln.runtime.kv_cache import DUMMY_BLOCK
from graphkiln.runtime.prefill_graphs import dummy_slices
from graphkiln.runtime.static_batch import StaticBatch

CPU = torch.device("cpu")
BLOCK = 16


def fill(batch: StaticBatch, slices: list[SequenceSlice], tokens: int, seqs: int, graph: str = "prefill"):
    ids = list(range(100, 100 + sum(s.query_len for s in slices)))
    positions = [p for s in slices for p in range(s.seq_len - s.query_len, s.seq_len)]
    rows = Batch(ids, positions, slices, decode=graph == "decode").padded(tokens)
    with batch.staging_turn():
        return batch.fill(graph, rows, seqs), ids, positions


def test_fill_matches_build_metadata_with_padding_to_the_dummy_slot() -> None:
    batch = StaticBatch(64, 8, 10, BLOCK, CPU)
    slices = [SequenceSlice(15, 15, (7,)), SequenceSlice(5, 37, (2, 9, 4)), SequenceSlice(1, 17, (5, 6))]
    meta, ids, positions = fill(batch, slices, 32, 8)
    want = build_metadata(slices, BLOCK, 32, CPU)
    assert meta.graph and meta.num_tokens == 21 and meta.query_lens == (15, 5, 1) and meta.seq_lens == (15, 37, 17)
    assert meta.slot_mapping.tolist() == want.slot_mapping.tolist()
    assert meta.query_start_loc[:4].tolist() == want.query_start_loc.tolist() == [0, 15, 20, 21]
    assert meta.seq_lens_t[:3].tolist() == [15, 37, 17]
    assert meta.block_tables[:3, :3].tolist() == want.block_tables.tolist()
    assert meta.block_tables.shape == (8, 10) and meta.slot_mapping.shape == (32,)
    assert batch.input_ids[:32].tolist() == ids + [0] * 11
    assert batch.positions[:32].tolist() == positions + [0] * 11


def test_a_smaller_batch_after_a_larger_one_overwrites_what_its_kernels_read() -> None:
    """Kernels read a sequence's block-table row only up to its length: later columns may stay stale."""
    batch = StaticBatch(64, 8, 10, BLOCK, CPU)
    fill(batch, [SequenceSlice(40, 40, (1, 2, 3)), SequenceSlice(9, 9, (8,))], 64, 8)
    meta, _, _ = fill(batch, [SequenceSlice(1, 3, (5,))], 16, 8)
    assert meta.block_tables[0, 0].item() == 5 and meta.seq_lens_t[0].item() == 3
    assert meta.slot_mapping.tolist() == [5 * BLOCK + 2] + [DUMMY_BLOCK * BLOCK] * 15
    assert meta.query_start_loc[:2].tolist() == [0, 1]


def test_decode_fill_pads_with_one_token_sequences() -> None:
    batch = StaticBatch(8, 8, 4, BLOCK, CPU)
    slices = pad_decode([SequenceSlice(1, 20, (3, 4)), SequenceSlice(1, 1, (6,))], 4)
    meta, _, _ = fill(batch, slices, 4, 4, graph="decode")
    assert meta.decode and meta.num_seqs == 4
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens_t.tolist() == [20, 1, 1, 1]
    assert meta.slot_mapping.tolist() == [4 * BLOCK + 3, 6 * BLOCK, DUMMY_BLOCK * BLOCK, DUMMY_BLOCK * BLOCK]


def test_one_token_rows_in_a_prefill_graph_are_planned_as_prefill() -> None:
    """A new one-token prompt beside decode rows is a prefill step: its graph holds the prefill kernel."""
    batch = StaticBatch(16, 8, 4, BLOCK, CPU)
    slices = [SequenceSlice(1, 1, (3,)), SequenceSlice(1, 20, (4, 5))]
    assert fill(batch, slices, 16, 8)[0].decode is False
    assert fill(batch, slices, 2, 2, graph="decode")[0].decode is True
    assert build_metadata(slices, BLOCK, 2, CPU).decode is True


def test_dummy_slices_cover_the_bucket_within_a_block_table_row() -> None:
    for tokens, max_blocks in ((16, 512), (4096, 512), (4096, 100), (300, 1)):
        slices = dummy_slices(tokens, BLOCK, max_blocks)
        assert sum(s.query_len for s in slices) == tokens
        assert all(s.query_len == s.seq_len <= max_blocks * BLOCK for s in slices)
        assert all(s.blocks == (DUMMY_BLOCK,) * -(-s.seq_len // BLOCK) for s in slices)


def test_packed_fields_start_on_64_byte_boundaries_and_do_not_overlap() -> None:
    for max_tokens, max_seqs in ((1, 1), (3, 5), (64, 64), (4096, 17)):
        batch = StaticBatch(max_tokens, max_seqs, 4, BLOCK, CPU)
        fields = (batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.query_start_loc)
        spans = sorted((f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in fields)
        assert all(start % 64 == (batch.packed.data_ptr() % 64) for start, _ in spans)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] <= batch.packed.data_ptr() + batch.packed.numel() * 8
        assert [f.numel() for f in fields] == [max_tokens] * 3 + [max_seqs, max_seqs + 1]


def test_block_tables_sent_only_when_the_rows_a_batch_uses_change() -> None:
    """Tables alternate, shrink and grow; the device rows a batch uses always hold its tables, and a
    batch with the same tables as the last send leaves them as they were."""
    batch = StaticBatch(8, 4, 4, BLOCK, CPU)
    a = [SequenceSlice(1, 20, (3, 4)), SequenceSlice(1, 5, (6,))]
    b = [SequenceSlice(1, 21, (3, 4)), SequenceSlice(1, 40, (7, 8, 9))]
    for slices in (a, b, a, a[:1], b, b[:1] + [SequenceSlice(1, 2, (5,))]):
        meta, _, positions = fill(batch, slices, 4, 4, graph="decode")
        for row, s in enumerate(slices):
            assert meta.block_tables[row, : len(s.blocks)].tolist() == list(s.blocks)
        assert meta.seq_lens_t[: len(slices)].tolist() == [s.seq_len for s in slices]
        assert batch.positions[: len(slices)].tolist() == positions
    batch.block_tables[0, 0] = 99  # what a skipped send leaves alone
    fill(batch, b[:1] + [SequenceSlice(1, 2, (5,))], 4, 4, graph="decode")
    assert batch.block_tables[0, 0].item() == 99
