"""The FlashInfer attention backend (optional extra `graphkiln[flashinfer]`): paged decode and prefill.

Every call writes the batch's keys and values through the slot mapping (the Triton kernel of
kv_write.py), then runs a FlashInfer wrapper over the paged cache, kv_layout "NHD", passed as the
layer's (keys, values) pair of [num_blocks, block_size, num_kv_heads, head_dim].

- Decode: one BatchDecodeWithPagedKVCacheWrapper per batch size, built with use_cuda_graph=True
  (and tensor cores: any GQA ratio) on persistent indptr / page-index / last-page-length buffers
  of this backend, sized for the batch and its block-table width. `plan` (host side, once per
  step) fills the buffers and calls `wrapper.plan`; the returned function only launches kernels,
  so a captured graph replays whatever the latest `plan` of that batch size put there. A `plan`
  called while a graph is being captured (the runner plans inside its capture) plans nothing:
  the wrapper keeps the plan of the warm-up step that preceded the capture.
- Prefill and mixed batches: one BatchPrefillWithPagedKVCacheWrapper, causal, planned per step.
  It reads the whole context from the cache after the write, so a cached prefix is seen; rows
  past `meta.num_tokens` (padding) get zeros. On Hopper (compute capability 9.x) it runs
  FlashInfer's "fa3" kernels (warp-specialized, fed by TMA), elsewhere "fa2" (`prefill_kernels`).

FlashInfer's scheduler needs the page layout on the host. The lengths come from the metadata's
host lists (no device read, so no sync); the page ids are gathered on the device from the block
tables. The helpers that compute this layout are plain torch and import nothing from FlashInfer,
which is imported only when a backend is built. The query head count and the softmax scale are
not known to the KV cache: the first layer call of the first forward learns them and plans then;
every later `plan` plans at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from graphkiln.errors import CapacityError, ConfigError, UnsupportedModelError
from graphkiln.models.attention import AttentionFn
from graphkiln.runtime.kv_cache import DUMMY_BLOCK, KVCache

from .metadata import BatchMetadata

# FlashInfer's float workspace holds the split-KV partial outputs (FlashInfer raises "Increase the
# workspace buffer size" at plan time when they do not fit). CUDA-graph decode takes
# heads x (rows x group / 16 + rows) x 16 x head_dim x 4 bytes: 200 MB for 64 query heads of 128
# dims in 8 groups at 256 rows. Split prefill takes up to heads x (2 x SMs / kv_heads) x q_tile x
# head_dim x 4 bytes, q_tile 128 (64 at head_dim 256): 138 MB for 64 heads of 128 dims over 8 KV
# heads on 132 SMs, or 16 heads of 256 dims over 2. vLLM uses 256 MiB too.
WORKSPACE_BYTES = 256 << 20
# The "fa3" prefill wrapper's own buffer (64 MB of int32) of per-token KV offsets: a step's whole context.
FA3_CONTEXT_TOKENS = 16 << 20
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
INSTALL_HINT = "pip install graphkiln[flashinfer]"


def import_flashinfer():
    """The flashinfer module, or a ConfigError that says how to install it."""
    try:
        import flashinfer
    except ImportError as err:
        raise ConfigError(
            f"attention backend 'flashinfer' needs the flashinfer package ({err}); {INSTALL_HINT}"
        ) from err
    return flashinfer


def flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


FP8_REFUSAL = (
    "kv_cache_dtype='fp8_e4m3' keeps a scale per token and KV head, and FlashInfer's API takes one scale per"
    " tensor; use attention_backend='triton' (or 'auto') with it, or kv_cache_dtype='auto' with flashinfer"
)


def unsupported(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashInfer cannot serve a cache of this dtype and head size, or None when it can."""
    if dtype == torch.float8_e4m3fn:
        return FP8_REFUSAL
    if dtype not in DTYPES:
        return f"KV cache dtype {dtype}: the flashinfer backend supports float16 and bfloat16"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}: the flashinfer backend supports {HEAD_DIMS}"
    return None


