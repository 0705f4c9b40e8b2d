"""int4 checkpoints as their publishers store them, read into Int4Linear's layout.

Three formats hold the same weight, w = (q - z) * s per group of G inputs, each packing eight 4-bit
values into an int32 its own way (N outputs, K inputs, little-endian words):
- compressed-tensors pack-quantized (llm-compressor's W4A16): `weight_packed` [N, K/8] packed along K,
  each value stored as q + 8 for a signed q; `weight_scale` [N, K/G]; `weight_zero_point` [N/8, K/G]
  packed along N, z + 8 for a signed z, when asymmetric (z = 0 otherwise); `weight_shape` [N, K]. Its packed bytes are
  Int4Linear's qweight as they are: both put input 2j in the low nibble of byte j.
- GPTQ (AutoGPTQ, GPTQModel): `qweight` [K/8, N] packed along K, `qzeros` [K/G, N/8] packed along N
  (z - 1 in the "gptq" checkpoint_format, z in "gptq_v2"), `scales` [K/G, N], `g_idx` [K].
- AWQ (AutoAWQ, gemm): `qweight` [K, N/8] and `qzeros` [K/G, N/8] packed along N, nibbles 0..7 of a word
  holding outputs 0, 2, 4, 6, 1, 3, 5, 7 of its eight, `scales` [K/G, N].
Each input's group is its index // G, except in act-order checkpoints (GPTQ's desc_act, compressed-tensors'
actorder "group"), where `g_idx` / `weight_g_idx` numbers it: each group still has G inputs, and
Int4Linear stores the columns sorted by group (sort_columns) and gathers its input in that order.
A checkpoint with a scale and zero point per channel (GPTQ's group_size -1, compressed-tensors' channel
strategy) stores one group a row, which every group of the layer repeats (`channel_scales`).
The conversion runs on the device the tensors were read to, at every load (no copy is stored), with
plain tensor ops: a warm load imports neither compressed-tensors nor transformers. A tensor-parallel
rank reads its slice of each tensor (quantized_shards.py) and fills it the same way.
"""

from __future__ import annotations

import torch

from graphkiln.errors import UnsupportedModelError, WeightMismatchError

from .quantized_linear import pack_int4, unpack_int4

AWQ_UNDO_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ packs outputs 0, 2, 4, 6, 1, 3, 5, 7 of each eight
SYMMETRIC_ZERO = 8


def checkpoint_kinds(source: str, symmetric: bool, act_order: bool) -> tuple[str, ...]:
    """The tensors every int4 projection of a checkpoint in format `source` must hold (a bias besides, where
    the model has one). Group indices are needed in act-order, and checked wherever they are present."""
    if source == "compressed-tensors":
        kinds = ("weight_packed", "weight_scale", "weight_shape") + (() if symmetric else ("weight_zero_point",))
        return kinds + ("weight_g_idx",) * act_order
    return ("qweight", "qzeros", "scales") + ("g_idx",) * act_order


