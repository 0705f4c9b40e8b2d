"""graph.json (compiler/graph_file.py): an FX graph written as its nodes and rebuilt without a trace."""

from __future__ import annotations

import math
import operator
from pathlib import Path

import pytest
import torch

from graphkiln.compiler.graph_file import read_graph, write_graph
from graphkiln.errors import ArtifactError


def _stitching_graph() -> torch.fx.GraphModule:
    """A graph of every node kind and argument kind the format keeps, calling one attention-like submodule (a
    graph of its own) and one piece (an empty module in the file)."""
    attention = torch.fx.Graph()
    q = attention.placeholder("q")
    attention.output((attention.call_function(torch.ops.aten.mul.Tensor, (q, q)),))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    scale = graph.placeholder("scale", default_value=2.0)
    cast = graph.call_method("to", (x,), {"dtype": torch.float32, "device": torch.device("cpu")})
    part = graph.call_function(operator.getitem, (cast, (slice(None, 3, None), slice(1, None))))
    summed = graph.call_function(torch.add, (part, scale), {"alpha": 0.5})
    first = graph.call_function(operator.getitem, (graph.call_module("submod_1", (summed,)), 0))
    root = graph.call_function(torch.ops.aten.sqrt, (first,))
    out = graph.call_module("submod_0", (root,))
    graph.output({"out": out, "sizes": [math.inf, -1, None, True], "pair": (first, "name")})
    modules = {"submod_0": torch.nn.Identity(), "submod_1": torch.fx.GraphModule(torch.nn.Module(), attention)}
    return torch.fx.GraphModule(modules, graph)


def test_a_graph_comes_back_node_for_node_and_computes_the_same(tmp_path: Path) -> None:
    gm = _stitching_graph()
    write_graph(tmp_path / "graph.json", gm, ["submod_1"], ["submod_0"])
    back = read_graph(tmp_path / "graph.json")
    assert back.code == gm.code and back.submod_1.code == gm.submod_1.code
    assert type(back.submod_0) is torch.nn.Module  # a piece: its compiled code goes here at load
    back.submod_0 = torch.nn.Identity()
    x = torch.arange(20.0).reshape(5, 4)
    want, got = gm(x, 3.0), back(x, 3.0)
    assert torch.equal(got["out"], want["out"]) and got["sizes"] == want["sizes"]
    assert torch.equal(back(x)["out"], gm(x)["out"])  # the placeholder's default


def test_reading_traces_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes are created, not traced: an FX trace patches every module call in the process while it runs."""
    write_graph(tmp_path / "graph.json", _stitching_graph(), ["submod_1"], ["submod_0"])

    def no_trace(*args, **kwargs):
        raise AssertionError("traced")

    monkeypatch.setattr(torch.fx.Tracer, "trace", no_trace)
    read_graph(tmp_path / "graph.json")


def test_a_node_the_format_cannot_keep_is_refused_when_written_naming_it(tmp_path: Path) -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(lambda t: t, (x,)))
    with pytest.raises(ValueError, match=r"graph node _lambda_: cannot write its function <function .*<lambda>"):
        write_graph(tmp_path / "graph.json", torch.fx.GraphModule(torch.nn.Module(), graph), [], [])
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.add, (x, torch.ones(2))))
    with pytest.raises(ValueError, match=r"graph node add: cannot write an argument of type Tensor"):
        write_graph(tmp_path / "graph.json", torch.fx.GraphModule(torch.nn.Module(), graph), [], [])
    assert not (tmp_path / "graph.json").exists()


def test_a_file_that_is_not_a_graph_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "graph.json"
    path.write_text('{"graph": [{"op": "placeholder", "name": "x", "target": "x", "args": {"code": 1}, "kwargs": {}}],'
                    ' "attention": {}, "pieces": []}')  # fmt: skip
    with pytest.raises(ArtifactError, match=rf"{path}: this graphkiln cannot rebuild it \(ValueError: unknown value tag"):
        read_graph(path)