def prefill_kernels(capability: tuple[int, int] | None) -> str:
    """FlashInfer's prefill implementation for a CUDA device of this compute capability (None: not CUDA):
    "fa3", built for sm90a only, where it runs (faster than "fa2" and the Triton kernel at long prompts:
    README, "Attention at serving shapes"), "fa2" elsewhere."""
    return "fa3" if capability is not None and capability[0] == 9 else "fa2"


# --- page layout: plain torch, checked on the CPU -------------------------------------------


def page_layout(
    seq_lens: tuple[int, ...], block_size: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged_kv_indptr int32 [n + 1], paged_kv_last_page_len int32 [n]) on the host.

    indptr[i] is where sequence i's pages start in the page-index list; the last page holds
    1 to block_size tokens. With `width`, every sequence must fit a block table that wide.
    """
    if any(s < 1 for s in seq_lens):
        raise ValueError(f"sequence lengths {seq_lens}: every sequence needs at least one token of context")
    pages = [-(-s // block_size) for s in seq_lens]
    if width is not None and max(pages, default=0) > width:
        raise ValueError(f"a sequence of {max(pages)} pages does not fit a block table {width} blocks wide")
    indptr = torch.tensor([0, *accumulate(pages)], dtype=torch.int32)
    return indptr, torch.tensor([(s - 1) % block_size + 1 for s in seq_lens], dtype=torch.int32)


def qo_indptr(query_lens: tuple[int, ...]) -> torch.Tensor:
    """int32 [n + 1] on the host: where each sequence's query rows start (= query_start_loc)."""
    return torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32)


def fill_page_indices(block_tables: torch.Tensor, kv_indptr: torch.Tensor, out: torch.Tensor) -> None:
    """out[kv_indptr[i] + j] = block_tables[i, j] for each page j of row i, on the tables' device.

    `kv_indptr` lives on that device too. Static shapes and no host read: the table columns past
    a row's pages go to out[-1], a scratch slot that `out` must hold beyond the page list.
    """
    rows, width = block_tables.shape
    if rows == 0:
        return
    counts = kv_indptr[1:] - kv_indptr[:-1]
    columns = torch.arange(width, dtype=kv_indptr.dtype, device=block_tables.device)
    dest = torch.where(columns < counts[:, None], kv_indptr[:-1, None] + columns, out.shape[0] - 1)
    out.scatter_(0, dest.reshape(-1).long(), block_tables.reshape(-1).to(out.dtype))


# --- the backend ------------------------------------------------------------------------------


def _zeros(layer: int, q, k, v, out, scale: float) -> None:
    out.zero_()


@dataclass
class _DecodeSlot:
    """One decode batch size: its wrapper, the persistent buffers it reads, the scale it was planned with."""

    wrapper: Any
    indptr: torch.Tensor  # int32 [batch + 1]
    last_page_len: torch.Tensor  # int32 [batch]
    indices: torch.Tensor  # int32 [capacity + 1]; the last entry is fill_page_indices' scratch slot
    scale: float | None = None
    captured: bool = False

    @property
    def capacity(self) -> int:
        return self.indices.shape[0] - 1


@dataclass
class _Step:
    """One forward's plan of one wrapper: the host arrays for `wrapper.plan`, and the scale once planned."""

    wrapper: Any
    arrays: tuple = ()
    options: dict = field(default_factory=dict)
    slot: _DecodeSlot | None = None  # a decode step records its planned scale there for the capture
    scale: float | None = None


