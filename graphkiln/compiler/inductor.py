"""Per-piece Inductor compiles through `standalone_compile`, deduplicated by graph structure.

`InductorCompiler` is the compile / hash half of a vLLM-style CompilerInterface. A piece is
compiled once with its dynamic token dim and, when asked, once per bucket size with the token
dim fixed. Pieces whose graphs and input metadata are identical (every transformer layer)
share one set of compiled artifacts.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphkiln.errors import ConfigError

from graphkiln.compat import graph_returns_tuple, inductor_output_code, is_op_overload, standalone_compile
from graphkiln.kernels.pdl import pdl_wanted

from .counters import Counters

if TYPE_CHECKING:
    from graphkiln.compat import CustomGraphPass

POST_GRAD_PASS = "post_grad_custom_post_pass"
INDUCTOR_PDL = "triton.enable_pdl"  # Inductor's kernels launched with programmatic dependent launch
OnCode = Callable[[str, str, str], None]  # (piece key, variant, Inductor output code)
AroundCompile = Callable[[str, str], contextlib.AbstractContextManager]  # (piece key, variant) -> context


def _concrete(value, size: int):
    """Replace every free symbol (the token count is the only one) of a SymInt or size by `size`."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr.subs({s: size for s in expr.free_symbols}))
    return int(value)


def placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def example_inputs(gm: torch.fx.GraphModule) -> list:
    """Fake example values recorded by Dynamo, with the token dim symbolic."""
    return [n.meta["example_value"] for n in placeholders(gm)]


def concrete_inputs(gm: torch.fx.GraphModule, size: int, device: torch.device) -> list:
    """Real (uninitialized) inputs with the token dim fixed to `size`, for a specialized compile. Inputs
    the device cannot hold are a ConfigError naming the size, not an allocator's error from inside torch."""
    shaped = []
    for fake in example_inputs(gm):
        if isinstance(fake, torch.Tensor):
            shape = [_concrete(d, size) for d in fake.shape]
            shaped.append((shape, [_concrete(s, size) for s in fake.stride()], fake.dtype))
        else:
            shaped.append(_concrete(fake, size))
    try:
        return [torch.empty_strided(*v[:2], dtype=v[2], device=device) if isinstance(v, tuple) else v for v in shaped]
    except RuntimeError as error:  # torch.OutOfMemoryError on CUDA is one too
        nbytes = sum(math.prod(v[0]) * v[2].itemsize for v in shaped if isinstance(v, tuple))
        raise ConfigError(
            f"specialize size {size}: a piece's example inputs take {nbytes / 2**30:.1f} GiB, which {device} could "
            f"not allocate ({str(error).splitlines()[0][:200]}); choose smaller --specialize-sizes "
            "(CompileConfig.specialize_sizes)"
        ) from None


def token_dim(gm: torch.fx.GraphModule) -> tuple[int, int | None] | None:
    """(argument index, dim or None for a size argument) from which a call reads its token count."""
    for i, fake in enumerate(example_inputs(gm)):
        if isinstance(fake, torch.SymInt):
            return i, None
    for i, fake in enumerate(example_inputs(gm)):
        if isinstance(fake, torch.Tensor) and fake.dim() and isinstance(fake.shape[0], torch.SymInt):
            return i, 0
    return None


