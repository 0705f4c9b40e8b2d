"""CompiledModel: the split graph with compiled pieces in place, bound to a model's weights.

Calling it runs `input_ids [T], positions [T] -> hidden [T, hidden_size]` through the stitching
graph: compiled pieces, and attention submodules that call the custom op eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .capture import Binding
from .inductor import CompiledPiece
from .plan import GraphPlan
from .split import SplitGraph


class CompiledModel:
    def __init__(
        self,
        split: SplitGraph,
        bindings: list[Binding],
        pieces: dict[str, CompiledPiece],
        plans: dict[str, GraphPlan],
        tensors: dict[str, torch.Tensor],
    ) -> None:
        self.split = split
        self.bindings = bindings
        self.pieces = pieces
        self.plans = plans
        self.tensors = tensors
        self.piece_graphs = {name: split.gm.get_submodule(name) for name in pieces}
        for name, piece in pieces.items():
            delattr(split.gm, name)
            setattr(split.gm, name, piece)
        self._args: list = [tensors[b.name] if b.kind == "tensor" else None for b in bindings]
        self._inputs = [(i, b) for i, b in enumerate(bindings) if b.kind != "tensor"]

    def wrap_pieces(self, wrap: Callable[[str, CompiledPiece], Callable]) -> None:
        """Put `wrap(name, piece)` in place of every compiled piece (the runtime's CUDA-graph wrappers)."""
        for name, piece in self.pieces.items():
            delattr(self.split.gm, name)
            setattr(self.split.gm, name, wrap(name, piece))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = list(self._args)
        feeds = {"input_ids": input_ids, "positions": positions}
        for i, b in self._inputs:
            args[i] = input_ids.shape[0] if b.kind == "num_tokens" else feeds[b.name]
        return self.split.gm(*args)[0]