class FlashInferBackend:
    name = "flashinfer"
    capturable_decode = True
    capturable_prefill = False  # its prefill plan is host work per batch: prefill runs piecewise
    concurrent_plans = False  # a wrapper holds the last plan
    prompt_lengths = ()  # FlashInfer's kernels, built when its wrappers are made
    eager_prefill_work = None

    def __init__(self, kv_cache: KVCache, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        if kv_cache.key_scales is not None:
            raise ConfigError(FP8_REFUSAL)
        self._fi = import_flashinfer()
        from graphkiln.kernels.kv_write import write_kv  # triton, like the Triton backend: imported only when built

        reason = unsupported(kv_cache.keys.dtype, kv_cache.keys.shape[-1])
        if reason:
            raise UnsupportedModelError(f"{reason}; use the triton or sdpa attention backend")
        self.kv_cache = kv_cache
        self._write_kv = write_kv
        self._device = kv_cache.keys.device
        with torch.inference_mode(False):  # buffers stay writable in and out of inference mode
            self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self._device)
        self._decode: dict[int, _DecodeSlot] = {}
        capability = torch.cuda.get_device_capability(self._device) if self._device.type == "cuda" else None
        self._prefill_kernels = prefill_kernels(capability)
        self._prefill_wrappers: dict[str, Any] = {}  # by implementation: "fa2" also where a step overflows "fa3"
        self._planned: torch.cuda.Event | None = None  # the last plan's copies from the pinned workspace
        self._heads_and_scale: tuple[int, float] | None = None  # learned from the first layer call

    def release(self) -> None:
        """The workspace and the wrappers that plan into it go (base.AttentionBackend.release)."""
        self._decode.clear()
        self._prefill_wrappers.clear()
        self._workspace = self._workspace.new_empty(0)

    def plan(self, meta: BatchMetadata) -> AttentionFn:
        if meta.num_seqs == 0:
            return _zeros
        return self._plan_decode(meta) if meta.decode else self._plan_prefill(meta)

    # decode: fixed-size wrappers whose kernels a CUDA graph can replay

    def _plan_decode(self, meta: BatchMetadata) -> AttentionFn:
        batch = meta.num_seqs
        slot = self._decode.get(batch)
        if self._capturing():
            if slot is None or slot.scale is None:
                raise RuntimeError(
                    f"flashinfer decode batch of {batch} is captured before any plan of that size ran;"
                    " run one step of that size outside the graph first"
                )
            slot.captured = True
            # The wrapper keeps the plan of the warm-up step that ran this size just before.
            return self._attention(meta, _Step(slot.wrapper, scale=slot.scale))
        width = meta.block_tables.shape[1]
        indptr, last_page_len = page_layout(meta.seq_lens, meta.block_size, width)
        total = int(indptr[-1])
        # A slot an eager step of this size made before its graph was captured (graphs are captured in the
        # background) is made again, at the full width, when the graph's own buffers plan it.
        if slot is None or total > slot.capacity or (not slot.captured and slot.capacity < batch * width):
            if slot is not None and slot.captured:
                raise CapacityError(
                    f"decode batch of {batch} needs {total} pages but its captured graph holds {slot.capacity}"
                )
            slot = self._decode[batch] = self._new_decode_slot(batch, max(batch * width, total))
        slot.indptr.copy_(indptr, non_blocking=True)
        fill_page_indices(meta.block_tables, slot.indptr, slot.indices)
        arrays = (indptr, slot.indices[:total], last_page_len)
        return self._attention(meta, self._plan_now(_Step(slot.wrapper, arrays, slot=slot)))

    def _new_decode_slot(self, batch: int, capacity: int) -> _DecodeSlot:
        def buffer(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=self._device)

        with torch.inference_mode(False):
            indptr, last_page_len, indices = buffer(batch + 1), buffer(batch), buffer(capacity + 1)
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len,
                backend="fa2",
            )
        return _DecodeSlot(wrapper, indptr, last_page_len, indices)

    # prefill and mixed batches: one wrapper, planned every step

    def _plan_prefill(self, meta: BatchMetadata) -> AttentionFn:
        indptr, last_page_len = page_layout(meta.seq_lens, meta.block_size, meta.block_tables.shape[1])
        total = int(indptr[-1])
        indices = torch.empty(total + 1, dtype=torch.int32, device=self._device)
        fill_page_indices(meta.block_tables, indptr.to(self._device, non_blocking=True), indices)
        arrays = (qo_indptr(meta.query_lens), indptr, indices[:total], last_page_len)
        kernels = self._prefill_kernels if sum(meta.seq_lens) <= FA3_CONTEXT_TOKENS else "fa2"
        return self._attention(meta, self._plan_now(_Step(self._prefill_wrapper(kernels), arrays, {"causal": True})))

    def _prefill_wrapper(self, kernels: str) -> Any:
        wrapper = self._prefill_wrappers.get(kernels)
        if wrapper is None:
            with torch.inference_mode(False):
                wrapper = self._prefill_wrappers[kernels] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, "NHD", backend=kernels
                )
        return wrapper

    def build_prefill_kernels(self) -> None:
        """Plan and run the prefill wrapper once, on one query token over the dummy block, so that FlashInfer
        builds its prefill kernels for this cache (or loads them from its cache of builds) now rather than in
        the first prompt's step: fa3's first build per machine takes about a minute. The kernels depend on the
        dtype and head_dim, not on the head count, so one query head per KV head will do; the next step's plan
        replaces this one."""
        _, _, block_size, num_kv_heads, head_dim = self.kv_cache.keys.shape
        indptr, last_page_len = page_layout((1,), block_size)
        indices = torch.tensor([DUMMY_BLOCK], dtype=torch.int32, device=self._device)
        step = _Step(self._prefill_wrapper(self._prefill_kernels), (qo_indptr((1,)), indptr, indices, last_page_len),
                     {"causal": True})  # fmt: skip
        self._plan_wrapper(step, num_kv_heads, head_dim**-0.5)
        query = torch.zeros(1, num_kv_heads, head_dim, dtype=self.kv_cache.keys.dtype, device=self._device)
        step.wrapper.run(query, self.kv_cache.layer(0), out=torch.empty_like(query))

    # shared

    def _plan_now(self, step: _Step) -> _Step:
        if self._heads_and_scale is not None:
            self._plan_wrapper(step, *self._heads_and_scale)
        return step

    def _plan_wrapper(self, step: _Step, num_qo_heads: int, scale: float) -> None:
        """`wrapper.plan` on the host (a device-to-host read never happens: the arrays are host tensors).

        plan copies from FlashInfer's pinned host workspace without blocking; the engine launches a
        step before the previous one ran, so the previous plan's copies are waited for before the
        workspace is rewritten.
        """
        if self._planned is not None:
            self._planned.synchronize()
        cache = self.kv_cache.keys
        _, _, block_size, num_kv_heads, head_dim = cache.shape
        if num_qo_heads % num_kv_heads:
            raise UnsupportedModelError(f"{num_qo_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        step.wrapper.plan(
            *step.arrays, num_qo_heads, num_kv_heads, head_dim, block_size,
            pos_encoding_mode="NONE", q_data_type=cache.dtype, kv_data_type=cache.dtype, sm_scale=scale,
            non_blocking=True, **step.options,
        )
        if self._device.type == "cuda":  # the planning tests run this on the CPU
            self._planned = torch.cuda.Event()
            self._planned.record()
        step.scale = scale
        if step.slot is not None:
            step.slot.scale = scale

    def _capturing(self) -> bool:
        return self._device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _attention(self, meta: BatchMetadata, step: _Step) -> AttentionFn:
        rows = meta.num_tokens

        def run(layer: int, q, k, v, out, scale: float) -> None:
            if step.scale is None:  # the first layer of the first forward: now the head count is known
                if self._capturing():
                    raise RuntimeError("flashinfer cannot plan inside a CUDA graph capture; run one step outside first")
                self._heads_and_scale = (q.shape[1], scale)
                self._plan_wrapper(step, q.shape[1], scale)
            k_cache, v_cache = self.kv_cache.layer(layer)
            self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            query = q[:rows] if q.stride(-1) == 1 else q[:rows].contiguous()
            dest = out[:rows]
            result = dest if dest.is_contiguous() else torch.empty_like(dest, memory_format=torch.contiguous_format)
            # A layer whose scale differs from the planned one scales the logits by the ratio.
            q_scale = None if scale == step.scale else scale / step.scale
            step.wrapper.run(query, (k_cache, v_cache), q_scale=q_scale, out=result)
            if result is not dest:
                dest.copy_(result)
            if rows < out.shape[0]:
                out[rows:].zero_()

        return run
