"""Passes: each pass's effect on op counts and boundary tensors, numerics after Inductor, switching
off by name, the pass manager's uuid and its refusal of cache-bypassing passes."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from test_compiler import TOY, CountingAttention, toy_model
from torch._inductor.compile_fx import compile_fx

from graphkiln import CompileConfig
from graphkiln.compiler.capture import capture
from graphkiln.compat import inductor_output_code
from graphkiln.compiler.compile import compile_module
from graphkiln.compiler.inductor import InductorCompiler
from graphkiln.compiler.split import split_pieces
from graphkiln.errors import ConfigError
from graphkiln.models.attention import ForwardContext, forward_context
from graphkiln.passes.attention_split import AttentionSplit, boundaries
from graphkiln.passes.base import GraphPass, PostGradPass, content_hash
from graphkiln.passes.linear_op import LinearOp
from graphkiln.passes.manager import PassManager
from graphkiln.passes.pipeline import default_passes, passes_off
from graphkiln.passes.symm_mem_all_reduce import SymmMemAllReduce, SymmMemAllReduceConfig

DYNAMO_NAMES = ["silu_mul_epilogue", "attention_split"]
OFF_BY_DEFAULT = ["add_rms_norm", "fp8_norm_quant", "int4_norm_words", "rope_attention",
                  "symm_mem_all_reduce"]  # in CPU compiles
NAMES = ["silu_mul_epilogue", "fp8_mlp", "silu_mul_linear", "add_rms_norm", "fp8_norm_quant", "int4_norm_words",
         "rope_attention", "attention_split", "linear_op", "symm_mem_all_reduce"]


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    """Dynamo's FX graph of fn(*args), the first argument's dim 0 dynamic."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.mark_dynamic(args[0], 0)
    with forward_context(ForwardContext(CountingAttention())), torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return graphs[0]


def inductor_with(graph_pass, fn):
    """fn compiled by Inductor after `graph_pass` rewrote its Dynamo graph."""

    def backend(gm, example_inputs):
        graph_pass(gm)
        gm.recompile()
        return compile_fx(gm, example_inputs)

    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)


def ops(gm: torch.fx.GraphModule) -> Counter:
    return Counter(n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
                   for n in gm.graph.nodes if n.op in ("call_method", "call_function"))


def run_manager(gm: torch.fx.GraphModule, disabled=()) -> PassManager:
    manager = PassManager(default_passes(), disabled)
    manager.run_dynamo(gm)
    return manager


def boundary_counts(gm: torch.fx.GraphModule) -> list[int]:
    return [len(cut) for cut in boundaries(split_pieces(gm).gm)]


