"""FlashInfer on the CPU: its page layout, backend selection, and the FlashInfer backend's planning
driven through a torch stand-in for FlashInfer's wrappers (the real ones need a GPU)."""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from attention_helpers import CPU, model_config
from flashinfer_stand_in import check_rows, install, paged_batch
from graphkiln.runtime.attention.flashinfer_backend import (
    INSTALL_HINT,
    FlashInferBackend,
    fill_page_indices,
    import_flashinfer,
    page_layout,
    prefill_kernels,
    qo_indptr,
    unsupported,
)
from graphkiln.runtime.attention.metadata import (
    SequenceSlice,
    build_metadata,
    pad_decode,
)
from graphkiln.runtime.attention.sdpa import SdpaBackend
from graphkiln.runtime.attention.select import select_backend
from graphkiln.runtime.kv_cache import DUMMY_BLOCK, KVCache

from graphkiln.errors import CapacityError, ConfigError

# --- FlashInfer: page layout, selection, and planning against a torch stand-in -----------------


def _page_indices(meta, capacity: int | None = None) -> list[int]:
    indptr, _ = page_layout(meta.seq_lens, meta.block_size, meta.block_tables.shape[1])
    out = torch.full(((capacity or int(indptr[-1])) + 1,), -1, dtype=torch.int32)
    fill_page_indices(meta.block_tables, indptr, out)
    return out.tolist()


def test_flashinfer_page_layout_at_block_boundaries() -> None:
    meta = build_metadata([SequenceSlice(1, n, b) for n, b in ((15, (7,)), (16, (3,)), (17, (9, 4)))], 16, 3, CPU)
    indptr, last = page_layout(meta.seq_lens, 16, meta.block_tables.shape[1])
    assert indptr.dtype == last.dtype == torch.int32 and indptr.device == last.device == CPU
    assert indptr.tolist() == [0, 1, 2, 4]
    assert last.tolist() == [15, 16, 1]
    assert _page_indices(meta)[:-1] == [7, 3, 9, 4]
    assert qo_indptr(meta.query_lens).tolist() == meta.query_start_loc.tolist() == [0, 1, 2, 3]


def test_flashinfer_padded_decode_rows_read_the_dummy_block() -> None:
    meta = build_metadata(pad_decode([SequenceSlice(1, 17, (5, 6))], 4), 16, 4, CPU)
    indptr, last = page_layout(meta.seq_lens, 16)
    assert indptr.tolist() == [0, 2, 3, 4, 5]
    assert last.tolist() == [1, 1, 1, 1]
    assert _page_indices(meta)[:-1] == [5, 6, DUMMY_BLOCK, DUMMY_BLOCK, DUMMY_BLOCK]


def test_flashinfer_prefill_layout_with_a_cached_prefix() -> None:
    slices = [SequenceSlice(5, 21, (8, 2)), SequenceSlice(1, 17, (4, 11)), SequenceSlice(16, 48, (6, 1, 9)),
              SequenceSlice(3, 3, (12,))]
    meta = build_metadata(slices, 16, 30, CPU)
    indptr, last = page_layout(meta.seq_lens, 16, meta.block_tables.shape[1])
    assert qo_indptr(meta.query_lens).tolist() == meta.query_start_loc.tolist() == [0, 5, 6, 22, 25]
    assert indptr.tolist() == [0, 2, 4, 7, 8]
    assert last.tolist() == [5, 1, 16, 3]
    assert _page_indices(meta)[:-1] == [8, 2, 4, 11, 6, 1, 9, 12]


def test_fill_page_indices_leaves_the_rest_of_a_static_buffer() -> None:
    """A CUDA-graph decode buffer holds batch x width pages plus a scratch slot; only the page list is written."""
    meta = build_metadata([SequenceSlice(1, 17, (9, 4)), SequenceSlice(1, 1, (5,))], 16, 2, CPU)
    tables = torch.nn.functional.pad(meta.block_tables, (0, 6), value=DUMMY_BLOCK)  # width 8, like the runner's
    indptr, _ = page_layout(meta.seq_lens, 16, tables.shape[1])
    out = torch.full((2 * 8 + 1,), -1, dtype=torch.int32)
    fill_page_indices(tables, indptr, out)
    assert out[:3].tolist() == [9, 4, 5]
    assert out[3:-1].eq(-1).all()


def test_flashinfer_page_layout_rejects_empty_and_too_wide_sequences() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        page_layout((3, 0), 16)
    with pytest.raises(ValueError, match="does not fit"):
        page_layout((33,), 16, width=2)


def test_flashinfer_supports_half_types_and_three_head_sizes() -> None:
    assert unsupported(torch.bfloat16, 128) is None and unsupported(torch.float16, 256) is None
    assert "head_dim 96" in unsupported(torch.bfloat16, 96)
    assert "float32" in unsupported(torch.float32, 128)


def test_select_backend_on_the_cpu() -> None:
    cache = KVCache(model_config(4, 2, 64), 4, 16, torch.float32, CPU)
    assert isinstance(select_backend("auto", cache), SdpaBackend)
    for name in ("triton", "flashinfer"):
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            select_backend(name, cache)
    with pytest.raises(ConfigError, match="unknown"):
        select_backend("flash", cache)


def test_flashinfer_prefill_runs_its_hopper_kernels_on_hopper_only() -> None:
    assert prefill_kernels((9, 0)) == "fa3"
    assert [prefill_kernels(c) for c in [(8, 0), (8, 9), (10, 0), (12, 0), None]] == ["fa2"] * 5