def _target_name(target) -> str:
    """A process-independent name for a node target (str() of a function holds its address)."""
    if isinstance(target, str) or is_op_overload(target):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def structure_key(gm: torch.fx.GraphModule) -> str:
    """A hash of the ops, their wiring and the input metadata, blind to node and placeholder names."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}

    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: f"%{index[n]}")

    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            fake = node.meta["example_value"]
            meta = (tuple(map(str, fake.shape)), tuple(map(str, fake.stride())), str(fake.dtype)) if isinstance(
                fake, torch.Tensor
            ) else ("symint",)
            lines.append(f"placeholder {meta}")
        else:
            lines.append(f"{node.op} {_target_name(node.target)} {arg(node.args)} {arg(node.kwargs)}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


@dataclass
class CompiledPiece:
    """A piece's compiled variants; a call picks the one specialized for its token count, else the dynamic one."""

    key: str
    dynamic: Callable
    by_size: dict[int, Callable]
    size_arg: tuple[int, int | None] | None
    returns_tuple: bool
    artifacts: dict[str, object] = field(default_factory=dict, repr=False)

    def variant(self, num_tokens: int) -> Callable:
        return self.by_size.get(num_tokens, self.dynamic)

    def __call__(self, *args):
        fn = self.dynamic
        if self.size_arg is not None and self.by_size:
            index, dim = self.size_arg
            n = args[index] if dim is None else args[index].shape[dim]
            fn = self.by_size.get(n, self.dynamic)
        out = fn(*args)
        if self.returns_tuple:
            return tuple(out)
        return out[0] if isinstance(out, (list, tuple)) else out


class InductorCompiler:
    """Compiles FX pieces with Inductor; identical pieces are compiled once.

    `post_grad_pass` (the pass manager) goes into every compile's config_patches, so its uuid is
    part of Inductor's cache key; `on_code` receives the output code of every compile, and
    `around_compile` gives a context entered around each one (the dumps name post-grad graphs by it).
    """

    def __init__(
        self,
        device: torch.device,
        options: dict | None = None,
        counters: Counters | None = None,
        on_compile: Callable[[int], None] = lambda done: None,
        post_grad_pass: CustomGraphPass | None = None,
        on_code: OnCode | None = None,
        around_compile: AroundCompile | None = None,
    ) -> None:
        self.device = device
        self.options = dict(options or {})
        if device.type == "cuda" and pdl_wanted():  # kernels/pdl.py; measured in README, "Passes and dumps"
            self.options.setdefault(INDUCTOR_PDL, True)
        if post_grad_pass is not None:
            if POST_GRAD_PASS in self.options:
                raise ConfigError(f"CompileConfig.inductor_options sets {POST_GRAD_PASS}; register a pass instead")
            self.options[POST_GRAD_PASS] = post_grad_pass
        self.counters = counters or Counters()
        self.on_compile = on_compile
        self.on_code = on_code
        self.around_compile = around_compile
        self._by_key: dict[str, CompiledPiece] = {}

    def hash(self) -> str:
        """torch version, Inductor options and the pass manager's uuid: what decides the compiled code."""
        options = {k: v.uuid() if k == POST_GRAD_PASS else v for k, v in self.options.items()}
        text = f"{torch.__version__}|{sorted(options.items())}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _compile(self, gm: torch.fx.GraphModule, inputs: list, dynamic_shapes: str, key: str, variant: str):
        options = {"config_patches": self.options} if self.options else None
        around = self.around_compile(key, variant) if self.around_compile else contextlib.nullcontext()
        with around, inductor_output_code() if self.on_code else contextlib.nullcontext([]) as codes:
            art = standalone_compile(gm, inputs, dynamic_shapes, options)
        for code in codes:
            self.on_code(key, variant, code)
        self.counters.inductor_compiles += 1
        self.on_compile(self.counters.inductor_compiles)
        return art

    def compile_piece(self, gm: torch.fx.GraphModule, sizes: tuple[int, ...]) -> CompiledPiece:
        key = structure_key(gm)
        if key in self._by_key:
            self.counters.cache_hits += 1
            return self._by_key[key]
        size_arg = token_dim(gm)
        dynamic = self._compile(gm, example_inputs(gm), "from_graph", key, "dynamic")
        artifacts: dict[str, object] = {"dynamic": dynamic}
        by_size = {}
        for size in sizes if size_arg is not None else ():
            art = self._compile(gm, concrete_inputs(gm, size, self.device), "from_example_inputs", key, str(size))
            self.counters.specialized_compiles += 1
            artifacts[str(size)] = art
            by_size[size] = art
        piece = CompiledPiece(key, dynamic, by_size, size_arg, graph_returns_tuple(gm), artifacts)
        self.counters.unique_pieces += 1
        self._by_key[key] = piece
        return piece