def eager_and_compiled_agree(model, compiled, token_counts=(1, 7, 33)) -> None:
    with forward_context(ForwardContext(CountingAttention())), torch.no_grad():
        for n in token_counts:
            ids = torch.randint(0, TOY.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
            torch.testing.assert_close(compiled(ids, torch.arange(n)), model(ids, torch.arange(n)), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def toy():
    return toy_model()


@pytest.fixture(scope="module")
def toy_graph(toy):
    """A fresh copy of the toy model's Dynamo graph per call (passes rewrite in place)."""
    captured = capture(toy)
    return lambda: torch.fx.GraphModule(captured.gm, copy.deepcopy(captured.gm.graph))


@pytest.mark.parametrize("name", DYNAMO_NAMES)
def test_a_pass_switched_off_by_name_does_nothing(toy_graph, name):
    on, off, absent = toy_graph(), toy_graph(), toy_graph()
    run_manager(on)
    assert run_manager(off, disabled=(name,)).records[name].runs == 0
    PassManager([p for p in default_passes() if p.name != name]).run_dynamo(absent)
    code = [gm.print_readable(print_output=False) for gm in (on, off, absent)]
    assert code[1] == code[2] != code[0]


def test_rope_reads_the_table_and_positions_in_each_piece(toy, toy_graph):
    """Each layer's rope takes the cos/sin table and the positions, graph inputs both: no cut carries gathered
    rows, and the pieces before an attention call rotate their own layer's heads."""
    gm = toy_graph()
    run_manager(gm)
    # cuts carry q, k, v, out and the residual, fewer past the last attention
    assert boundary_counts(gm) == [5, 2, 5, 2]
    split = split_pieces(gm)
    ropes = [sum(n.target is torch.ops.graphkiln.rope for n in split.gm.get_submodule(name).graph.nodes)
             for name in split.pieces]
    assert ropes == [1, 1, 0]
    compiled, report = compile_module(toy, CompileConfig())
    assert report.counters.unique_pieces == 3
    eager_and_compiled_agree(toy, compiled)


def test_attention_split_isolates_each_attention_call_and_off_compiles_one_piece(toy, toy_graph):
    gm = toy_graph()
    assert AttentionSplit()(gm) == 2
    split = split_pieces(gm)
    assert [attn for _, attn in split.submodules] == [False, True, False, True, False]
    whole = toy_graph()
    run_manager(whole, disabled=("attention_split",))
    assert [attn for _, attn in split_pieces(whole).submodules] == [False]
    compiled, report = compile_module(toy, CompileConfig(disabled_passes=("attention_split",)))
    report.counters.expect(pieces=1, attention_pieces=0, unique_pieces=1, inductor_compiles=1)
    eager_and_compiled_agree(toy, compiled)


def test_default_pipeline_matches_eager_and_reports_every_pass(toy):
    compiled, report = compile_module(toy, CompileConfig())
    eager_and_compiled_agree(toy, compiled)
    assert [(r.name, r.enabled) for r in report.passes] == [(n, n not in OFF_BY_DEFAULT) for n in NAMES]
    epilogue, mlp, silu_mul, norm, norm_quant, norm_words, rope, split, *_ = report.passes  # linear_op: in Inductor
    assert norm.runs == norm_quant.runs == norm_words.runs == rope.runs == 0
    assert (mlp.runs, mlp.matches) == (1, 0)  # a bf16 model
    # per layer: the gate/up linear, chunk, two getitems, silu and mul become one linear_silu_mul
    assert (epilogue.runs, epilogue.matches, epilogue.nodes_removed, epilogue.nodes_added) == (1, 2, 12, 2)
    assert (silu_mul.runs, silu_mul.matches) == (1, 0)
    assert (split.runs, split.matches, split.nodes_removed) == (1, 2, 0)


def test_default_passes_depend_on_the_compile_device():
    """add_rms_norm, fp8_norm_quant, int4_norm_words and rope_attention run by default in CUDA compiles only;
    symm_mem_all_reduce only when named; disabled wins."""
    passes = default_passes()
    cuda_only = {"add_rms_norm", "fp8_norm_quant", "int4_norm_words", "rope_attention"}
    assert passes_off(passes, ()) == {*cuda_only, "symm_mem_all_reduce"}
    assert passes_off(passes, (), device="cuda") == {"symm_mem_all_reduce"}
    assert passes_off(passes, (), ("add_rms_norm",)) == cuda_only - {"add_rms_norm"} | {"symm_mem_all_reduce"}
    assert passes_off(passes, ("add_rms_norm",), device="cuda") == {"add_rms_norm", "symm_mem_all_reduce"}
    assert passes_off(passes, ("rope_attention",), device="cuda") == {"rope_attention", "symm_mem_all_reduce"}
    assert passes_off(passes, (), ("rope_attention",)) == cuda_only - {"rope_attention"} | {"symm_mem_all_reduce"}
    records = PassManager(default_passes(), device="cuda").records
    assert [n for n in NAMES if not records[n].enabled] == ["symm_mem_all_reduce"]
    assert PassManager(default_passes(), device="cuda").uuid() != PassManager(default_passes()).uuid()


def test_unknown_pass_name_is_a_config_error_listing_known_names(toy):
    with pytest.raises(ConfigError, match="unknown pass nope; known: " + ", ".join(NAMES)):
        compile_module(toy, CompileConfig(disabled_passes=("nope",)))


class Untracked(GraphPass):
    name = "untracked"

    def uuid(self):
        return None

    def __call__(self, gm):
        return 0


def test_passes_without_uuid_are_refused():
    with pytest.raises(ConfigError, match="no uuid"):
        PassManager([lambda graph: None])
    with pytest.raises(ConfigError, match="no uuid"):
        PassManager([Untracked()])
    with pytest.raises(ConfigError, match="twice"):
        PassManager([AttentionSplit(), AttentionSplit()])


def test_uuid_changes_with_enabled_passes_and_pass_config():
    base = PassManager(default_passes()).uuid()
    assert PassManager(default_passes()).uuid() == base
    assert PassManager(default_passes(), ["silu_mul_epilogue"]).uuid() != base
    named = PassManager(default_passes(), enabled=("symm_mem_all_reduce",)).uuid()
    configured = [p if p.name != "symm_mem_all_reduce" else SymmMemAllReduce(SymmMemAllReduceConfig(max_bytes=1 << 10))
                  for p in default_passes()]
    assert PassManager(configured, enabled=("symm_mem_all_reduce",)).uuid() not in (named, base)


def test_uuid_is_stable_across_processes_and_folder_moves(tmp_path):
    code = ("from graphkiln.passes.manager import PassManager; from graphkiln.passes.pipeline import default_passes; "
            "print(PassManager(default_passes()).uuid())")
    other = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "1"})
    assert other.stdout.strip() == PassManager(default_passes()).uuid()
    source = sys.modules[AttentionSplit.__module__].__file__
    moved = [shutil.copy(source, tmp_path / name) for name in ("a.py", "b.py")]
    assert content_hash(moved[:1]) == content_hash(moved[1:]) == content_hash([source])
    (tmp_path / "b.py").write_text(open(source).read() + "\n")
    assert content_hash(moved[1:]) != content_hash(moved[:1])


