"""Which slice of a quantized checkpoint tensor one tensor-parallel rank reads.

A rank holds some output rows of q/k/v and gate/up, and some input columns of o and down
(models/sharding.py gives them as a Part of the projection's [N, K] weight). Each checkpoint format
lays a projection's tensors out its own way, so the same rows or columns are another slice of each:
SLICES says, per format and tensor kind, along which dimension of the stored tensor a rank's output
rows and input columns run, and how many outputs or inputs one index there stands for (a packed
word's 8 int4 or 4 int8 values, a group's G, a block's 128). A rank reads only its slice of a tensor
that is split, and the format's reader (quantized_layers.fill_quantized) then fills it into the rank's
module as it would a whole one. A tensor without an entry for the rank's direction (a per-tensor scale,
a channel scale of a row-parallel projection, group indices) is read whole by every rank.
"""

from __future__ import annotations

import math

from graphkiln.errors import UnsupportedModelError

from .int8_linear import Int8Linear
from .quantized_linear import BLOCK, BlockFp8Linear, Int4Linear, QuantizedLinear
from .sharding import Part

GROUP = "group"  # the unit is the module's group size
Spec = tuple[int, int | str] | None  # (dimension of the stored tensor, outputs or inputs an index there)
FP8 = {
    "weight": ((0, 1), (1, 1)),
    "weight_scale": ((0, 1), None),
    "weight_scale_inv": ((0, BLOCK), (1, BLOCK)),
    "input_scale": (None, None),
}
INT8 = {**FP8, "weight_packed": ((0, 1), (1, 4)), "weight_shape": (None, None)}  # compressed-tensors' words
SLICES: dict[str, dict[str, tuple[Spec, Spec]]] = {  # format -> kind -> (output rows, input columns)
    "fp8": FP8,
    "fp8-blocks": {**FP8, "weight_scale": ((0, BLOCK), (1, BLOCK))},  # compressed-tensors' block scales
    "int8": INT8,
    "int8-grouped": {**INT8, "weight_scale": ((0, 1), (1, GROUP))},
    "int8-gptq": {"qweight": ((1, 1), (0, 4)), "scales": ((1, 1), None)},  # qzeros and g_idx read whole
    "int8-gptq-grouped": {"qweight": ((1, 1), (0, 4)), "scales": ((1, 1), (0, GROUP))},
    "compressed-tensors": {
        "weight_packed": ((0, 1), (1, 8)),
        "weight_scale": ((0, 1), (1, GROUP)),
        "weight_zero_point": ((0, 8), (1, GROUP)),
        "weight_shape": (None, None),
        "weight_g_idx": (None, None),
    },
    "gptq": {"qweight": ((1, 1), (0, 8)), "qzeros": ((1, 8), (0, GROUP)), "scales": ((1, 1), (0, GROUP)),
             "g_idx": (None, None)},
    "awq": {"qweight": ((1, 8), (0, 1)), "qzeros": ((1, 8), (0, GROUP)), "scales": ((1, 1), (0, GROUP))},
}
SLICES["gptq_v2"] = SLICES["gptq"]
# int4 with a scale and zero point per channel: the whole (one-group) column of them serves every rank's inputs
SLICES |= {f"{fmt}-channel": {kind: (rows, None if cols and cols[1] == GROUP else cols)
                              for kind, (rows, cols) in SLICES[fmt].items()}
           for fmt in ("compressed-tensors", "gptq", "gptq_v2")}
BIAS = ((0, 1), None)


def quantized_slice(module: QuantizedLinear, kind: str, shape: tuple[int, ...], part: Part | None,
                    where: str) -> Part | None:
    """The slice of checkpoint tensor `kind` (of `shape`) of `module`'s projection that holds the rank's `part` of
    the projection ((0, r0, r1): output rows; (1, c0, c1): input columns), in the stored tensor's coordinates;
    None: the whole tensor."""
    if part is None:
        return None
    fmt = _layout(module)
    kinds = SLICES[fmt]
    if kind == "bias":
        spec = BIAS[part[0]]
    elif kind in kinds:
        spec = kinds[kind][part[0]]
    else:
        return None  # fill_quantized names a tensor without a place
    if spec is None or math.prod(shape) == 1:  # a per-tensor scale serves every rank
        return None
    dim, unit = spec
    unit = module.group_size if unit == GROUP else unit
    _, start, stop = part
    end = -(-stop // unit)
    if start % unit or (stop % unit and end != shape[dim]):  # a partial unit only at the tensor's end
        what = "input columns" if part[0] else "output rows"
        raise UnsupportedModelError(
            f"{where}: a tensor-parallel rank's {what} {start}..{stop} do not fall on whole units of {unit} "
            f"(packed words, groups or blocks) of this {fmt} checkpoint; use fewer ranks"
        )
    return dim, start // unit, end


def _layout(module: QuantizedLinear) -> str:
    """The SLICES entry of a module's checkpoint format."""
    if isinstance(module, Int4Linear):
        return f"{module.source}{'-channel' if module.channel_scales else ''}"
    if isinstance(module, Int8Linear):
        gptq = "-gptq" if module.source.startswith("gptq") else ""
        return f"int8{gptq}{'-grouped' if module.grouped else ''}"
    return "fp8-blocks" if isinstance(module, BlockFp8Linear) and module.scale_name == "weight_scale" else "fp8"


def sliced_shape(shape: tuple[int, ...], part: Part | None) -> tuple[int, ...]:
    if part is None:
        return tuple(shape)
    dim, start, stop = part
    return (*shape[:dim], stop - start, *shape[dim + 1:])