def checked(tensor: torch.Tensor, shape: tuple[int, ...], where: str,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor`, once its shape is `shape` and its dtype `dtype` (None: any floating-point dtype, as scales are
    stored); a named WeightMismatchError otherwise."""
    if tuple(tensor.shape) != shape:
        raise WeightMismatchError(f"{where}: shape {tuple(tensor.shape)} but config.json and quantization_config "
                                  f"imply {shape}")
    if dtype is not None and tensor.dtype != dtype:
        raise WeightMismatchError(f"{where}: dtype {tensor.dtype}, the format stores {dtype}")
    if dtype is None and not tensor.is_floating_point():
        raise WeightMismatchError(f"{where}: dtype {tensor.dtype}, the format stores floating-point scales")
    return tensor


def check_weight_shape(tensor: torch.Tensor, full: list[int], where: str) -> None:
    """compressed-tensors' `weight_shape` of a packed projection, against the checkpoint's [N, K] of it."""
    if tensor.numel() != 2 or tensor.tolist() != full:
        raise WeightMismatchError(f"{where}: weight_shape {tensor.tolist()} but config.json implies {full}")


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 8W]: the 4-bit values of each word, lowest bits first."""
    return unpack_int4(words.contiguous().view(torch.uint8))


def undo_awq_order(values: torch.Tensor) -> torch.Tensor:
    """[..., 8M] values in AutoAWQ's packing order -> in output order."""
    order = torch.tensor(AWQ_UNDO_ORDER, device=values.device)
    return values.unflatten(-1, (-1, 8)).index_select(-1, order).flatten(-2)


class Int4Part:
    """The rows of one fused part (q, k or v; gate or up) of an Int4Linear, to fill from a checkpoint."""

    def __init__(self, module, index: int | None, where: str) -> None:
        part = 0 if index is None else index
        self.module, self.index = module, index
        self.n, self.k, self.group = module.parts[part], module.in_features, module.group_size
        self.groups = self.k // self.group
        self.stored_groups = 1 if module.channel_scales else self.groups  # copies repeat one over the groups
        # the projection's part in the checkpoint, of which a tensor-parallel rank reads a slice
        self.full_n, self.full_k = module.checkpoint_parts[part], module.checkpoint_in_features
        self.qweight = module.qweight.split(module.parts)[part]
        self.scales = module.scales.split(module.parts)[part]
        self.zeros = module.zeros.split(module.parts)[part]
        self.where = where

    def check(self, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return checked(tensor, shape, self.where, dtype)

    def set_group_index(self, g_idx: torch.Tensor) -> None:
        """Without act-order the group indices must be runs of `group` inputs (the checkpoint's, read whole by
        every tensor-parallel rank); in act-order (never split over ranks) each group must hold `group` inputs, and
        the fused parts, which read one input, one order of it (their input_order)."""
        if self.check(g_idx, (self.full_k,), g_idx.dtype).is_floating_point():
            raise WeightMismatchError(f"{self.where}: dtype {g_idx.dtype}, group indices are integers")
        g_idx, module = g_idx.long(), self.module
        if module.input_order is None:
            run = self.full_k if module.channel_scales else self.group
            if not torch.equal(g_idx, torch.arange(self.full_k, device=g_idx.device) // run):
                raise WeightMismatchError(
                    f"{self.where}: group indices that are not runs of {run} inputs (act-order), but "
                    "quantization_config declares none (GPTQ desc_act, compressed-tensors actorder 'group')"
                )
            return
        sizes = torch.bincount(g_idx.clamp(-1, self.groups) + 1, minlength=self.groups + 2)[1:-1]
        if not torch.equal(sizes, torch.full_like(sizes, self.group)):
            raise WeightMismatchError(f"{self.where}: group indices that do not give each of the {self.groups} "
                                      f"groups {self.group} inputs")
        order = torch.sort(g_idx, stable=True).indices
        if module.order_parts and not torch.equal(order, module.input_order):
            raise UnsupportedModelError(
                f"{self.where}: an input order (act-order) that differs from that of the projection fused with it; "
                "graphkiln reads q, k and v (gate and up), which share one input, in one order"
            )
        module.input_order.copy_(order)
        module.order_parts.append(self.index)


def fill_int4(module, kind: str, index: int | None, tensor: torch.Tensor, where: str) -> None:
    """Copy one checkpoint tensor of an int4 projection (`kind`, fused part `index`) into `module`, an
    Int4Linear read from a checkpoint in format `module.source`, in its layout."""
    source = module.source
    part = Int4Part(module, index, where)
    n, k, groups = part.n, part.k, part.stored_groups
    if source == "compressed-tensors":
        _fill_compressed_tensors(part, kind, tensor)
    elif kind == "qweight" and source == "awq":
        part.qweight.copy_(pack_int4(undo_awq_order(nibbles(part.check(tensor, (k, n // 8), torch.int32))).t()))
    elif kind == "qweight":  # GPTQ's words run along K: transposed, their bytes are ours
        part.qweight.copy_(part.check(tensor, (k // 8, n), torch.int32).t().contiguous().view(torch.uint8))
    elif kind == "qzeros":
        zeros = nibbles(part.check(tensor, (groups, n // 8), torch.int32))
        if source == "awq":
            zeros = undo_awq_order(zeros)
        elif source == "gptq":  # the v1 format stores z - 1
            zeros = zeros + 1
        part.zeros.copy_(zeros.t())
    elif kind == "scales":
        part.scales.copy_(part.check(tensor, (groups, n)).t())
    elif kind == "g_idx" and source != "awq":
        part.set_group_index(tensor)
    else:
        raise WeightMismatchError(f"{where}: no place for a {kind!r} tensor in a {source} int4 projection")


def sort_columns(module) -> None:
    """An act-order Int4Linear's weight columns in its input_order: its groups become runs of inputs again."""
    module.qweight.copy_(pack_int4(unpack_int4(module.qweight).index_select(1, module.input_order)))


def _fill_compressed_tensors(part: Int4Part, kind: str, tensor: torch.Tensor) -> None:
    n, k, groups = part.n, part.k, part.stored_groups
    if kind == "weight_packed":
        part.qweight.copy_(part.check(tensor, (n, k // 8), torch.int32).view(torch.uint8))
    elif kind == "weight_scale":
        part.scales.copy_(part.check(tensor, (n, groups)))
    elif kind == "weight_zero_point":  # packed along N, each stored as z + 8 for a signed z: our zero point
        part.zeros.copy_(nibbles(part.check(tensor, (-(-n // 8), groups), torch.int32).t())[:, :n].t())
    elif kind == "weight_shape":
        check_weight_shape(tensor, [part.full_n, part.full_k], part.where)
    elif kind == "weight_g_idx":
        part.set_group_index(tensor)
    else:
        raise WeightMismatchError(f"{part.where}: no place for a {kind!r} tensor in a compressed-tensors int4 projection")
