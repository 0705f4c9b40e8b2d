"""Quantized weight products: the custom ops, their reference bodies, the quantizers and the modules.

`graphkiln::fp8_linear(x, weight, weight_scale, input_scale)`: weight [N, K] float8_e4m3fn with
scales per output channel ([N]) or per 128 x 128 block ([ceil(N/128), ceil(K/128)], the factor
to multiply by); activations quantized per token (channel scales) or per 1 x 128 group (block
scales) at run time, or with one static scale when `input_scale` [1] is given.
`graphkiln::fp8_linear_silu_mul(x, weight, weight_scale, input_scale)`: silu(gate) * up of fp8_linear's
[gate | up], the MLP's fused gate and up projections with their activation (passes/silu_mul_epilogue.py).
`graphkiln::fp8_mlp(x, gate_up_weight, gate_up_scale, gate_up_input_scale, down_weight, down_scale)`: the down
projection (dynamic activation scales) of fp8_linear_silu_mul's output, the MLP's two products (passes/fp8_mlp.py).
`graphkiln::int4_linear(x, qweight, scales, zeros, group_size, tinygemm_weight, tinygemm_params)`: w[n, k] =
(q[n, k] - zeros[n, g]) * scales[n, g] with g = k // group_size, q in 0..15 packed two to a byte, the low
nibble first; the optional tinygemm tensors hold the same weight in the layout of torch's own int4 kernel
(`tinygemm_layout`), which the CUDA path takes at a few rows.

The int8 ops and layer (W8A8, W8A16) are int8_linear.py's.

On CUDA the ops call the Triton kernels of `graphkiln.kernels`; elsewhere they dequantize to
float32 and multiply, quantizing the activations as the CUDA path does above FEW_ROWS rows
(kernels/fp8_linear.py) at every row count. Up to FEW_ROWS rows the CUDA kernel quantizes them per
1 x 128 group instead, a finer grouping of the same one fp8 rounding. The ops are opaque to Inductor
and to linear_op; silu_mul_epilogue turns an fp8_linear and its activation into fp8_linear_silu_mul, fp8_mlp
that and the down projection after it into fp8_mlp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .linear import silu_mul_reference
from .ops import define

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = 128  # side of a weight scale block, and the activation group of block-scaled weights
INT4_GROUP = 128
INT4_MIN_GROUP = 16
INT4_MAX = 15
TINYGEMM_GROUPS = (32, 64, 128, 256)  # the group sizes torch's tinygemm kernel is built for
MIN_SCALE = 1e-12  # the scale of an all-zero row or group: any positive value quantizes it to zero


def _expand_blocks(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[ceil(N/128), ceil(K/128)] block scales -> [N, K], one value per weight."""
    return scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight an fp8 weight and its channel or block scales stand for."""
    n, k = weight.shape
    scale = weight_scale.float()
    scale = scale[:, None] if scale.dim() == 1 else _expand_blocks(scale, n, k)
    return weight.float() * scale


def _round_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def quantize_activations_fp8(x: torch.Tensor, block_scaled: bool, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x in float32 after the round trip through fp8 the kernels make: with `input_scale`, one static scale;
    else a scale per token, or per 1 x 128 group of a token when the weight has block scales."""
    x = x.float()
    if input_scale is not None:
        return _round_fp8(x, input_scale.float().reshape(()))
    if not block_scaled:
        scale = x.abs().amax(-1, keepdim=True).clamp(min=MIN_SCALE) / FP8_MAX
        return _round_fp8(x, scale)
    k = x.shape[-1]
    groups = F.pad(x, (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK))
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=MIN_SCALE) / FP8_MAX
    return _round_fp8(groups, scale).flatten(-2)[..., :k]


