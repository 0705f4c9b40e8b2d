"""Dynamo capture: one full-graph trace of `model.forward(input_ids, positions)` with a dynamic token dim.

Guards are dropped and size 0/1 specialization is off, so the one graph serves every token
count. Each graph placeholder is bound to what feeds it (an input, a parameter or buffer by
name, or the token count), which is all a later process needs to call the pieces without Dynamo.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from graphkiln.compat import mark_dynamic_dim, size_oblivious
from graphkiln.models.attention import ForwardContext, forward_context, zero_attention
from graphkiln.models.transformer import CausalLM

TRACE_TOKENS = 7  # an odd size no bucket uses, so nothing specializes on it by accident


@dataclass(frozen=True)
class Binding:
    """What feeds one graph placeholder: kind is 'input' (name = input_ids|positions), 'tensor' or 'num_tokens'."""

    kind: str
    name: str


@dataclass
class CapturedGraph:
    gm: torch.fx.GraphModule
    bindings: list[Binding]
    trace_s: float


def capture(model: CausalLM, around_trace: contextlib.AbstractContextManager | None = None) -> CapturedGraph:
    """Trace `model` once with Dynamo and return its FX graph and placeholder bindings.

    `around_trace` wraps the call that makes Dynamo trace (the dumps use it for depyf)."""
    device = next(model.parameters()).device
    captured: list[tuple[torch.fx.GraphModule, list]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    input_ids = torch.zeros(TRACE_TOKENS, dtype=torch.int64, device=device)
    positions = torch.arange(TRACE_TOKENS, dtype=torch.int64, device=device)
    mark_dynamic_dim(input_ids, 0)
    mark_dynamic_dim(positions, 0)
    start = time.perf_counter()
    compiled = torch.compile(
        model,
        backend=backend,
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
    )
    with size_oblivious(), torch.no_grad():
        with forward_context(ForwardContext(zero_attention)), around_trace or contextlib.nullcontext():
            compiled(input_ids, positions)
    trace_s = time.perf_counter() - start
    torch.compiler.reset()
    (gm, example_inputs), = captured
    return CapturedGraph(gm, _bind(model, gm, example_inputs, {"input_ids": input_ids, "positions": positions}), trace_s)


def _bind(model: CausalLM, gm, example_inputs: list, inputs: dict[str, torch.Tensor]) -> list[Binding]:
    by_id = {id(t): name for name, t in model.named_parameters(remove_duplicate=False)}
    by_id.update({id(t): name for name, t in model.named_buffers(remove_duplicate=False)})
    by_id_inputs = {id(t): name for name, t in inputs.items()}
    bindings = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs, strict=True):
        if isinstance(value, torch.SymInt):
            bindings.append(Binding("num_tokens", node.name))
        elif id(value) in by_id_inputs:
            bindings.append(Binding("input", by_id_inputs[id(value)]))
        elif id(value) in by_id:
            bindings.append(Binding("tensor", by_id[id(value)]))
        else:
            raise RuntimeError(f"graph input {node.name} is neither a model input, parameter, buffer nor size")
    return bindings
