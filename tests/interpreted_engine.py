"""The Triton attention backend in a whole CPU engine under Triton's interpreter (TRITON_INTERPRET=1, set by the
caller), alone and as the short half of LongPrefillBackend with the FlashInfer stand-in as the long half, against
transformers on the same float16 checkpoint; prints one JSON line. Run by tests/test_kernels_interpreted.py in a
fresh process. float16, not bfloat16: the interpreter's bfloat16 arithmetic is not the GPU's (the same kernels in
bfloat16 are the GPU tests')."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import graphkiln
from graphkiln import SamplingParams
from graphkiln.runtime.attention.long_prefill import LongPrefillBackend
from graphkiln.runtime.attention.triton_backend import TritonBackend

sys.path.insert(0, str(Path(__file__).parent))
import flashinfer_stand_in  # noqa: E402
from interpreted_kernels import _index_any_scalar  # noqa: E402

PROMPT_TOKENS, CHUNK, LONG_WORK, NEW_TOKENS = 100, 32, 2048, 4  # chunks 2 and 3 reach 2048 (query, key) pairs


def main() -> dict:
    _index_any_scalar()
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 512, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].float()
        greedy = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, PROMPT_TOKENS, dtype=torch.long),
                                do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    greedy = greedy[0, PROMPT_TOKENS:].tolist()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for name in ("triton", "triton+stand-in"):
            with graphkiln.LLM.eager(tmp, "cpu", "float16", max_num_batched_tokens=CHUNK, kv_cache_tokens=512) as llm:
                runner = llm.engine.runner
                backend = TritonBackend(runner.kv_cache)  # its KV write imported before the stand-in replaces it
                if name != "triton":
                    flashinfer_stand_in.install(pytest.MonkeyPatch())
                    from graphkiln.runtime.attention.flashinfer_backend import FlashInferBackend

                    backend = LongPrefillBackend(backend, FlashInferBackend(runner.kv_cache, workspace_bytes=16),
                                                 LONG_WORK)  # fmt: skip
                runner.backend = backend
                logits = llm.score(prompt)
                tokens = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
                error = ((logits - want).norm() / want.norm()).item()
                results[name] = {"error": error, "greedy_equal": tokens == greedy,
                                 "steps_without_graph": llm.stats().steps_without_graph}  # fmt: skip
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
