"""A call of each of graphkiln's ops on real quantized weights, for `torch.library.opcheck`: x of one row and of
three (the CUDA kernels take other paths at each), widths at which every CUDA path runs (the int4 dp4a GEMV's
words from 2048). The attention ops are left out: they run against an engine's KV cache and plan.

Some outputs are left unwritten where nothing reads them: a norm's int4 words but at one row on CUDA (the only
place a product takes them), its fp8 rows at one row on CUDA (where every product multiplies x as it is). Two calls
then differ there, so `opcheck` cannot compare those calls' outputs (`unwritten`)."""

from __future__ import annotations

import torch

from graphkiln.models.int4_fused import add_rms_norm_int4, int4_linear_words, int4_silu_mul_linear
from graphkiln.models.int8_linear import int8_linear, int8_linear_silu_mul, quantize_int8
from graphkiln.models.linear import linear, linear_silu_mul, silu_mul_linear
from graphkiln.models.norm import add_rms_norm
from graphkiln.models.norm_fp8 import add_rms_norm_fp8, fp8_linear_quantized, fp8_mlp_quantized, quantize_per_token
from graphkiln.models.quantized_linear import (
    fp8_linear, fp8_linear_silu_mul, fp8_mlp, int4_linear, quantize_fp8, quantize_int4,
)
from graphkiln.models.rope import rope

K, N, INTERMEDIATE, GROUP = 2048, 2048, 2048, 128
HEADS, HEAD_DIM = 4, 64


def op_samples(device: str, dtype: torch.dtype) -> dict[str, tuple[torch._ops.OpOverloadPacket, tuple]]:
    """{"<name>-<rows>": (op, args)} with inputs of `dtype` on `device`."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    def on(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in tensors)

    w, gate_up_w = rand(N, K, scale=0.02), rand(2 * INTERMEDIATE, K, scale=0.02)
    down_w = rand(N, INTERMEDIATE, scale=0.02)
    fp8, fp8_gate_up, fp8_down = (on(*quantize_fp8(t)) for t in (w, gate_up_w, down_w))
    int4, int4_down = (on(*quantize_int4(t, GROUP)) for t in (w, down_w))
    int8, int8_gate_up = (on(*quantize_int8(t)) for t in (w, gate_up_w))
    norm_weight = 1 + rand(K, scale=0.1)
    table = rand(64, 2 * HEAD_DIM)
    samples = {}
    for rows in (1, 3):
        x, residual, gate_up = rand(rows, K), rand(rows, K), rand(rows, 2 * INTERMEDIATE)
        q, scale = on(*quantize_per_token(x))
        words = add_rms_norm_int4(x, residual, norm_weight, 1e-5, GROUP)[2:]
        qk = rand(rows, 3 * HEADS * HEAD_DIM)[:, : 2 * HEADS * HEAD_DIM].view(rows, 2 * HEADS, HEAD_DIM)
        positions = torch.randperm(64, generator=gen)[:rows].to(device)
        samples |= {f"{name}-{rows}": call for name, call in {
            "linear": (linear, (x, w)),
            "linear_silu_mul": (linear_silu_mul, (x, gate_up_w)),
            "silu_mul_linear": (silu_mul_linear, (gate_up, down_w)),
            "add_rms_norm": (add_rms_norm, (x, residual, norm_weight, 1e-5)),
            "add_rms_norm_fp8": (add_rms_norm_fp8, (x, residual, norm_weight, 1e-5)),
            "add_rms_norm_int4": (add_rms_norm_int4, (x, residual, norm_weight, 1e-5, GROUP)),
            "rope": (rope, (qk, table, positions)),
            "fp8_linear": (fp8_linear, (x, *fp8, None)),
            "fp8_linear_silu_mul": (fp8_linear_silu_mul, (x, *fp8_gate_up, None)),
            "fp8_mlp": (fp8_mlp, (x, *fp8_gate_up, None, *fp8_down)),
            "fp8_linear_quantized": (fp8_linear_quantized, (x, q, scale, *fp8)),
            "fp8_mlp_quantized": (fp8_mlp_quantized, (x, q, scale, *fp8_gate_up, *fp8_down)),
            "int4_linear": (int4_linear, (x, *int4, GROUP)),
            "int4_linear_words": (int4_linear_words, (x, *words, *int4, GROUP)),
            "int4_silu_mul_linear": (int4_silu_mul_linear, (gate_up, *int4_down, GROUP)),
            "int8_linear": (int8_linear, (x, *int8, None, False)),
            "int8_linear_w8a8": (int8_linear, (x, *int8, None, True)),
            "int8_linear_silu_mul": (int8_linear_silu_mul, (x, *int8_gate_up, None, True)),
        }.items()}
    return samples


def unwritten(name: str, device: str) -> bool:
    """Whether the sample `name` leaves an output unwritten on `device` (module docstring)."""
    op, rows = name.rsplit("-", 1)
    cuda = device == "cuda"
    words_unwritten = op == "add_rms_norm_int4" and not (cuda and rows == "1")
    return words_unwritten or (op == "add_rms_norm_fp8" and cuda and rows == "1")


def check_op(name: str, op: torch._ops.OpOverloadPacket, args: tuple, device: str) -> None:
    """`opcheck` of one sample, and its outputs apart from its inputs and from one another. Where fp8 tensors are
    among the inputs `opcheck`'s schema check cannot run (it compares them with arithmetic fp8 lacks): the outputs'
    storages are compared here instead; where an output is left unwritten, its AOTAutograd check is not run."""
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    utils = ["test_faketensor", "test_autograd_registration"]
    if not any(t.dtype == torch.float8_e4m3fn for t in inputs):
        utils.append("test_schema")
    if not unwritten(name, device):
        utils.append("test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils)
    out = op(*args)
    outputs = out if isinstance(out, tuple) else (out,)
    storages = [t.untyped_storage().data_ptr() for t in outputs]
    assert len(set(storages)) == len(storages), "two outputs share storage"
    assert not set(storages) & {t.untyped_storage().data_ptr() for t in inputs}, "an output is an input's storage"
