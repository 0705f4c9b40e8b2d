"""Tokenizers: transformers' for a model directory, or the snapshot of its pipeline an artifact keeps.

compile-model saves the `tokenizers` pipeline that transformers builds for the directory (its
backend tokenizer, as transformers configured it) when that pipeline alone encodes and decodes a
set of probe texts exactly as transformers does. A warm load then tokenizes with the `tokenizers`
package and never imports transformers, which takes seconds; chat templates still load
transformers on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from graphkiln.errors import ModelFileError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
)  # fmt: skip
PROBES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand\n\nnewlines   trailing  ",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский",
    "def f(x):\n    return x ** 2  # code 12345 67.89e-3",
    "don't won't it's I'm we're they've . , ? ! ' \"",
)


def tokenizer_files(model_dir: Path) -> list[Path]:
    return [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]


class Tokenizer:
    """Encode and decode text for one model directory: through a `tokenizers` snapshot when an artifact
    has one, else through transformers' AutoTokenizer (loaded on first use when a snapshot exists)."""

    def __init__(self, model_dir: Path, snapshot=None, hf=None) -> None:
        self.model_dir = model_dir
        self._snapshot = snapshot
        self._hf = hf

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer | None:
        """transformers' tokenizer for the directory, or None when it ships none (token-id prompts only)."""
        if not any(p.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for p in tokenizer_files(model_dir)):
            return None
        return cls(model_dir, hf=_auto_tokenizer(model_dir))

    @classmethod
    def from_snapshot(cls, model_dir: Path, path: Path) -> Tokenizer:
        from tokenizers import Tokenizer as Pipeline

        return cls(model_dir, snapshot=Pipeline.from_file(str(path)))

    @property
    def hf(self):
        if self._hf is None:
            self._hf = _auto_tokenizer(self.model_dir)
        return self._hf

    def encode(self, text: str) -> list[int]:
        if self._snapshot is not None:
            return self._snapshot.encode(text).ids
        return list(self.hf(text)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._snapshot is not None:
            return self._snapshot.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_template_ids(self, conversation: list[dict]) -> list[int] | None:
        """The prompt ids of a conversation through the chat template, or None when there is none."""
        if not getattr(self.hf, "chat_template", None):
            return None
        return list(self.hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False))

    def save_snapshot(self, path: Path) -> bool:
        """Write transformers' backend pipeline to `path` if it alone reproduces transformers on every
        probe (encode, and decode without special tokens); return whether it was written."""
        from tokenizers import Tokenizer as Pipeline

        hf = self.hf
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
            return False
        pipeline = Pipeline.from_str(backend.to_str())
        probes = (*PROBES, " ".join(PROBES) + " " + " ".join(getattr(hf, "all_special_tokens", [])))
        for text in probes:
            ids = list(hf(text)["input_ids"])
            if pipeline.encode(text).ids != ids:
                return False
            if pipeline.decode(ids, skip_special_tokens=True) != hf.decode(ids, skip_special_tokens=True):
                return False
        path.write_text(backend.to_str())
        return True


class IncrementalDecoder:
    """The text of a growing list of token ids, one piece per `push`, never ending on half a character.

    Each push decodes a window (the tokens of the previous piece, then the new ones) and returns what the
    new ones add, so a stream of n tokens costs O(n) decoding, not O(n^2); the pieces add up to the decode
    of all the ids. Text ending in U+FFFD (a character whose bytes are still coming) is held back until it
    completes, or until `flush` at the end of the stream. Tokens that add no text (special tokens skipped, a
    model without a tokenizer) move the window on like tokens that do, so they too cost O(1) each.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._start = 0  # the window's first token
        self._shown = 0  # tokens whose text was returned

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """What was held back, as the last tokens decode (a broken character included)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        shown = self._decode(self.ids[self._start : self._shown])
        text = self._decode(self.ids[self._start :])
        held = len(text) < len(shown) or (text.endswith("\ufffd") and not final)
        if held and text != shown:  # unchanged text moves the window on: the new tokens are the next one's context
            return ""
        self._start, self._shown = self._shown, len(self.ids)
        return text[len(shown) :]


def _auto_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{model_dir}: its tokenizer files cannot be read ({e}); restore them") from e
