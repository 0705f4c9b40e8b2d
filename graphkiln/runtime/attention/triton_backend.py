"""The Triton attention backend: paged decode (split-K) and varlen prefill, both CUDA-graph capturable.

A decode call (every sequence adds one token) is one launch: the decode kernel stores the new
keys and values through the slot mapping itself, attends over the paged context and merges its
splits (the last split of a sequence to finish, counting on zeros the backend keeps). A prefill
call writes the keys and values (one launch), then runs the varlen causal prefill kernel, which
reads the whole context from the paged cache. Any head_dim up to 256 runs on tiles padded to a
power of two (planned at the padded width); an fp8 cache passes its row scales to every kernel.
Planning (tile sizes, decode splits,
prefill work items) is plain Python here; the kernels import triton, an optional dependency,
only when a backend is built. `decode_kernel` picks the decode kernel (the row
kernel, or the block kernel that block_decode.py plans); prefill is the same either way.

Given q and k before the rotary embedding (graphkiln::rope_attention, `with_rope` on a decode plan), the row decode
kernel rotates them itself in batches of up to ROPE_IN_DECODE_ROWS rows, where the rope launch it saves is most of
its cost; larger batches measured faster with the rope kernel first, which the op then launches.

Decode launches depend only on static quantities (batch size, block table width, head shapes),
and scratch buffers are allocated inside the call, so a capture takes them from the graph's
pool and a replay reads whatever lengths and block tables the buffers hold by then. A prefill
planned for a graph launches a grid fixed by its padded token count; its work table (the item
count, then the items) is rewritten in place before each replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from graphkiln.errors import UnsupportedModelError
from graphkiln.models.attention import AttentionFn
from graphkiln.runtime.kv_cache import KVCache
from graphkiln.runtime.transfer import upload

from .block_decode import (
    block_decode_tiles,
    check_decode_kernel,
    effective_decode_kernel,
    lane_bytes,
)
from .metadata import BatchMetadata

PROGRAMS_PER_SM = 2  # prefill programs resident per SM at the default tiles (shared-memory bound)
DECODE_PROGRAMS_PER_SM = 4  # decode programs a grid wants per SM at most: the batched shapes measured fastest there
MIN_SPLIT_TOKENS = 128  # a decode split never covers fewer tokens than this of the longest context
UNSPLIT_TILES = 3  # over FEW_ROWS rows a sequence of at most this many tiles runs in one split, whatever the grid's
FEW_ROWS = 8  # decode batches of up to this many rows split every context of two tiles or more (decode_tiles)
SHORT_TILE_SPLITS = 4  # a batch split this many ways or more takes short tiles (decode_tiles)
MAX_SPLITS = 64
ROPE_IN_DECODE_ROWS = 8  # decode batches of up to this many rows rotate q and k in the kernel (rope_attention)
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


@dataclass(frozen=True)
class DecodeTiles:
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    unsplit_tiles: int = UNSPLIT_TILES  # a sequence of at most this many tiles runs in one split


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # query tokens a tile
    block_n: int
    num_warps: int
    num_stages: int
    heads: int = 1  # query heads of a KV head's group a program (its tile: block_m x heads rows)
    max_registers: int = 0  # a thread's register cap (more programs a multiprocessor), 0: the compiler's choice


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The head lanes of the kernels' tiles: the next power of two, at least 16 (kernels/kv_format.py)."""
    return max(16, _next_pow2(head_dim))


