"""rope_attention: the pass takes a layer's rope and attention when nothing else reads the rotated heads, the op
hands the attention what the graph did (rotated q and k, or, to an attention that rotates them itself, the heads
before rope with the table and positions), and a model compiled with it computes what the eager model does."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_compiler import TOY
import test_passes
from test_passes import dynamo_graph, eager_and_compiled_agree

from graphkiln import CompileConfig
from graphkiln.compiler.compile import compile_module
from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.models.rope import rope_reference
from graphkiln.passes.rope_attention import RopeAttention

toy = test_passes.toy  # the toy model (a module fixture)
HEADS, KV_HEADS, DIM = 4, 2, 8


def _attend(q, k, v, out) -> None:
    """A stand-in attention that depends on every input: out = q + each query head's key and value."""
    group = q.shape[1] // k.shape[1]
    out.copy_(q + 2 * k.repeat_interleave(group, 1) + v.repeat_interleave(group, 1))


def _recording(fused: bool, calls: list):
    def run(layer, q, k, v, out, scale):
        calls.append("plain")
        _attend(q, k, v, out)

    def with_rope(layer, q, k, v, out, scale, table, positions):
        calls.append("with_rope")
        _attend(rope_reference(q, table, positions), rope_reference(k, table, positions), v, out)

    if fused:
        run.with_rope = with_rope
    return run


def _variants():
    """(name, fn(qkv, table, positions), matches): attention calls the pass must take or leave."""
    ops = torch.ops.graphkiln

    def heads(qkv):
        qk, v = qkv.split([(HEADS + KV_HEADS) * DIM, KV_HEADS * DIM], dim=-1)
        return qk.view(-1, HEADS + KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM)

    def model_layer(qkv, table, positions):
        qk, v = heads(qkv)
        q, k = ops.rope(qk, table, positions).split([HEADS, KV_HEADS], dim=1)
        out = q.new_empty(qkv.shape[0], HEADS, DIM)
        ops.attention(q, k, v, out, 0, 0.5)
        return out

    def rotated_q_read_again(qkv, table, positions):
        qk, v = heads(qkv)
        q, k = ops.rope(qk, table, positions).split([HEADS, KV_HEADS], dim=1)
        out = q.new_empty(qkv.shape[0], HEADS, DIM)
        ops.attention(q, k, v, out, 0, 0.5)
        return out + q

    def no_rope(qkv, table, positions):
        qk, v = heads(qkv)
        q, k = qk.split([HEADS, KV_HEADS], dim=1)
        out = q.new_empty(qkv.shape[0], HEADS, DIM)
        ops.attention(q, k, v, out, 0, 0.5)
        return out

    return [("the model's layer", model_layer, 1), ("rotated q read again", rotated_q_read_again, 0),
            ("no rope", no_rope, 0)]


@pytest.mark.parametrize("fused", [False, True], ids=["rope then attention", "attention rotates"])
@pytest.mark.parametrize("name,fn,matches", _variants(), ids=[v[0] for v in _variants()])
def test_pass_takes_rope_before_attention_and_the_op_computes_what_the_graph_did(name, fn, matches, fused):
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * DIM)
    table, positions = torch.randn(16, 2 * DIM), torch.tensor([3, 0, 9, 15, 4])
    gm = dynamo_graph(fn, qkv, table, positions)
    assert RopeAttention()(gm) == matches
    gm.graph.lint()
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.graphkiln.rope_attention.default) == matches
    assert sum(t is torch.ops.graphkiln.rope for t in targets) == (0 if matches or name == "no rope" else 1)
    feeds = {"L_qkv_": qkv, "L_table_": table, "L_positions_": positions}
    args = [feeds.get(n.target, 5) for n in gm.graph.nodes if n.op == "placeholder"]  # 5: the token count
    calls: list = []
    with forward_context(ForwardContext(_recording(fused, calls))):
        got, want = gm(*args)[0], fn(qkv, table, positions)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert calls[0] == ("with_rope" if fused and matches else "plain")


def test_compiled_toy_model_with_the_pass_matches_eager(toy):
    """Every layer's rope and attention taken, each call still a split point (an attention piece a layer), and
    the compiled model's logits the eager model's."""
    compiled, report = compile_module(toy, CompileConfig(enabled_passes=("rope_attention",)))
    assert {r.name: r for r in report.passes}["rope_attention"].matches == TOY.num_layers
    assert report.counters.attention_pieces == TOY.num_layers
    eager_and_compiled_agree(toy, compiled)


def test_triton_decode_plans_rotate_q_and_k_in_the_kernel_up_to_a_batch_of_eight():
    """The row decode kernel's plan offers `with_rope` for decode batches up to ROPE_IN_DECODE_ROWS rows, where it
    measured faster, and not for larger ones or prefill, where the op launches the rope kernel first."""
    pytest.importorskip("triton")
    from graphkiln.runtime.attention.metadata import SequenceSlice, build_metadata, pad_decode
    from graphkiln.runtime.attention.triton_backend import ROPE_IN_DECODE_ROWS, TritonBackend
    from graphkiln.runtime.kv_cache import KVCache

    backend = TritonBackend(KVCache(TOY, 16, 16, torch.float16, torch.device("cpu")))

    def plan(rows: int, query_len: int = 1):
        slices = pad_decode([SequenceSlice(query_len, 5, (1,))], rows) if query_len == 1 else [
            SequenceSlice(query_len, query_len, (1,))]
        meta = build_metadata(slices, 16, rows if query_len == 1 else query_len, torch.device("cpu"))
        return backend.plan(meta)

    assert [hasattr(plan(rows), "with_rope") for rows in (1, ROPE_IN_DECODE_ROWS, ROPE_IN_DECODE_ROWS + 1, 64)] == [
        True, True, False, False]
    assert not hasattr(plan(1, query_len=5), "with_rope")


def test_triton_plans_go_with_their_step_without_a_collection():
    """No plan is a reference cycle (`with_rope` beside the function that holds it): freed by its last reference,
    not by a collection, which a load keeps off, freezing what is left (gc_pauses.py) with the backend and the
    step's metadata it holds."""
    pytest.importorskip("triton")
    from graphkiln.runtime.attention.metadata import SequenceSlice, build_metadata, pad_decode
    from graphkiln.runtime.attention.triton_backend import TritonBackend
    from graphkiln.runtime.kv_cache import KVCache

    backend = TritonBackend(KVCache(TOY, 16, 16, torch.float16, torch.device("cpu")))
    metas = [build_metadata(pad_decode([SequenceSlice(1, 5, (1,))], rows), 16, rows, torch.device("cpu"))
             for rows in (1, 64)]
    metas.append(build_metadata([SequenceSlice(5, 5, (1,))], 16, 5, torch.device("cpu")))
    gc.disable()
    try:
        for meta in metas:
            plan = weakref.ref(backend.plan(meta))
            assert plan() is None
    finally:
        gc.enable()
