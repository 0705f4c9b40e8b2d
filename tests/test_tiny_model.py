"""The built-in tiny model: the packaged directory is a trained, tied, bfloat16 Llama that writes words,
and tools/train_tiny.py reproduces such a directory end to end."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from safetensors import safe_open

import graphkiln
from artifact_helpers import ENGINE, run
from graphkiln import SamplingParams
from graphkiln.models.tiny import tiny_model_dir

TRAIN_TINY = Path(__file__).resolve().parents[1] / "tools" / "train_tiny.py"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
               "tokenizer.json", "tokenizer_config.json", "training.json"}


def test_packaged_files_are_a_tied_bfloat16_llama() -> None:
    model_dir = tiny_model_dir()
    assert {p.name for p in model_dir.iterdir()} == MODEL_FILES
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert {str(f.get_slice(name).get_dtype()) for name in f.keys()} == {"BF16"}
    assert (model_dir / "model.safetensors").stat().st_size <= 8_000_000


def test_packaged_model_is_trained() -> None:
    """A model that learnt nothing scores about the vocabulary size; training.json records the held-out score."""
    facts = json.loads((tiny_model_dir() / "training.json").read_text())
    vocab_size = json.loads((tiny_model_dir() / "config.json").read_text())["vocab_size"]
    assert facts["held_out"]["perplexity"] < vocab_size / 8, facts["held_out"]
    assert facts["corpus"]["license"] == "PSF License"


def test_tiny_greedy_text_is_ascii_words() -> None:
    out = graphkiln.LLM.eager("tiny", **ENGINE).generate(["The"], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert "\ufffd" not in out.text, out.text
    assert sum(c.isascii() for c in out.text) >= 0.95 * len(out.text), out.text
    assert len(re.findall(r"[A-Za-z]{2,}", out.text)) >= 8, out.text


def test_train_tiny_writes_a_loadable_directory(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    args = ["--device", "cpu", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "1",
            "--max-docs", "20", "--out", str(out)]
    proc = run([sys.executable, str(TRAIN_TINY), *args], timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.search(r"step +2/2 .* tok/s .* valid ppl", proc.stdout), proc.stdout
    assert {p.name for p in out.iterdir()} == MODEL_FILES
    facts = json.loads((out / "training.json").read_text())
    assert facts["training"]["steps_done"] == 2 and facts["corpus"]["documents"]["train"] == 20
    assert math.isfinite(facts["held_out"]["perplexity"]) and len(facts["samples"]) > 0
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert len(graphkiln.LLM.eager(out, **ENGINE).generate(["The kiln is"], params)[0].token_ids) == 4
