"""fp8_activation_quant: the per-token fp8 quantization of a projection's input joins the kernel that computes it.

A post-grad pass, off by default (`CompileConfig(enabled_passes=("fp8_activation_quant",))`). Above
FEW_ROWS rows graphkiln::fp8_linear quantizes its input per token in a Triton kernel of its own
before the fp8 product: one more launch, and one more read and write of x, right after the
RMSNorm or SiLU-and-mul kernel Inductor generated to write x. Where x comes from an RMSNorm or a
SiLU-and-mul, this pass writes that quantization as ATen ops (row amax, scale, clamp, cast to
float8_e4m3fn) and calls graphkiln::fp8_scaled_mm (models/fp8_scaled_mm.py) on the result, so
Inductor fuses the quantization into the norm or activation kernel.

fp8_linear chooses by row count at run time: up to FEW_ROWS rows its own kernels take x unquantized
(and round it per 1 x 128 group in registers, or not at all). So the rewrite applies only where the rows are known to be more than FEW_ROWS: in
compiles specialized to such a token count (`CompileConfig.specialize_sizes`, e.g. a prefill
bucket); the dynamic compile, which decode runs, is left as it is. Only per-channel weight scales
with dynamic activations are rewritten (what `--quantization fp8` produces), with K and N multiples
of 16 (what torch._scaled_mm takes).
"""

from __future__ import annotations

import torch

import graphkiln.models.fp8_scaled_mm  # noqa: F401  (registers graphkiln::fp8_scaled_mm)
from graphkiln.kernels.few_rows import FEW_ROWS
from graphkiln.models.quantized_linear import FP8, FP8_MAX, MIN_SCALE

from .base import PostGradPass

aten, prims = torch.ops.aten, torch.ops.prims
FP8_LINEAR = torch.ops.graphkiln.fp8_linear.default
FP8_SCALED_MM = torch.ops.graphkiln.fp8_scaled_mm.default
CAST = prims.convert_element_type.default
MUL = aten.mul.Tensor


def _uncast(node):
    """`node` without the dtype casts around it."""
    while isinstance(node, torch.fx.Node) and node.target is CAST:
        node = node.args[0]
    return node


def _operands(node) -> list:
    """The operands of a multiplication, without their casts; [] for anything else."""
    if not (isinstance(node, torch.fx.Node) and node.target is MUL):
        return []
    return [_uncast(a) for a in node.args]


def _targets(nodes) -> set:
    return {n.target for n in nodes if isinstance(n, torch.fx.Node)}


def _rms_normalized(node) -> bool:
    """h * rsqrt(mean(h^2) + eps)."""
    return aten.rsqrt.default in _targets(_operands(node))


def _silu(node) -> bool:
    """silu(t) as ATen writes it: silu(t), t * sigmoid(t), or t / (1 + exp(-t))."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target is aten.silu.default:
        return True
    if node.target is MUL:
        return aten.sigmoid.default in _targets(node.args)
    if node.target is aten.div.Tensor and isinstance(node.args[1], torch.fx.Node):
        return node.args[1].target is aten.add.Tensor and aten.exp.default in _targets(node.args[1].args)
    return False


def fed_by_norm_or_silu_mul(x: torch.fx.Node) -> bool:
    """x is an RMSNorm's output (normalized, times its weight or not) or silu(gate) * up."""
    x = _uncast(x)
    operands = _operands(x)
    return _rms_normalized(x) or any(_rms_normalized(a) or _silu(a) for a in operands)


def _rewritable(node: torch.fx.Node) -> bool:
    """A dynamic per-token, per-channel fp8_linear of a static row count above FEW_ROWS, fed by a norm or SiLU-mul."""
    if node.target is not FP8_LINEAR or len(node.args) != 4:
        return False
    x, weight, weight_scale, input_scale = node.args
    rows = x.meta["val"].shape[0]
    n, k = weight.meta["val"].shape
    return (input_scale is None and weight_scale.meta["val"].dim() == 1 and isinstance(rows, int)
            and rows > FEW_ROWS and n % 16 == 0 and k % 16 == 0 and fed_by_norm_or_silu_mul(x))


def _call(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    """A new node of `target`, its fake value computed from its arguments' (inside the graph's fake mode)."""
    node = graph.call_function(target, args)
    node.meta["val"] = target(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args))
    return node


class Fp8ActivationQuant(PostGradPass):
    name = "fp8_activation_quant"
    default_enabled = False

    def __call__(self, graph: torch.fx.Graph) -> int:
        matches = 0
        for node in list(graph.nodes):
            if not _rewritable(node):
                continue
            x, weight, weight_scale, _ = node.args
            with graph.inserting_before(node), node.meta["val"].fake_mode:
                xf = _call(graph, CAST, x, torch.float32)
                amax = _call(graph, aten.amax.default, _call(graph, aten.abs.default, xf), [-1], True)
                scale = _call(graph, aten.clamp_min.default, _call(graph, aten.div.Tensor, amax, FP8_MAX), MIN_SCALE)
                scaled = _call(graph, aten.div.Tensor, xf, scale)
                clamped = _call(graph, aten.clamp_max.default, _call(graph, aten.clamp_min.default, scaled, -FP8_MAX),
                                FP8_MAX)
                xq = _call(graph, CAST, clamped, FP8)
                product = _call(graph, FP8_SCALED_MM, xq, scale, weight, weight_scale, node.meta["val"].dtype)
            node.replace_all_uses_with(product)
            graph.erase_node(node)
            matches += 1
        return matches
