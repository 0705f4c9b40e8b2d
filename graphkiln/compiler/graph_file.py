"""The stitching graph as JSON (graph.json): its nodes and those of each attention submodule, rebuilt at load
into FX GraphModules by creating the nodes, without a trace.

Unpickling a GraphModule (the format before) traces its code with torch.fx, which patches torch.nn.Module's
call in every thread while it runs: a model's forward beside it fails, so a load had to order its eager work
around it. It also runs whatever the pickle names. This file names functions only by module and name, from
the modules of FUNCTION_MODULES, and ops by their torch.ops name; nothing of it runs before the graph is called.
A node or value of another kind is refused when the artifact is written, naming the node.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from graphkiln.errors import ArtifactError

from .manifest import FIX

GRAPH_FILE = "graph.json"
FUNCTION_MODULES = ("_operator", "operator", "builtins", "math", "torch")  # and their submodules
_OPS = ("placeholder", "call_module", "call_function", "call_method", "get_attr", "output")


def write_graph(path: Path, gm: torch.fx.GraphModule, attention: list[str], pieces: list[str]) -> None:
    """Write `gm`'s graph, each attention submodule's graph (by name) and the names of the pieces (empty modules
    at load, where the compiled code goes)."""
    data = {
        "graph": _nodes(gm.graph),
        "attention": {name: _nodes(gm.get_submodule(name).graph) for name in attention},
        "pieces": list(pieces),
    }
    path.write_text(json.dumps(data))


def read_graph(path: Path) -> torch.fx.GraphModule:
    """The GraphModule `write_graph` wrote (its file's sha256 already checked): refused with ArtifactError, naming
    the file, where this graphkiln lacks a function or op it names or cannot read it."""
    try:
        data = json.loads(path.read_bytes())
        modules: dict[str, torch.nn.Module] = {name: torch.nn.Module() for name in data["pieces"]}
        for name, nodes in data["attention"].items():
            modules[name] = torch.fx.GraphModule(torch.nn.Module(), _graph(nodes))
        return torch.fx.GraphModule(modules, _graph(data["graph"]))
    except Exception as e:
        raise ArtifactError(f"{path}: this graphkiln cannot rebuild it ({type(e).__name__}: {e}); {FIX}") from e


def _nodes(graph: torch.fx.Graph) -> list[dict]:
    return [{"op": n.op, "name": n.name, "target": _target(n), "args": _value(n.args, n), "kwargs": _value(n.kwargs, n)}
            for n in graph.nodes]  # fmt: skip


def _target(node: torch.fx.Node) -> Any:
    target = node.target
    if node.op != "call_function":
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return {"op": str(target)}  # "graphkiln.attention" or "aten.mm.default"
    module = getattr(target, "__module__", None)
    for name in (getattr(target, "__qualname__", None), getattr(target, "__name__", None)):  # torch.add: by name
        if module and name and _allowed(module) and _resolves(module, name, target):
            return {"function": [module, name]}
    raise ValueError(f"graph node {node.name}: cannot write its function {target!r} (not an op, nor a function of "
                     f"{', '.join(FUNCTION_MODULES)})")  # fmt: skip


def _value(value: Any, node: torch.fx.Node) -> Any:
    """A node's argument as JSON: scalars as they are, a list as a list, anything else tagged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        items = [_value(v, node) for v in value]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _value(v, node) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [_value(v, node) for v in (value.start, value.stop, value.step)]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise ValueError(f"graph node {node.name}: cannot write an argument of type {type(value).__name__}")


def _graph(nodes: list[dict]) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}
    for n in nodes:
        if n["op"] not in _OPS:
            raise ValueError(f"node {n['name']}: unknown kind {n['op']!r}")
        target = _read_target(n["target"]) if n["op"] == "call_function" else n["target"]
        args, kwargs = _read(n["args"], made), _read(n["kwargs"], made)
        made[n["name"]] = graph.create_node(n["op"], target, args, kwargs, name=n["name"])
        if made[n["name"]].name != n["name"]:
            raise ValueError(f"node {n['name']}: the name is taken")
    graph.lint()
    return graph


def _read_target(target: dict) -> Any:
    if "op" in target:
        namespace, *rest = target["op"].split(".")
        op = getattr(torch.ops, namespace)
        for part in rest:
            op = getattr(op, part)
        return op
    module, name = target["function"]
    if not _allowed(module):
        raise ValueError(f"function {module}.{name}: not of {', '.join(FUNCTION_MODULES)}")
    return _function(module, name)


def _read(value: Any, made: dict[str, torch.fx.Node]) -> Any:
    if isinstance(value, list):
        return [_read(v, made) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, inner), = value.items()
    if tag == "node":
        return made[inner]
    if tag == "tuple":
        return tuple(_read(v, made) for v in inner)
    if tag == "dict":
        return {k: _read(v, made) for k, v in inner.items()}
    if tag == "slice":
        return slice(*(_read(v, made) for v in inner))
    if tag == "dtype":
        dtype = getattr(torch, inner)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{inner!r} is not a torch dtype")
        return dtype
    if tag == "device":
        return torch.device(inner)
    raise ValueError(f"unknown value tag {tag!r}")


def _allowed(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in FUNCTION_MODULES)


def _resolves(module: str, name: str, target: Any) -> bool:
    try:
        return _function(module, name) is target
    except (ImportError, AttributeError):
        return False


def _function(module: str, name: str) -> Any:
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found
