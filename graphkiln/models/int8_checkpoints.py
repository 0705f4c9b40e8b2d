"""int8 checkpoints as their publishers store them, read into Int8Linear's layout (int8 weight [N, K], float32
scales [N] or [N, K/128]).

- compressed-tensors int-quantized (llm-compressor's W8A8): `weight` int8 [N, K], `weight_scale` [N, 1] (or one
  per tensor), `input_scale` when static; older exports store zero points of symmetric int8 as well
  (`weight_zero_point`, `input_zero_point`), which must be zero.
- compressed-tensors pack-quantized with 8 bits (W8A16): `weight_packed` int32 [N, K/4], four values a word
  along K, each stored as q + 128 with the lowest byte first, so the words' little-endian bytes less 128 are
  the int8 weight; `weight_scale` [N, 1] or per group [N, K/G]; `weight_shape` [N, K].
- GPTQ with 8 bits (AutoGPTQ, GPTQModel: Qwen's `*-GPTQ-Int8`), symmetric: `qweight` int32 [K/4, N], four
  unsigned bytes a word along K; `qzeros` [K/G, N/4] packed along N, all 128 (stored as 127 in the "gptq"
  checkpoint_format, which keeps zero points minus one); `scales` [K/G, N]; `g_idx` [K]. w = (q - 128) * s:
  the bytes less 128 again, after a transpose.
Groups are 128 inputs (int8_linear.GROUP), the tile fp8's kernels step by; GPTQ's group_size -1 is a scale per channel.
"""

from __future__ import annotations

import torch

from graphkiln.errors import UnsupportedModelError

from .int4_checkpoints import check_weight_shape, checked
from .int8_linear import Int8Linear

SYMMETRIC_ZERO = 128
PACKED_KINDS = ("weight_packed", "weight_scale", "weight_shape")
GPTQ_KINDS = ("qweight", "qzeros", "scales")
ZERO_POINTS = ("weight_zero_point", "input_zero_point")  # symmetric int8 from older compressed-tensors exports


def checkpoint_kinds(module: Int8Linear) -> list[str]:
    """The tensors every int8 projection of the module's checkpoint format must hold (a bias besides)."""
    if module.source.startswith("gptq"):
        return [*GPTQ_KINDS]
    if module.packed:
        return [*PACKED_KINDS]
    return [name for name, _ in module.named_parameters() if name != "bias"]


def reads(module: Int8Linear, kind: str) -> bool:
    """Whether `fill_int8` reads this kind of tensor (the rest are read as fp8 layers read them)."""
    return kind in (*PACKED_KINDS, *GPTQ_KINDS, *ZERO_POINTS, "g_idx") and (kind != "weight_scale" or module.grouped)


def _signed(unsigned_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 values q + 128 -> the int8 values q."""
    return (unsigned_bytes ^ 0x80).view(torch.int8)


def fill_int8(module: Int8Linear, kind: str, part: int, tensor: torch.Tensor, where: str) -> None:
    """Copy one checkpoint tensor of fused part `part` of an int8 projection (a kind `reads` takes) into `module`."""
    weight, scale = module.weight.split(module.parts)[part], module.weight_scale.split(module.parts)[part]
    n, k = weight.shape
    if kind == "weight_packed":
        weight.copy_(_signed(checked(tensor, (n, k // 4), where, torch.int32).contiguous().view(torch.uint8)))
    elif kind == "qweight":  # words along K: transposed, their bytes are the values
        weight.copy_(_signed(checked(tensor, (k // 4, n), where, torch.int32).t().contiguous().view(torch.uint8)))
    elif kind == "weight_scale":
        scale.copy_(checked(tensor, tuple(scale.shape), where))
    elif kind == "scales":
        scale.copy_(checked(tensor, (scale.shape[-1] if module.grouped else 1, n), where).t().reshape(scale.shape))
    elif kind == "weight_shape":
        check_weight_shape(tensor, [module.checkpoint_parts[part], module.checkpoint_in_features], where)
    elif kind == "qzeros":
        zeros = tensor.contiguous().view(torch.uint8).int() + (module.source == "gptq")  # v1 stores z - 1
        if not torch.all(zeros == SYMMETRIC_ZERO):
            raise UnsupportedModelError(f"{where}: zero points other than {SYMMETRIC_ZERO} (asymmetric int8); "
                                        "graphkiln reads symmetric int8")
    elif kind == "g_idx":
        full_k = module.checkpoint_in_features
        group = module.group_size or full_k
        runs = torch.arange(full_k, device=tensor.device) // group
        if tensor.numel() != full_k or not torch.equal(tensor.long().reshape(-1), runs):
            raise UnsupportedModelError(f"{where}: group indices that are not runs of {group} inputs (act-order "
                                        "int8); graphkiln reads int8 without act-order")
    elif tensor.count_nonzero():  # ZERO_POINTS
        raise UnsupportedModelError(f"{where}: non-zero {kind} (asymmetric int8); graphkiln reads symmetric int8")
