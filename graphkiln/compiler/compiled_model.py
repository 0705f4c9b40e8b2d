"""CompiledModel: the split graph with compiled pieces in place, bound to a model's weights.

Calling it runs `input_ids [T], positions [T] -> hidden [T, hidden_size]` through the stitching
graph: compiled pieces, and attention submodules that call the custom op eagerly. The split
graph itself keeps the pieces' FX graphs (an artifact keeps only the attention submodules'); the
callable stitching module is built beside it, so wrapping the pieces (`with_pieces`) makes a new
CompiledModel and never changes this one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .capture import Binding
from .split import SplitGraph


class CompiledModel:
    def __init__(
        self,
        split: SplitGraph,
        bindings: list[Binding],
        pieces: dict[str, Callable],
        tensors: dict[str, torch.Tensor],
    ) -> None:
        self.split = split
        self.bindings = bindings
        self.pieces = pieces
        self.tensors = tensors
        modules = {name: pieces.get(name) or split.gm.get_submodule(name) for name, _ in split.submodules}
        self._stitch = torch.fx.GraphModule(modules, split.gm.graph)
        self._args: list = [tensors[b.name] if b.kind == "tensor" else None for b in bindings]
        self._inputs = [(i, b) for i, b in enumerate(bindings) if b.kind != "tensor"]

    def with_pieces(self, wrap: Callable[[str, Callable], Callable]) -> CompiledModel:
        """A CompiledModel calling `wrap(name, piece)` in place of every piece (a runtime's graph wrappers)."""
        wrapped = {name: wrap(name, piece) for name, piece in self.pieces.items()}
        return CompiledModel(self.split, self.bindings, wrapped, self.tensors)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = list(self._args)
        feeds = {"input_ids": input_ids, "positions": positions}
        for i, b in self._inputs:
            args[i] = input_ids.shape[0] if b.kind == "num_tokens" else feeds[b.name]
        return self._stitch(*args)[0]