def _fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ dequantized weight [N, K]^T -> [M, N] in x.dtype."""
    if x.is_cuda:  # triton is optional: the kernel is imported only where it runs
        from graphkiln.kernels.fp8_linear import fp8_linear as kernel

        return kernel(x, weight, weight_scale, input_scale)
    xq = quantize_activations_fp8(x, weight_scale.dim() == 2, input_scale)
    return torch.mm(xq, dequantize_fp8(weight, weight_scale).t()).to(x.dtype)


def _fp8_linear_shape(x, weight, weight_scale, input_scale) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


fp8_linear = define("fp8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale) -> Tensor",
                    _fp8_linear, _fp8_linear_shape)


def _fp8_linear_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None
) -> torch.Tensor:
    """fp8_linear(x, ...) = [gate | up] [M, 2I] -> silu(gate) * up [M, I] in x.dtype."""
    if x.is_cuda:  # at one row the GEMV's epilogue applies the activation
        from graphkiln.kernels.fp8_linear import fp8_linear as kernel

        return kernel(x, weight, weight_scale, input_scale, activated=True)
    return silu_mul_reference(_fp8_linear(x, weight, weight_scale, input_scale))


def _fp8_activated_shape(x, weight, weight_scale, input_scale) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


fp8_linear_silu_mul = define(
    "fp8_linear_silu_mul(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale) -> Tensor",
    _fp8_linear_silu_mul, _fp8_activated_shape,
)


def _fp8_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_scale: torch.Tensor,
             gate_up_input_scale: torch.Tensor | None, down_weight: torch.Tensor, down_scale: torch.Tensor
             ) -> torch.Tensor:
    """fp8_linear(fp8_linear_silu_mul(x, gate_up...), down...) [M, K] -> [M, down rows] in x.dtype."""
    if x.is_cuda:  # the down product's activation quantization applies the SiLU-and-mul as it loads
        from graphkiln.kernels.fp8_linear import fp8_mlp as kernel

        return kernel(x, gate_up_weight, gate_up_scale, gate_up_input_scale, down_weight, down_scale)
    h = _fp8_linear_silu_mul(x, gate_up_weight, gate_up_scale, gate_up_input_scale)
    return _fp8_linear(h, down_weight, down_scale, None)


def _fp8_mlp_shape(x, gate_up_weight, gate_up_scale, gate_up_input_scale, down_weight, down_scale) -> torch.Tensor:
    return x.new_empty(x.shape[0], down_weight.shape[0])


fp8_mlp = define(
    "fp8_mlp(Tensor x, Tensor gate_up_weight, Tensor gate_up_scale, Tensor? gate_up_input_scale, "
    "Tensor down_weight, Tensor down_scale) -> Tensor",
    _fp8_mlp, _fp8_mlp_shape,
)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K // 2] uint8, k = 2j in the low nibble of byte j and k = 2j + 1 in the high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: [N, K // 2] uint8 -> [N, K] uint8 values 0..15."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight [N, K] of packed int4 values with one scale and zero point per group."""
    q = unpack_int4(qweight).float()
    scale = scales.float().repeat_interleave(group_size, 1)
    zero = zeros.float().repeat_interleave(group_size, 1)
    return (q - zero) * scale


def _int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    tinygemm_weight: torch.Tensor | None = None, tinygemm_params: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantized weight [N, K]^T -> [M, N] in x.dtype; the activations stay as they are."""
    if x.is_cuda:  # triton is optional: the kernel is imported only where it runs
        from graphkiln.kernels.int4_linear import int4_linear as kernel

        return kernel(x, qweight, scales, zeros, group_size, tinygemm_weight, tinygemm_params)
    return torch.mm(x.float(), dequantize_int4(qweight, scales, zeros, group_size).t()).to(x.dtype)


def _int4_linear_shape(x, qweight, scales, zeros, group_size, tinygemm_weight=None, tinygemm_params=None):
    return x.new_empty(x.shape[0], qweight.shape[0])


int4_linear = define("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, "
                     "Tensor? tinygemm_weight=None, Tensor? tinygemm_params=None) -> Tensor",
                     _int4_linear, _int4_linear_shape)


def tinygemm_inner_k_tiles(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> int | None:
    """The k-tiles per packed word of the weight in tinygemm's layout (torch's own int4 kernel,
    `aten._weight_int4pack_mm`: CUDA from sm80, bfloat16), or None where that kernel does not apply
    (another device, dtype or group size, N not a multiple of 8, K not of 32)."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if (qweight.device.type != "cuda" or scales.dtype != torch.bfloat16 or group_size not in TINYGEMM_GROUPS
            or n % 8 or k % 32 or torch.cuda.get_device_capability(qweight.device) < (8, 0)):
        return None
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


