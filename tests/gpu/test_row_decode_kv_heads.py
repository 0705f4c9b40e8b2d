"""The row decode kernel taking two adjacent KV heads a program (`DecodeTiles.kv_heads`, kernels/decode_attention.py)
at the engine's plans, against float32 attention, on the GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

import graphkiln.runtime.attention.triton_backend as triton_backend  # noqa: E402
from graphkiln.runtime.attention.triton_backend import TritonBackend  # noqa: E402
from test_attention_backends import DECODE, _id, make_batch, run_and_check  # noqa: E402

PAIR_HEADS = [(torch.bfloat16, 32, 8, 64), (torch.float16, 8, 8, 64), (torch.bfloat16, 16, 4, 64),
              (torch.bfloat16, 8, 2, 32), (torch.float16, 32, 4, 64)]  # 16-bit, up to 128-byte rows a head


@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize("heads", PAIR_HEADS, ids=_id)
def test_row_decode_with_two_kv_heads_a_program(heads: tuple, case: str, monkeypatch, record_property) -> None:
    plan = triton_backend.decode_tiles
    monkeypatch.setattr(triton_backend, "decode_tiles", lambda *args: replace(plan(*args), kv_heads=2))
    lens, pad = DECODE[case]
    batch = make_batch(heads, [(1, s) for s in lens], pad, decode=True)
    run_and_check(TritonBackend(batch.cache, decode_kernel="rows"), batch, record_property)
