"""The bench's model shapes, their byte and FLOP counts, the random-weight transformers model built
from them, and the engine helpers the studies share (a model compiled and loaded, sequences
decoding, the decode graph a batch replays).

Weights are random (bf16 on the GPU): speed does not depend on their values, and no checkpoint
has to be fetched. The models are built with transformers' own Llama classes and saved, so
graphkiln and transformers load the same files.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

# Llama-3.2-1B-like, Llama-3.1-8B-like and Llama-3.1-70B-shaped models; the smoke shapes exercise tied and untied heads.
MODELS = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "smoke-untied": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, tie_word_embeddings=False),
}
DESCRIPTIONS = {"1b": "Llama-3.2-1B-like", "8b": "Llama-3.1-8B-like", "70b": "Llama-3.1-70B-shaped"}
WHOLE_BUILD_BYTES = 32 << 30  # above this a model is written a layer at a time instead of built whole


def positions_for(tokens: int) -> int:
    """The positions a bench model gets to hold sequences of `tokens` tokens: the next power of two."""
    return 1 << (tokens - 1).bit_length()


def shape_of(name: str, max_position: int = 8192, layers: int | None = None) -> dict:
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; use one of {sorted(MODELS)}")
    shape = dict(MODELS[name], max_position_embeddings=max_position)
    shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    if layers:
        shape["num_hidden_layers"] = layers
    return shape


def projections(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of every weight product y = x @ W[N, K]^T of one layer, and of the LM head."""
    s = shape_of(name)
    h, hd, inter = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    heads = s["num_attention_heads"] + 2 * s["num_key_value_heads"]
    return {"qkv": (heads * hd, h), "o": (h, s["num_attention_heads"] * hd), "gate_up": (2 * inter, h),
            "down": (h, inter), "lm_head": (s["vocab_size"], h)}


