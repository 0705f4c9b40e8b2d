"""The tokenizer snapshot an artifact keeps against transformers' own tokenizer, on the tiny model's files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from graphkiln.errors import ModelFileError
from graphkiln.models.tiny import tiny_model_dir
from graphkiln.models.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hi!",
    "The cat sat on the mat.\n\nA new paragraph, with  two spaces.",
    "éàü ß 中文 🙂 ‰",
    "<s> special tokens typed as text </s><pad>",
    "   ",
    "",
]


def model_with(tmp_path: Path, **tokenizer_config) -> Path:
    model_dir = Path(shutil.copytree(tiny_model_dir(), tmp_path / "model"))
    path = model_dir / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **tokenizer_config}))
    return model_dir


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "Qwen2TokenizerFast", "GPT2TokenizerFast"])
def test_snapshot_tokenizes_as_transformers(tmp_path: Path, tokenizer_class: str) -> None:
    model_dir = model_with(tmp_path, tokenizer_class=tokenizer_class, add_bos_token=False)
    hf = Tokenizer.from_dir(model_dir)
    path = tmp_path / "tokenizer.json"
    assert hf.save_snapshot(path)
    snapshot = Tokenizer.from_snapshot(model_dir, path)
    for text in TEXTS:
        ids = hf.encode(text)
        assert snapshot.encode(text) == ids, text
        assert snapshot.decode(ids) == hf.decode(ids), text
    assert snapshot.encode("Hi")[0] == 1  # <s>, as transformers adds it


def test_no_snapshot_when_transformers_cleans_up_spaces(tmp_path: Path) -> None:
    """transformers then rewrites decoded text (" ." to "." and the like): such tokenizers stay with it."""
    hf = Tokenizer.from_dir(model_with(tmp_path, clean_up_tokenization_spaces=True))
    path = tmp_path / "tokenizer.json"
    assert not hf.save_snapshot(path)
    assert not path.exists()


def test_chat_template_from_a_snapshot_loads_transformers(tmp_path: Path) -> None:
    model_dir = model_with(tmp_path)
    hf = Tokenizer.from_dir(model_dir)
    path = tmp_path / "tokenizer.json"
    assert hf.save_snapshot(path)
    conversation = [{"role": "user", "content": "Hello"}]
    assert Tokenizer.from_snapshot(model_dir, path).chat_template_ids(conversation) == hf.chat_template_ids(conversation)


def test_unreadable_tokenizer_files_name_the_directory(tmp_path: Path) -> None:
    model_dir = model_with(tmp_path)
    (model_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=re.escape(f"{model_dir}: its tokenizer files cannot be read")):
        Tokenizer.from_dir(model_dir)


def test_incremental_decoding_adds_up_to_the_whole_decode() -> None:
    """Token by token, in the windows a stream decodes: never half a character before the end, and the
    pieces make the decode of all the ids (multi-byte characters split over tokens, special tokens, noise)."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir())
    noise = torch.randint(0, 4096, (20, 30), generator=torch.Generator().manual_seed(0)).tolist()
    for ids in [tokenizer.encode(text) for text in TEXTS] + noise:
        text = IncrementalDecoder(tokenizer.decode)
        pieces = [text.push([token]) for token in ids]
        assert all(not p.endswith("\ufffd") for p in pieces)
        assert "".join(pieces) + text.flush() == tokenizer.decode(ids)


def test_tokens_that_add_no_text_keep_the_window_short() -> None:
    """A stream whose tokens decode to nothing (special tokens skipped, a model without a tokenizer) decodes
    windows of at most two pushes' tokens, not everything since the last text."""
    windows: list[int] = []

    def decode(ids: list[int]) -> str:
        windows.append(len(ids))
        return ""

    text = IncrementalDecoder(decode)
    assert all(text.push([token]) == "" for token in range(1000)) and text.flush() == ""
    assert max(windows) <= 2
