"""The eager model's kernels launched once on dummy rows while its weights are still being read.

CUDA loads a kernel's code at its first launch (lazy loading), cuBLAS picks and loads its kernels per
shape at the first product of that shape: over the kernels of one decoder forward, work that the
engine's first calls would otherwise do after the weights are in. Launched here
on a thread of their own beside the reading threads, attention left out (it needs the KV cache, not
built yet), the engine's first calls find them loaded. The parameters may be half written meanwhile:
the results are thrown away, and no value of them is checked. No FX trace may run in the process
meanwhile: a trace intercepts every module call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .attention import ForwardContext, forward_context, zero_attention
from .quantized_linear import QuantizedLinear
from .transformer import CausalLM

LAUNCH_ON = ("cuda",)  # the device types whose kernels load at their first launch
_forwards = 0


def launch_eager_kernels(model: CausalLM, row_counts: Iterable[int]) -> None:
    """One forward of `model` (hidden states, no logits) at each row count, with an attention that writes zeros,
    on the device types of LAUNCH_ON; nothing elsewhere. Quantized layers call Triton kernels, whose import
    must not run beside another thread's: a caller importing them elsewhere waits for that import before
    calling this on such a model."""
    global _forwards
    device = next(model.parameters()).device
    if device.type not in LAUNCH_ON:
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with torch.inference_mode(), forward_context(ForwardContext(zero_attention)):
        for rows in row_counts:
            zeros = torch.zeros(rows, dtype=torch.int64, device=device)
            model(zeros, zeros)
            _forwards += 1
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def forwards_launched() -> int:
    """How many warm-up forwards this process has run (for tests)."""
    return _forwards


def calls_triton(model: CausalLM) -> bool:
    """Whether the eager model's projections call Triton kernels (the quantized ones do)."""
    return any(isinstance(m, QuantizedLinear) for m in model.modules())
