"""models: Llama-family decoders from Hugging Face directories, the attention op, the built-in tiny model."""

from .config import ModelConfig
from .loader import load_model, resolve_dtype
from .transformer import CausalLM

__all__ = ["CausalLM", "ModelConfig", "load_model", "resolve_dtype"]