def test_missing_flashinfer_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install graphkiln\[flashinfer\]"):
        import_flashinfer()
    assert INSTALL_HINT == "pip install graphkiln[flashinfer]"


@pytest.fixture
def stand_in_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch)


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_flashinfer_backend_plans_once_per_step_and_matches_float64() -> None:
    """Decode (padded rows), then chunked prefill on cached prefixes mixed with a decode, through the stand-in."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    cache = KVCache(model_config(num_heads, num_kv_heads, head_dim), 40, 16, torch.bfloat16, CPU)
    backend = FlashInferBackend(cache, workspace_bytes=16)
    scale = head_dim**-0.5
    gen = torch.Generator().manual_seed(1)

    decode_lens = [(1, 15), (1, 16), (1, 17), (1, 1), (1, 40)]
    meta, k, v, full_k, full_v = paged_batch(cache, decode_lens, decode=True, pad=3, seed=0)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    fn = backend.plan(meta)
    wrapper = backend._decode[8].wrapper
    assert wrapper.plans == 0  # the head count is learned from the first layer call
    fn(1, q, k, v, out, scale)
    fn(1, q, k, v, out, scale)  # a second layer plans nothing
    assert wrapper.plans == 1
    check_rows(out, q, decode_lens, full_k, full_v, scale)
    assert not out.isnan().any()
    backend.plan(meta)
    assert wrapper.plans == 2  # later steps plan in `plan`, before any layer runs (as a graph replay needs)

    prefill_lens = [(5, 21), (1, 17), (16, 48), (3, 3)]
    cache.keys.zero_()
    cache.values.zero_()
    meta, k, v, full_k, full_v = paged_batch(cache, prefill_lens, decode=False, pad=3, seed=1)
    q = torch.randn(meta.num_tokens + 3, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    fn = backend.plan(meta)
    assert list(backend._prefill_wrappers) == ["fa2"]  # not a CUDA device
    assert backend._prefill_wrappers["fa2"].plans == 1 and backend._prefill_wrappers["fa2"].backend == "fa2"
    fn(1, q, k, v, out, scale)
    check_rows(out, q, prefill_lens, full_k, full_v, scale)
    assert out[meta.num_tokens :].eq(0).all()

    out.fill_(float("nan"))
    fn(1, q, k, v, out, 0.5 * scale)  # a layer with another scale than the planned one
    check_rows(out, q, prefill_lens, full_k, full_v, 0.5 * scale)
    assert backend._prefill_wrappers["fa2"].plans == 1


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_flashinfer_decode_buffers_grow_until_captured() -> None:
    cache = KVCache(model_config(4, 2, 64), 64, 16, torch.float16, CPU)
    backend = FlashInferBackend(cache, workspace_bytes=16)
    narrow = build_metadata([SequenceSlice(1, 16, (3,)), SequenceSlice(1, 5, (4,))], 16, 2, CPU)
    wide = build_metadata([SequenceSlice(1, 40, (5, 6, 7)), SequenceSlice(1, 5, (4,))], 16, 2, CPU)
    backend.plan(narrow)
    assert backend._decode[2].capacity == 2
    backend.plan(wide)
    assert backend._decode[2].capacity == 6
    backend._decode[2].captured = True
    wider = build_metadata([SequenceSlice(1, 100, tuple(range(8, 15))), SequenceSlice(1, 5, (4,))], 16, 2, CPU)
    with pytest.raises(CapacityError, match="captured graph holds 6"):
        backend.plan(wider)


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_flashinfer_release_drops_its_workspace_and_the_wrappers_planned_into_it() -> None:
    cache = KVCache(model_config(4, 2, 64), 64, 16, torch.float16, CPU)
    backend = FlashInferBackend(cache, workspace_bytes=1 << 20)
    backend.plan(build_metadata([SequenceSlice(1, 16, (3,)), SequenceSlice(1, 5, (4,))], 16, 2, CPU))
    backend.plan(build_metadata([SequenceSlice(20, 40, (3, 4, 5))], 16, 20, CPU))
    assert backend._decode and backend._prefill_wrappers
    workspace = weakref.ref(backend._workspace)
    backend.release()
    assert workspace() is None and backend._workspace.numel() == 0
    assert not backend._decode and not backend._prefill_wrappers


@pytest.mark.usefixtures("stand_in_flashinfer")
def test_flashinfer_prefill_past_the_fa3_buffer_plans_on_fa2(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose whole context overflows fa3's buffer of KV offsets runs on an "fa2" wrapper."""
    from graphkiln.runtime.attention import flashinfer_backend

    cache = KVCache(model_config(4, 2, 64), 64, 16, torch.bfloat16, CPU)
    backend = FlashInferBackend(cache, workspace_bytes=16)
    backend._prefill_kernels = "fa3"  # as on a Hopper GPU
    meta = build_metadata([SequenceSlice(20, 40, (3, 4, 5)), SequenceSlice(7, 7, (6,))], 16, 27, CPU)
    backend.plan(meta)
    monkeypatch.setattr(flashinfer_backend, "FA3_CONTEXT_TOKENS", 46)
    backend.plan(meta)
    assert [(w.backend, w.plans) for w in backend._prefill_wrappers.values()] == [("fa3", 0), ("fa2", 0)]