def tinygemm_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    inner_k_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight in tinygemm's layout: its packed tiles [N / 8, K / (16 * inner_k_tiles), 32, inner_k_tiles / 2]
    int32, and [K / G, N, 2] bfloat16 scales with zero points in the float domain, w = (q - 8) * s + (8 - z) * s.
    The tiles are the GPU kernel's own layout, so they are made at load, never stored."""
    high_first = (qweight << 4) | (qweight >> 4)  # tinygemm reads the even k from the high nibble
    tiles = torch.ops.aten._convert_weight_to_int4pack(high_first.contiguous(), inner_k_tiles)
    return tiles, tinygemm_params(scales, zeros)


def tinygemm_params(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[N, K / G] scales and integer zero points -> tinygemm's [K / G, N, 2] bfloat16 scales and zero points in
    the float domain: (q - z) * s = (q - 8) * s + (8 - z) * s."""
    s = scales.float()
    return torch.stack((s, (8 - zeros.float()) * s), dim=-1).to(torch.bfloat16).transpose(0, 1).contiguous()


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], float32 scales [N]): each row's largest magnitude maps to 448."""
    w = weight.float()
    scale = w.abs().amax(-1).clamp(min=MIN_SCALE) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def int4_group_size(in_features: int) -> int | None:
    """128, or the largest power of two below it that divides K (at least 16); None when none does."""
    group = math.gcd(in_features, INT4_GROUP)
    return group if group >= INT4_MIN_GROUP else None


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (packed uint8 [N, K // 2], scales, zeros [N, K // group_size] in weight.dtype).

    Asymmetric: each group's range [min, max] (widened to hold 0) spans the 16 levels, with an
    integer zero point, so zero is exact and no weight moves by more than half a scale."""
    w = weight.float().unflatten(-1, (-1, group_size))
    low = w.amin(-1, keepdim=True).clamp(max=0)
    high = w.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / INT4_MAX).clamp(min=MIN_SCALE).to(weight.dtype).float()  # as stored
    zero = (-low / scale).round().clamp(0, INT4_MAX)
    q = (w / scale + zero).round().clamp(0, INT4_MAX).flatten(-2)
    return pack_int4(q), scale.squeeze(-1).to(weight.dtype), zero.squeeze(-1).to(weight.dtype)


def _frozen(shape, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored quantized. `parts` are the output sizes of the checkpoint
    projections fused into it (q, k, v or gate, up), in order; `bias` holds the bias in `dtype`."""

    def __init__(self, in_features: int, parts: tuple[int, ...], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(parts)
        self.parts = parts
        # the checkpoint's sizes of the projection, of which a tensor-parallel rank holds a slice (install_quantized)
        self.checkpoint_in_features = in_features
        self.checkpoint_parts = parts
        self.bias = _frozen(self.out_features, dtype) if bias else None

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def describe(self) -> str:
        """The storage format, as `graphkiln inspect` shows it."""
        raise NotImplementedError


class Fp8Linear(QuantizedLinear):
    """float8_e4m3fn weight with a float32 scale per output channel (`weight_scale` [N]); `static_input` adds a
    static activation scale (`input_scale` [1]), else activations are quantized per token as they come."""

    scale_name = "weight_scale"
    weight_dtype = FP8

    def __init__(
        self, in_features: int, parts: tuple[int, ...], bias: bool, dtype: torch.dtype, static_input: bool = False
    ) -> None:
        super().__init__(in_features, parts, bias, dtype)
        self.weight = _frozen((self.out_features, in_features), self.weight_dtype)
        setattr(self, self.scale_name, _frozen(self.scale_shape(), torch.float32))
        self.input_scale = _frozen(1, torch.float32) if static_input else None

    def scale_shape(self) -> tuple[int, ...]:
        return (self.out_features,)

    def describe(self) -> str:
        activations = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
        return f"fp8 e4m3, per-channel weight scales, {activations} activations"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scales = getattr(self, self.scale_name)
        return self._add_bias(torch.ops.graphkiln.fp8_linear(x, self.weight, scales, self.input_scale))


class BlockFp8Linear(Fp8Linear):
    """float8_e4m3fn weight with a float32 factor per 128 x 128 block, under the name the checkpoint gives it
    (`scale_name`: Qwen's and transformers' `weight_scale_inv`, compressed-tensors' `weight_scale`); activations
    quantized per 1 x 128 group as they come."""

    def __init__(self, in_features: int, parts: tuple[int, ...], bias: bool, dtype: torch.dtype,
                 scale_name: str = "weight_scale_inv") -> None:
        self.scale_name = scale_name
        super().__init__(in_features, parts, bias, dtype)

    def scale_shape(self) -> tuple[int, ...]:
        return (-(-self.out_features // BLOCK), -(-self.in_features // BLOCK))

    def describe(self) -> str:
        return f"fp8 e4m3, {BLOCK}x{BLOCK} block weight scales, dynamic per-1x{BLOCK}-group activations"


class Int4Linear(QuantizedLinear):
    """Weight-only int4: packed values, and a scale and zero point per group of `group_size` inputs. `source`
    names the checkpoint format it is read from (int4_checkpoints.py), None when compile-model quantized it;
    `symmetric`: zero points of 8 throughout. `act_order`: the checkpoint numbers each input's group; the
    weight's columns are then stored sorted by group, and `input_order` (a buffer, made at load from the
    checkpoint's group indices) gathers the input's in the same order before the product. `channel_scales`: the
    checkpoint has one scale and zero point per output channel, which every group of the row repeats."""

    def __init__(
        self, in_features: int, parts: tuple[int, ...], bias: bool, dtype: torch.dtype, group_size: int = INT4_GROUP,
        source: str | None = None, symmetric: bool = False, act_order: bool = False, channel_scales: bool = False,
    ) -> None:
        super().__init__(in_features, parts, bias, dtype)
        self.group_size = group_size
        self.source = source
        self.symmetric = symmetric
        self.channel_scales = channel_scales
        order = torch.empty(in_features, dtype=torch.int64) if act_order else None
        self.register_buffer("input_order", order, persistent=False)
        self.order_parts: list[int] = []  # the fused parts whose group indices have set input_order
        groups = in_features // group_size
        self.qweight = _frozen((self.out_features, in_features // 2), torch.uint8)
        self.scales = _frozen((self.out_features, groups), dtype)
        self.zeros = _frozen((self.out_features, groups), dtype)
        self.register_buffer("tinygemm_weight", None, persistent=False)
        self.register_buffer("tinygemm_params", None, persistent=False)

    def allocate_tinygemm(self) -> None:
        """Allocate the weight's copy in tinygemm's layout (buffers, not saved) where the kernel applies: before
        tracing or binding compiled pieces, which take the buffers; `fill_tinygemm` fills it."""
        tiles = tinygemm_inner_k_tiles(self.qweight, self.scales, self.group_size)
        if tiles is None:
            return
        n, k, device = self.out_features, self.in_features, self.qweight.device
        self.tinygemm_weight = torch.empty(-(-n // 8), k // (16 * tiles), 32, tiles // 2, dtype=torch.int32,
                                           device=device)
        self.tinygemm_params = torch.empty(k // self.group_size, n, 2, dtype=torch.bfloat16, device=device)

    @torch.no_grad()
    def fill_tinygemm(self) -> None:
        """Fill the copy in tinygemm's layout from the filled weight, where one is allocated."""
        if self.tinygemm_weight is not None:
            tiles, params = tinygemm_layout(self.qweight, self.scales, self.zeros, self.group_size,
                                            2 * self.tinygemm_weight.shape[-1])
            self.tinygemm_weight.copy_(tiles)
            self.tinygemm_params.copy_(params)

    def describe(self) -> str:
        order = " in act-order" if self.input_order is not None else ""
        scales = f"per-channel scales (as groups of {self.group_size})" if self.channel_scales else (
            f"groups of {self.group_size}")
        return f"int4, {'symmetric' if self.symmetric else 'asymmetric'}, {scales}{order}, weight-only"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        return self._add_bias(torch.ops.graphkiln.int4_linear(x, self.qweight, self.scales, self.zeros,
                                                              self.group_size, self.tinygemm_weight,
                                                              self.tinygemm_params))