# Bytes per decoder projection weight: fp8 (plus a float32 scale per row, negligible), int4 plus a 16-bit scale and
# zero point per group of 128.
QUANTIZED_BYTES = {"fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / 128}  # a weight's bytes, with its scales
QUANTIZATIONS = tuple(QUANTIZED_BYTES)  # compile-model's --quantization


def model_bytes(shape: dict, dtype_bytes: int, quantization: str | None = None) -> dict:
    """Parameters, weight bytes (all, and read per decode step), KV bytes per token, FLOPs per token.
    With `quantization` the decoder's projections count at their quantized size, the rest at `dtype_bytes`."""
    h, layers, nh, nkv, hd = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim"))
    inter, vocab, tied = shape["intermediate_size"], shape["vocab_size"], shape["tie_word_embeddings"]
    layer_matmul = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter
    layer_params = layer_matmul + 2 * h
    embed = vocab * h
    params = layers * layer_params + h + embed + (0 if tied else embed)
    # Read every decode step: all layers, the final norm and the LM head (the tied table, or the untied
    # head); an untied input embedding table is only gathered from (a few rows), so it is not counted.
    read_params = layers * layer_params + h + embed
    saved = layers * layer_matmul * (dtype_bytes - QUANTIZED_BYTES[quantization]) if quantization else 0
    return {
        "params": params,
        "weight_bytes_all": params * dtype_bytes - saved,
        "weight_bytes_read": read_params * dtype_bytes - saved,
        "matmul_params_per_token": layers * layer_matmul,  # plus the LM head for the rows that sample
        "lm_head_params": embed,
        "kv_bytes_per_token": 2 * layers * nkv * hd * dtype_bytes,
        "attn_flops_per_token_per_ctx": 4 * layers * nh * hd,  # QK^T and PV, 2 FLOPs per multiply-add
    }


def scratch_dir(need_bytes: float) -> Path:
    """A scratch folder in /dev/shm when it has room (saving and loading weights is then memory-speed)."""
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        if shm.is_dir() and shutil.disk_usage(shm).free > need_bytes:
            return Path(tempfile.mkdtemp(prefix="gk-bench-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="gk-bench-"))


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # transformers' <Family>Config and <Family>ForCausalLM


def hf_config(shape: dict, family: str = "llama", **fields):
    """transformers' <Family>Config of the bench's models for `shape` (its architectures named), plus `fields`."""
    import transformers

    name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    extra = dict(attention_bias=False, mlp_bias=False) if family == "llama" else {}
    return getattr(transformers, f"{name}Config")(**shape, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1,
                                                  eos_token_id=2, pad_token_id=None,
                                                  architectures=[f"{name}ForCausalLM"], **extra, **fields)  # fmt: skip


def build_hf_model(shape: dict, device: str, dtype, seed: int = 0, family: str = "llama"):
    """A random-weight <family>ForCausalLM built on the device: no default init, then normal_(std=0.02) for
    matrices and biases (Qwen2's q/k/v), ones for the RMSNorm weights."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    cfg = hf_config(shape, family)
    model_cls = getattr(transformers, cfg.architectures[0])
    with torch.device(device), no_init_weights():
        model = model_cls._from_config(cfg, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.ndim >= 2 or param_name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm weights
        if shape["tie_word_embeddings"] and model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight = model.model.embed_tokens.weight
        # Buffers skipped by no_init_weights: the rotary frequencies, as Llama computes them.
        rot, hd = model.model.rotary_emb, shape["head_dim"]
        want = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=device).float() / hd))
        if not torch.allclose(rot.inv_freq.float(), want, rtol=1e-4):
            rot.inv_freq.copy_(want)
            if isinstance(getattr(rot, "original_inv_freq", None), torch.Tensor):
                rot.original_inv_freq.copy_(want)
    model.eval()
    model.generation_config.pad_token_id = cfg.eos_token_id
    return model


def save_model(name: str, folder: Path, device: str, dtype, layers: int | None = None,
               max_position: int = 8192) -> Path:
    """Build model `name` (with `layers` layers) and save it to `folder`, for the studies."""
    import torch

    shape = shape_of(name, max_position, layers)
    if model_bytes(shape, dtype.itemsize)["weight_bytes_all"] > WHOLE_BUILD_BYTES:
        save_by_layer(shape, folder, device, dtype)
    else:
        build_hf_model(shape, device, dtype).save_pretrained(folder)
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def save_by_layer(shape: dict, folder: Path, device: str, dtype, seed: int = 0) -> None:
    """A random Llama checkpoint of `build_hf_model`'s layout, config and init (other draws of it), written one
    safetensors file per layer (and one for the embeddings, one for the final norm and head), so a model larger
    than one device's memory never exists whole."""
    import json

    import torch
    from safetensors.torch import save_file

    h, hd, inter = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return torch.empty(size, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen).cpu()

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=dtype)

    layer_shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                    "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                    "mlp.down_proj": (h, inter)}  # fmt: skip
    parts = [lambda: {"model.embed_tokens.weight": normal(shape["vocab_size"], h)}]
    for i in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        parts.append(lambda prefix=prefix: {
            **{f"{prefix}{name}.weight": normal(*size) for name, size in layer_shapes.items()},
            f"{prefix}input_layernorm.weight": ones(), f"{prefix}post_attention_layernorm.weight": ones()})
    parts.append(lambda: {"model.norm.weight": ones(), **({} if shape["tie_word_embeddings"] else
                                                           {"lm_head.weight": normal(shape["vocab_size"], h)})})
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for n, make in enumerate(parts, 1):
        file = f"model-{n:05d}-of-{len(parts):05d}.safetensors"
        tensors = make()
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    hf_config(shape, dtype=dtype).save_pretrained(folder)


# Engine helpers for the studies: public API only (LLM.stats, Engine.add_request/step/abort/cuda_graph).


def compiled_llm(study, work: Path, tag: str = "art", disabled_passes: tuple[str, ...] = (),
                 compile_options: dict | None = None, max_position: int = 8192, **engine):
    """The study's model (of `max_position` positions), saved once under `work`, compiled into work/<tag>
    (CompileConfig fields beyond device, dtype and disabled passes in `compile_options`) and loaded with `engine`."""
    import graphkiln

    model = work / "model"
    if not (model / "config.json").is_file():
        save_model(study.model, model, study.device, study.dtype, study.layers, max_position=max_position)
    config = graphkiln.CompileConfig(device=study.device, dtype=study.dtype_name, disabled_passes=disabled_passes,
                                     **(compile_options or {}))
    graphkiln.compile_model(model, work / tag, config, force=True)
    llm = graphkiln.load(work / tag, **engine)
    llm.wait_ready()
    return llm


def tokens_to_outlive(batch: int, prompt: int, steps: int, chunk: int) -> int:
    """New tokens each of `batch` requests of `prompt` tokens needs to keep decoding through `steps` steps after
    the last prompt is prefilled, `chunk` tokens a step: the first requests decode while the later prompts are
    prefilled, and their decode tokens come first in each step's budget."""
    return -(-batch * prompt // chunk) + batch + steps


def decoding(llm, batch: int, steps: int, prompt_tokens: int = 128) -> list:
    """`batch` requests of `prompt_tokens` tokens, prefilled: the engine's next `steps` steps decode all of them."""
    import graphkiln

    engine = llm.engine
    max_tokens = tokens_to_outlive(batch, prompt_tokens, steps + 8, engine.config.max_num_batched_tokens)
    params = graphkiln.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request([7 + i] * prompt_tokens, params) for i in range(batch)]
    while not all(seq.output_ids for seq in seqs):
        engine.step()
    return seqs


def stop(llm, seqs: list) -> None:
    """Abort what `decoding` started, reading back the step in flight first."""
    llm.engine.drain()
    for seq in seqs:
        llm.engine.abort(seq)


def decode_graph(llm, batch: int):
    """The greedy decode CUDA graph that a step of `batch` sequences replays (its bucket's)."""
    sizes = llm.stats().graphs["decode"].sizes
    return llm.engine.cuda_graph("decode", (min(s for s in sizes if s >= batch), "greedy"))


def decode_timer(llm, batch: int, cuda: bool):
    """What a decode step's device time is measured on: its graph's replay on the GPU; on the CPU,
    where engines capture no graphs, a whole engine step (keep `decoding` sequences running)."""
    return decode_graph(llm, batch).replay if cuda else llm.engine.step