@dataclass(frozen=True)
class Nonce:
    value: int


class CountMatmuls(PostGradPass):
    """A test pass that only counts aten.mm/addmm nodes; a nonce config forces an Inductor cache miss."""

    name = "count_matmuls"

    def __init__(self, config: Nonce) -> None:
        self.config = config

    def __call__(self, graph: torch.fx.Graph) -> int:
        return sum(str(n.target) in ("aten.mm.default", "aten.addmm.default") for n in graph.nodes)


def test_linear_op_takes_weight_products_and_leaves_other_matmuls(tmp_path):
    def fn(x, w, bias, other):
        return (torch.nn.functional.linear(x, w) + bias) @ other

    x, w, bias, other = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6), torch.randn(6, 3)
    gm = dynamo_graph(fn, x, w, bias, other)
    linear_op, remaining = LinearOp(), CountMatmuls(Nonce(int.from_bytes(os.urandom(8))))
    manager = PassManager([linear_op, remaining], dump=lambda *args: None)
    compiler = InductorCompiler(torch.device("cpu"), post_grad_pass=manager)
    with inductor_output_code() as codes:
        piece = compiler.compile_piece(gm, ())
    assert manager.records["linear_op"].matches == 1  # x @ w^T (+ bias); `@ other` is no weight product
    assert manager.records["count_matmuls"].matches == 1
    code, = codes
    assert "torch.ops.graphkiln.linear.default" in code and "addmm" not in code
    for rows in (1, 4):
        feeds = {"L_x_": x[:rows], "L_w_": w, "L_bias_": bias, "L_other_": other}
        args = [feeds.get(n.target, rows) for n in gm.graph.nodes if n.op == "placeholder"]
        torch.testing.assert_close(piece(*args)[0], fn(x[:rows], w, bias, other))


def test_post_grad_pass_runs_inside_inductor_and_stays_cacheable(tmp_path):
    gm = dynamo_graph(lambda x, w: torch.relu(x @ w), torch.randn(5, 8), torch.randn(8, 8))
    dumped = []
    manager = PassManager([CountMatmuls(Nonce(int.from_bytes(os.urandom(8))))],
                          dump=lambda *args: dumped.append(args[1:3]))
    compiler = InductorCompiler(torch.device("cpu"), post_grad_pass=manager)
    piece = compiler.compile_piece(gm, ())
    assert compiler.options["post_grad_custom_post_pass"] is manager
    record, = manager.records.values()
    assert (record.stage, record.runs, record.matches) == ("post_grad", 1, 1)
    assert dumped == [("count_matmuls", "before"), ("count_matmuls", "after")]
    piece.artifacts["dynamic"].save(path=str(tmp_path / "piece.bin"), format="binary")  # no cache bypass
    x, w = torch.randn(3, 8), torch.randn(8, 8)
    feeds = {"L_x_": x, "L_w_": w}
    args = [feeds.get(n.target, 3) for n in gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(piece(*args)[0], torch.relu(x @ w))
