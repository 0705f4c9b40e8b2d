"""The built-in `tiny` model: a small trained Llama shipped with graphkiln as a Hugging Face directory.

A 4-layer GQA Llama (tied embeddings, bfloat16 weights) and its byte-level BPE tokenizer, both
trained on the docstrings of the Python standard library (PSF License). `tools/train_tiny.py`
reproduces every file; the directory's training.json records the corpus, the run and the held-out
perplexity.
"""

from pathlib import Path

TINY_NAME = "tiny"
_TINY_DIR = Path(__file__).with_name("tiny_model")


def tiny_model_dir() -> Path:
    """The packaged model directory; read it, never write to it."""
    return _TINY_DIR
