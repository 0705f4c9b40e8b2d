"""Pre-quantized int4 checkpoints in the layouts their publishers use, written from a float32 transformers
model, and the float32 model of the dequantized weights they are checked against.

compressed-tensors' pack-quantized tensors are packed by the compressed-tensors library itself. GPTQ and
AWQ are packed here with shifts, as AutoGPTQ and AutoAWQ write them (`awq_words` is checked against
compressed-tensors' AWQ reader in the tests).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import PreTrainedModel

from quant_helpers import model_tensors, projections, save_checkpoint, start_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output AWQ_ORDER[i] of each eight goes to nibble i
FORMATS = ("compressed-tensors", "gptq", "gptq_v2", "awq")
INPUTS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}


def int4_config(fmt: str, group: int, symmetric: bool, act_order: bool = False) -> dict:
    """quantization_config as llm-compressor (compressed-tensors), AutoGPTQ / GPTQModel or AutoAWQ writes it; `group`
    -1: a scale per channel (GPTQ's group_size -1, compressed-tensors' channel strategy)."""
    if fmt == "compressed-tensors":
        strategy = "channel" if group == -1 else "group"
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "group_size": None if group == -1 else group,
                   "strategy": strategy, "block_structure": None, "dynamic": False,
                   "actorder": "group" if act_order else None, "observer": "minmax", "observer_kwargs": {}}
        return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}},
                "format": "pack-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
                "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True,
                "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
            "checkpoint_format": fmt, "static_groups": False, "true_sequential": True, "damp_percent": 0.01}


def quantize(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] in 0..15, scales [N, K/G], zero points [N, K/G] in 0..15), w ~ (q - z) * s."""
    g = w.unflatten(-1, (-1, group))
    if symmetric:
        scale = g.abs().amax(-1) / 7
        zero = torch.full_like(scale, 8)
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (high - low) / 15
        zero = (-low / scale).round().clamp(0, 15)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).flatten(-2)
    return q.to(torch.int64), scale, zero.to(torch.int64)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> the int32 of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def words_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R / 8, C]: value 8i + j of each column in bits 4j of word i (GPTQ's qweight)."""
    parts = values.unflatten(0, (-1, 8))
    return _int32(sum(parts[:, j] << (4 * j) for j in range(8)))


def words_along_columns(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C / 8]: column 8i + order[j] in bits 4j of word i."""
    parts = values.unflatten(1, (-1, 8))
    return _int32(sum(parts[:, :, order[j]] << (4 * j) for j in range(8)))


def awq_words(values: torch.Tensor) -> torch.Tensor:
    return words_along_columns(values, AWQ_ORDER)


def act_order_groups(k: int, group: int, seed: int) -> torch.Tensor:
    """Each input's group as an act-order GPTQ numbers them: the inputs in a shuffled order, cut into runs."""
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    return g_idx


def _tensors(fmt: str, q, scale, zero, g_idx, symmetric: bool, act_order: bool) -> dict[str, torch.Tensor]:
    """One projection's tensors in `fmt`, by kind: q [N, K], scale and zero [N, G], g_idx [K]."""
    n, k = q.shape
    if fmt == "compressed-tensors":
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        out = {"weight_packed": pack_to_int32((q - 8).to(torch.int8), 4), "weight_scale": scale.to(torch.bfloat16),
               "weight_shape": torch.tensor([n, k])}
        if not symmetric:
            out["weight_zero_point"] = pack_to_int32((zero - 8).to(torch.int8), 4, packed_dim=0)
        if act_order:
            out["weight_g_idx"] = g_idx.to(torch.int32)
        return out
    scales = scale.t().to(torch.float16).contiguous()
    if fmt == "awq":
        return {"qweight": awq_words(q.t()), "qzeros": awq_words(zero.t()), "scales": scales}
    stored_zero = zero - 1 if fmt == "gptq" else zero
    return {"qweight": words_along_rows(q.t()), "qzeros": words_along_columns(stored_zero.t()), "scales": scales,
            "g_idx": g_idx.to(torch.int32)}


def _dequantized(fmt: str, q, scale, zero, g_idx) -> torch.Tensor:
    stored = scale.to(torch.bfloat16 if fmt == "compressed-tensors" else torch.float16).float()
    return ((q - zero[:, g_idx]) * stored[:, g_idx]).float()


def _quantized(w: torch.Tensor, group: int, symmetric: bool, g_idx: torch.Tensor):
    """`quantize` over the groups `g_idx` names: (q [N, K] in w's column order, scales, zero points)."""
    order = torch.sort(g_idx, stable=True).indices
    q_sorted, scale, zero = quantize(w[:, order], group, symmetric)
    q = torch.empty_like(q_sorted)
    q[:, order] = q_sorted
    return q, scale, zero


def write_int4_checkpoint(source: Path, model: PreTrainedModel, out: Path, fmt: str, group: int,
                          symmetric: bool, act_order: bool = False) -> PreTrainedModel:
    """Write `model` to `out` as an int4 checkpoint in format `fmt` (FORMATS) beside the tokenizer-less files of
    `source`; return the float32 model of the dequantized weights (scales as stored). `act_order`: each input of a
    layer's projections that read one input (q, k, v; gate, up) gets a shuffled group, as GPTQ's desc_act gives.
    `group` -1: one group a row (a scale per channel)."""
    start_checkpoint(source, out, int4_config(fmt, group, symmetric, act_order))
    reference, tensors = copy.deepcopy(model), model_tensors(model)
    with torch.no_grad():
        for name, module in projections(reference):
            k = module.weight.shape[1]
            layer, projection = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
            seed = 10 * layer + INPUTS[projection]
            size = k if group == -1 else group
            g_idx = act_order_groups(k, size, seed) if act_order else torch.arange(k) // size
            q, scale, zero = _quantized(module.weight.float(), size, symmetric, g_idx)
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{kind}": t.contiguous() for kind, t in _tensors(fmt, q, scale, zero, g_idx,
                                                                                       symmetric, act_order).items()})
            module.weight.copy_(_dequantized(fmt, q, scale, zero, g_idx))
    save_checkpoint(model, tensors, out)
    return reference
