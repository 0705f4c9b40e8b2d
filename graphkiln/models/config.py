"""ModelConfig: the few fields graphkiln's one decoder implementation needs, read from config.json.

The four supported families differ only in switches (q/k/v bias, per-head q/k RMSNorm, tied
embeddings, RoPE scaling); everything else is the same Llama-style decoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from graphkiln.errors import ModelFileError, UnsupportedModelError

from .rope import rope_frequencies

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and family switches of a decoder-only model."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_context: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_type: str
    rope_inv_freq: tuple[float, ...]  # float32 values, scaled as rope_type asks
    rope_scaling: float  # multiplies cos and sin
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """Rebuild from `dataclasses.asdict` after a JSON round trip (lists back to tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_hf_config(model_dir: Path):
    """Load config.json through transformers' own config classes."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{path}: missing; a Hugging Face model directory needs config.json")
    try:
        raw = json.loads(path.read_text())
        qc = raw.get("quantization_config") if isinstance(raw, dict) else None
        if qc is not None and not isinstance(qc, dict):
            raise UnsupportedModelError(f"{path}: field 'quantization_config' is {qc!r}; it must be an object")
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e}); restore the file") from e
    except (ValueError, KeyError, TypeError, AttributeError, ArithmeticError, StrictDataclassError) as e:  # a field
        raise UnsupportedModelError(f"{path}: transformers cannot read it: {type(e).__name__}: {e}") from e


def _check_sizes(hf, where: Path) -> None:
    """The sizes the model's shapes are made of are positive integers, and the rope base a positive number."""
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = getattr(hf, field, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ModelFileError(f"{where}: field {field!r} is {value!r}; it must be a positive integer")
    theta = dict(getattr(hf, "rope_parameters", None) or {}).get("rope_theta")
    if theta is not None and (not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0):
        raise ModelFileError(f"{where}: rope_theta is {theta!r}; it must be a positive number")


def model_config_from_hf(hf, source: Path) -> ModelConfig:
    """Validate a transformers config and reduce it to a ModelConfig."""
    where = source / "config.json"
    archs = list(getattr(hf, "architectures", None) or [])
    supported = [a for a in archs if a in FAMILIES]
    if not supported:
        raise UnsupportedModelError(
            f"{where}: field 'architectures' is {archs}; graphkiln supports {sorted(FAMILIES)}"
        )
    arch = supported[0]
    family = FAMILIES[arch]
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{where}: field 'hidden_act' is {act!r}; only 'silu' is supported")
    _check_sizes(hf, where)
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{where}: rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    num_heads = hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"{where}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    max_context = hf.max_position_embeddings
    window = getattr(hf, "sliding_window", None)
    if window and getattr(hf, "use_sliding_window", family == "mistral"):
        max_context = min(max_context, window)
    inv_freq, scaling = rope_frequencies(hf, rope_type, head_dim)
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_context=max_context,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=attention_bias or family == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=family == "qwen3",
        rope_type=rope_type,
        rope_inv_freq=inv_freq,
        rope_scaling=scaling,
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=eos_ids,
    )
