"""graphkiln: compile Hugging Face decoder LLMs with torch.compile/Inductor and serve them with CUDA graphs.

Public API: `LLM`, `SamplingParams`, `RequestOutput`, and the typed errors in `graphkiln.errors`.
"""

from graphkiln import errors
from graphkiln.api import compile_model, load
from graphkiln.compiler.config import CompileConfig
from graphkiln.llm import LLM, RequestOutput, StreamDelta
from graphkiln.runtime.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["CompileConfig", "LLM", "RequestOutput", "SamplingParams", "StreamDelta", "compile_model", "errors", "load", "__version__"]
