"""The model shapes, their byte and FLOP counts, and the random-weight transformers model built from them."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

from .common import log
from .timing import random_prompts

# Llama-3.2-1B-like and Llama-3.1-8B-like shapes; the smoke shapes exercise tied and untied heads.
MODELS = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "smoke-untied": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, tie_word_embeddings=False),
}


def shape_of(name: str, s) -> dict:
    shape = dict(MODELS[name])
    shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    shape["max_position_embeddings"] = s.max_position
    return shape


def model_bytes(shape: dict, dtype_bytes: int) -> dict:
    h, L, nh, nkv, hd = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    inter, vocab, tied = shape["intermediate_size"], shape["vocab_size"], shape["tie_word_embeddings"]
    layer_matmul = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter
    layer_params = layer_matmul + 2 * h
    embed = vocab * h
    params = L * layer_params + h + embed + (0 if tied else embed)
    # Read every decode step: all layers, the final norm and the LM head (the tied table, or the untied
    # head); an untied input embedding table is only gathered from (a few rows), so it is not counted.
    read_params = L * layer_params + h + embed
    return {
        "params": params,
        "weight_bytes_all": params * dtype_bytes,
        "weight_bytes_read": read_params * dtype_bytes,
        "matmul_params_per_token": L * layer_matmul,  # plus the LM head for sampled rows
        "lm_head_params": embed,
        "kv_bytes_per_token": 2 * L * nkv * hd * dtype_bytes,
        "attn_flops_per_token_per_ctx": 4 * L * nh * hd,  # QK^T and PV, 2 flops per multiply-add
    }


def scratch_root(models: tuple[str, ...], s) -> Path:
    need = sum(model_bytes(shape_of(m, s), s.dtype_bytes)["weight_bytes_all"] for m in models) * 1.5 + (1 << 30)
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free > need:
            return Path(tempfile.mkdtemp(prefix="gk-bench-", dir=shm))
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="gk-bench-"))


def build_hf_model(shape: dict, s, seed: int = 0):
    """A random-weight LlamaForCausalLM built on the device: no default init, then normal_(std=0.02)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **shape, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        attention_bias=False, mlp_bias=False,
    )
    try:
        from transformers.initialization import no_init_weights

        skip_init = no_init_weights()
    except ImportError:  # other transformers versions: the default init runs, on the device
        skip_init = contextlib.nullcontext()
    with torch.device(s.device), skip_init:
        try:
            model = LlamaForCausalLM._from_config(cfg, dtype=s.dtype)
        except TypeError:
            model = LlamaForCausalLM._from_config(cfg, torch_dtype=s.dtype)
    model = model.to(device=s.device, dtype=s.dtype)
    gen = torch.Generator(device=s.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm weights (Llama has no biases)
        if shape["tie_word_embeddings"] and model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight = model.model.embed_tokens.weight
        rot = model.model.rotary_emb
        hd = shape["head_dim"]
        want = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.int64, device=s.device).float() / hd))
        if rot.inv_freq.shape != want.shape or not torch.allclose(rot.inv_freq.float(), want, rtol=1e-4):
            rot.inv_freq.copy_(want)
            if isinstance(getattr(rot, "original_inv_freq", None), torch.Tensor):
                rot.original_inv_freq.copy_(want)
    model.eval()
    model.generation_config.pad_token_id = cfg.eos_token_id
    return model


def hf_reference_logits(model, ids: list[int], s):
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=s.device)).logits[0].float().cpu()


def build(mres: dict, s) -> None:
    """Build the model, save it to mres["model_dir"], and keep in mres what the rows use: the live model
    (for the transformers eager row) and one prompt's reference logits (for graphkiln's check)."""
    shape = mres["shape"]
    t = time.time()
    model = build_hf_model(shape, s)
    mres["build_s"] = time.time() - t
    mres["params_hf"] = sum(p.numel() for p in model.parameters())
    t = time.time()
    model.save_pretrained(mres["model_dir"])
    mres["save_s"] = time.time() - t
    mres["_hf_model"] = model
    mres["_check_ids"] = random_prompts(1, 32, shape["vocab_size"], seed=3)[0]
    mres["_ref_logits"] = hf_reference_logits(model, mres["_check_ids"], s)
    log(f"  built in {mres['build_s']:.1f} s, saved in {mres['save_s']:.1f} s ({mres['params_hf']} params)")