def unsupported(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the Triton kernels cannot serve a cache of this dtype and head size, or None when they can."""
    if dtype not in DTYPES:
        return f"KV cache dtype {dtype}: the triton backend supports {', '.join(str(d) for d in DTYPES)}"
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim}: the triton attention backend supports 1 to {MAX_HEAD_DIM}"
    return None


def decode_tiles(
    num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, itemsize: int, num_sms: int
) -> DecodeTiles:
    """Split each (sequence, KV head) into as many splits as keep the grid within DECODE_PROGRAMS_PER_SM
    programs an SM (at least one split), but never below MIN_SPLIT_TOKENS a split. Where each split holds many
    tiles (batch 1, or fewer than SHORT_TILE_SPLITS splits) 128-row tiles of up to 256 bytes give the loop
    enough to pipeline, except that one row's 256-byte rows of 16-bit elements take 64-row tiles: a short context
    then runs in twice the splits, each loading its tile before the PDL wait, and a long one in two tiles a split
    where it had one, both faster in whole steps (README). Where a batch is split SHORT_TILE_SPLITS ways or more, a
    split holds few such tiles, so rows of up to 128 bytes take 64-row tiles and 256-byte rows of 16-bit elements
    32-row ones, 2 warps and 4 stages deep; wider rows take 32-row tiles. Tilings not measured keep those they were
    tested with (an fp8 cache's 128-byte rows 64 rows, a float32 cache's 256-byte rows 128). The sweeps behind each
    choice (`python -m bench attention --serving-sweep`) are in README, "Attention at serving shapes".

    `max_context` is what the block table can hold (its width times the block size): a static
    quantity, so a captured graph keeps its grid whatever lengths a replay brings. The kernel splits each
    sequence's own context, except, in batches of more than FEW_ROWS rows, one of at most UNSPLIT_TILES tiles,
    which runs in one split: a lone launch read up to three tiles one after the other in less time than one-tile
    splits and their merge (`python -m bench attention --latency`, README). In a step of a few rows the PDL wait
    lets each split's first tile load while the qkv product drains, and an unsplit context's second tile loads
    only after it, so there every context of two tiles or more splits (README, "Attention at serving shapes").
    """
    wanted = DECODE_PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads)
    splits = max(1, min(wanted, _cdiv(max_context, MIN_SPLIT_TOKENS), MAX_SPLITS))
    row_bytes = head_dim * itemsize
    long_splits = num_seqs == 1 or splits < SHORT_TILE_SPLITS  # each split holds many tiles of the context
    unsplit = 1 if num_seqs <= FEW_ROWS else UNSPLIT_TILES
    if row_bytes <= 128:
        return DecodeTiles(splits, 128 if long_splits and itemsize == 2 else 64, 4, 2, unsplit)
    if row_bytes <= 256 and (long_splits or itemsize > 2):
        one_row_halves = num_seqs == 1 and row_bytes == 256 and itemsize == 2
        return DecodeTiles(splits, 64 if one_row_halves else 128, 4, 2, unsplit)
    return DecodeTiles(splits, 32, 2 if row_bytes <= 256 else 4, 4 if row_bytes <= 256 else 2, unsplit)


def prefill_tiles(max_query_len: int, head_dim: int, itemsize: int) -> PrefillTiles:
    """The fastest of the tilings the attention benchmark sweeps (README, "Attention at serving shapes"). In a 16-bit
    cache, held to 128 registers a thread so a multiprocessor holds one program more: 128-byte rows take 64-row
    tiles on 4 warps (four programs, not three) wherever the query tiles are 64 rows, 256-byte rows from 128 tokens
    128-row tiles on 8 warps (two, not one). Otherwise query tiles of up to 64 rows, no taller than the longest
    query, on 4 warps."""
    row_bytes = head_dim * itemsize
    if itemsize == 2 and row_bytes <= 128 and max_query_len > 32:
        return PrefillTiles(64, 64, 4, 2, max_registers=128)
    if itemsize == 2 and row_bytes <= 256 and max_query_len >= 128:
        return PrefillTiles(128, 64, 8, 2, max_registers=128)
    block_m = min(64, max(16, _next_pow2(max_query_len)))
    return PrefillTiles(block_m, 64 if row_bytes <= 256 else 32, 4, 2 if row_bytes <= 512 else 1)


def prefill_work(query_lens: tuple[int, ...], seq_lens: tuple[int, ...], block_m: int) -> list[tuple[int, int]]:
    """(sequence, first query row) of every query tile, the tiles attending the most keys first."""
    items = [(i, row) for i, q_len in enumerate(query_lens) for row in range(0, q_len, block_m)]

    def keys(item: tuple[int, int]) -> int:
        i, row = item
        return seq_lens[i] - query_lens[i] + min(row + block_m, query_lens[i])

    return sorted(items, key=keys, reverse=True)


def work_table(items: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The prefill kernel's work table: (number of items, 0), then the items."""
    return [(len(items), 0), *items]


def graph_work_capacity(num_tokens: int, num_seqs: int, block_m: int) -> int:
    """The most query tiles a batch of at most `num_seqs` sequences and `num_tokens` tokens can need:
    each sequence's tiles cover its query rows plus less than one tile."""
    return _cdiv(num_tokens, block_m) + min(num_seqs, num_tokens)


def graph_programs(num_tokens: int, capacity: int, block_m: int, head_groups: int, num_sms: int) -> int:
    """Prefill programs per head group (the query heads one program takes) of a captured grid: one per tile
    of a single `num_tokens` prompt, or enough for PROGRAMS_PER_SM on every SM, whichever is more (never
    above `capacity`); a batch of many short prompts has each program take several items."""
    return min(capacity, max(_cdiv(num_tokens, block_m), _cdiv(PROGRAMS_PER_SM * num_sms, head_groups)))


def graph_prefill_work(
    query_lens: tuple[int, ...], seq_lens: tuple[int, ...], block_m: int, capacity: int
) -> list[tuple[int, int]]:
    """The work table of a batch for a captured grid of `capacity` items."""
    items = prefill_work(query_lens, seq_lens, block_m)
    if len(items) > capacity:
        raise ValueError(f"{len(items)} prefill tiles do not fit a captured grid of {capacity}")
    return work_table(items)


class TritonBackend:
    name = "triton"
    capturable_decode = True
    capturable_prefill = True
    concurrent_plans = True
    prompt_lengths = (16, 32, 64)  # each query tile height (`prefill_tiles`) but 128: the warm-up's largest prefill
    eager_prefill_work = None

    def __init__(self, kv_cache: KVCache, decode_kernel: str = "auto") -> None:
        # triton is optional: import the kernels only when this backend is chosen.
        from graphkiln.kernels.kv_write import write_kv
        from graphkiln.kernels.decode_attention import paged_decode
        from graphkiln.kernels.prefill_attention import paged_prefill

        reason = unsupported(kv_cache.keys.dtype, kv_cache.keys.shape[-1])
        if reason:
            raise UnsupportedModelError(f"{reason}; use the sdpa attention backend")
        check_decode_kernel(decode_kernel, self.name)
        self.kv_cache = kv_cache
        self.decode_kernel = effective_decode_kernel(decode_kernel, kv_cache.keys)
        self._write_kv, self._decode, self._prefill = write_kv, paged_decode, paged_prefill
        self._block_decode = None
        if self.decode_kernel == "blocks":  # imported by load, like the others: no step pays an import
            from graphkiln.kernels.block_decode_attention import block_paged_decode

            self._block_decode = block_paged_decode
        device = kv_cache.keys.device
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self._graph_work: dict[int, torch.Tensor] = {}  # padded token count -> a captured prefill's work table
        num_blocks, _, num_kv_heads = kv_cache.keys.shape[1:4]
        # The decode kernels' split counters: zeros between launches, shared by every launch and layer.
        # A batch's real rows come before its padding and each holds a block: one set per block will do.
        self._split_counters = torch.zeros(num_blocks * num_kv_heads, dtype=torch.int32, device=device)

    def release(self) -> None:
        """The split counters and the captured prefills' work tables go (base.AttentionBackend.release)."""
        self._graph_work.clear()
        self._split_counters = self._split_counters.new_empty(0)

    def plan(self, meta: BatchMetadata) -> AttentionFn:
        return self._plan_decode(meta) if meta.decode else self._plan_prefill(meta)

    def _plan_decode(self, meta: BatchMetadata) -> AttentionFn:
        if self.decode_kernel == "blocks":
            return self._plan_block_decode(meta)
        _, block_size, num_kv_heads, head_dim = self.kv_cache.keys.shape[1:]
        tiles = decode_tiles(
            meta.seq_lens_t.shape[0],
            num_kv_heads,
            meta.block_tables.shape[1] * block_size,
            padded_head_dim(head_dim),
            self.kv_cache.keys.element_size(),
            self._num_sms,
        )
        tile_args = asdict(tiles)

        def decode(layer: int, q, k, v, out, scale: float, rope: tuple | None) -> None:
            k_cache, v_cache = self.kv_cache.layer(layer)
            self._decode(q, k, v, k_cache, v_cache, meta.seq_lens_t, meta.block_tables, meta.slot_mapping, out, scale,
                         self._split_counters, scales=self.kv_cache.layer_scales(layer), rope=rope, **tile_args)

        def run(layer: int, q, k, v, out, scale: float) -> None:
            decode(layer, q, k, v, out, scale, None)

        def with_rope(layer: int, q, k, v, out, scale: float, table, positions) -> None:
            """graphkiln::rope_attention's call: q and k before the rotary embedding, which the kernel applies.
            It calls `decode`, not `run`, which holds it: a plan is no reference cycle, freed with its step (a
            cycle would wait for a collection, or, made while a load keeps collection off, stay for good, and
            with it the backend and the step's metadata on the device)."""
            decode(layer, q, k, v, out, scale, (table, positions))

        if meta.seq_lens_t.shape[0] <= ROPE_IN_DECODE_ROWS:
            run.with_rope = with_rope  # type: ignore[attr-defined]
        return run

    def _plan_block_decode(self, meta: BatchMetadata) -> AttentionFn:
        """The block kernel's call; its cache descriptors are built per call (they hold the cache, which
        must go when the engine closes), which only eager steps pay: a graph keeps what it captured."""
        block_paged_decode = self._block_decode
        _, block_size, num_kv_heads, head_dim = self.kv_cache.keys.shape[1:]
        tiles = block_decode_tiles(meta.seq_lens_t.shape[0], num_kv_heads, meta.block_tables.shape[1] * block_size,
                                   block_size, padded_head_dim(head_dim), lane_bytes(self.kv_cache.keys.dtype),
                                   self._num_sms)
        tile_args = asdict(tiles)

        def run(layer: int, q, k, v, out, scale: float) -> None:
            k_cache, v_cache = self.kv_cache.layer(layer)
            block_paged_decode(q, k, v, k_cache, v_cache, meta.seq_lens_t, meta.block_tables, meta.slot_mapping, out,
                               scale, self._split_counters, scales=self.kv_cache.layer_scales(layer), **tile_args)

        return run

    def _plan_prefill(self, meta: BatchMetadata) -> AttentionFn:
        if meta.graph:
            return self._plan_graph_prefill(meta)
        tiles = prefill_tiles(max(meta.query_lens, default=1), *self._row_shape())
        items = prefill_work(meta.query_lens, meta.seq_lens, tiles.block_m)
        work = upload(work_table(items), torch.int32, meta.seq_lens_t.device)
        return self._prefill_fn(meta, tiles, work, lambda head_groups: max(1, len(items)), zero_padding=True)

    def _plan_graph_prefill(self, meta: BatchMetadata) -> AttentionFn:
        """Tiles and grid fixed by the padded token count and sequence rows; the work table is rewritten
        in place (a copy queued on the stream), so a captured graph replays whatever batch was planned
        last. Padded rows are left unwritten: nothing reads them."""
        padded = meta.slot_mapping.shape[0]
        tiles = prefill_tiles(padded, *self._row_shape())
        work = self._graph_work.get(padded)
        if work is None:
            capacity = graph_work_capacity(padded, meta.seq_lens_t.shape[0], tiles.block_m)
            work = self._graph_work[padded] = torch.empty((1 + capacity, 2), dtype=torch.int32, device=meta.seq_lens_t.device)
        capacity = work.shape[0] - 1
        table = graph_prefill_work(meta.query_lens, meta.seq_lens, tiles.block_m, capacity)
        work[: len(table)].copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)

        def programs(head_groups: int) -> int:
            return graph_programs(padded, capacity, tiles.block_m, head_groups, self._num_sms)

        return self._prefill_fn(meta, tiles, work, programs, zero_padding=False)

    def _row_shape(self) -> tuple[int, int]:
        return padded_head_dim(self.kv_cache.keys.shape[-1]), self.kv_cache.keys.element_size()

    def _prefill_fn(
        self, meta: BatchMetadata, tiles: PrefillTiles, work: torch.Tensor, programs: Callable[[int], int],
        zero_padding: bool,
    ) -> AttentionFn:
        """The prefill call; `programs` gives the grid's programs per head group from the group count."""
        tile_args = asdict(tiles)

        def run(layer: int, q, k, v, out, scale: float) -> None:
            k_cache, v_cache = self.kv_cache.layer(layer)
            scales = self.kv_cache.layer_scales(layer)
            self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping, scales)
            self._prefill(
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens_t, meta.block_tables, work, out, scale,
                programs(q.shape[1] // tiles.heads), scales=scales, **tile_args,
            )
            if zero_padding:
                out[meta.num_tokens :] = 0

        return run
