"""Shared fixtures: tiny random Hugging Face checkpoints built once per session with transformers' own
classes, and the tiny model's artifact compiled once per session."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import graphkiln
from artifact_helpers import ENGINE, SMALL_CONFIG, SMALL_CONFIG_ARGS, SMALL_ENGINE, greedy_tokens, temp_folders
from hub_helpers import HUB_REPO, use_hub_env
from graphkiln import cli
from graphkiln.compiler.counters import torch_compile_events
from graphkiln.models.tiny import tiny_model_dir

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
VOCAB = 512
MAX_CONTEXT = 256
BASE_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=MAX_CONTEXT,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


@dataclass(frozen=True)
class Checkpoint:
    """A saved checkpoint directory and the float32 transformers model it was saved from."""

    path: Path
    model: PreTrainedModel

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.model.config.max_position_embeddings

    def reference_logits(self, ids: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([list(ids)])).logits[0].float()

    def reference_greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """transformers' greedy continuation of one unpadded prompt, never stopping early."""
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()


CheckpointFactory = Callable[..., Checkpoint]


@pytest.fixture(scope="session", autouse=True)
def single_thread() -> Iterator[None]:
    """The test models are tiny: on a shared 2-core runner, intra-op threads cost far more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """Factory: hf_checkpoint(family, max_shard_size=None, **config_overrides) -> Checkpoint, cached per session.

    Weights come from a fixed seed, so checkpoints differing only in non-weight fields
    (eos_token_id, sharding) hold identical tensors. Biases and norm weights are drawn too (transformers
    initializes them to 0 and 1, which would hide a bias not loaded or two norms swapped).
    """
    built: dict[str, Checkpoint] = {}

    def build(family: str, max_shard_size: str | None = None, **overrides) -> Checkpoint:
        key = json.dumps([family, max_shard_size, overrides], sort_keys=True)
        if key not in built:
            config_cls, model_cls = FAMILIES[family]
            config = config_cls(**{**BASE_CONFIG, **overrides})
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = model_cls(config).eval()
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if name.endswith(".bias"):
                            p.copy_(0.1 * torch.randn_like(p))
                        elif name.endswith("norm.weight"):
                            p.copy_(1 + 0.1 * torch.randn_like(p))
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
            built[key] = Checkpoint(path, model)
        return built[key]

    return build


@pytest.fixture(scope="session")
def llama(hf_checkpoint: CheckpointFactory) -> Checkpoint:
    """The default small Llama checkpoint (GQA, untied, no eos) most runtime tests use."""
    return hf_checkpoint("llama")


def _random_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="session")
def random_ids() -> Callable[..., list[int]]:
    """random_ids(n, seed=0): n seeded token ids inside the test checkpoints' vocabulary."""
    return _random_ids


@pytest.fixture
def prompts() -> list[list[int]]:
    """Token-id prompts of different lengths, the first of length 1."""
    return [_random_ids(n, seed=n) for n in (1, 6, 13)]


@pytest.fixture(scope="session")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model compiled once for the session. Tests must not modify it: copy it first (`art`)."""
    out = tmp_path_factory.mktemp("artifacts") / "tiny"
    manifest, report = graphkiln.compile_model("tiny", out, SMALL_CONFIG, engine=SMALL_ENGINE)
    report.counters.expect(graphs_traced=1, inductor_compiles=3, specialized_compiles=0)
    assert torch_compile_events()["dynamo_graphs"] >= 1  # the counters the fresh-process test reads do count
    assert (out / "manifest.json").is_file() and not temp_folders(out)
    return out


@pytest.fixture(scope="session")
def eager_tokens() -> list[list[int]]:
    """Greedy tokens of the eager tiny model for artifact_helpers.PROMPTS."""
    return greedy_tokens(graphkiln.LLM.eager("tiny", **ENGINE))


@pytest.fixture(scope="session")
def held_out_windows() -> list[list[int]]:
    """The tiny model's held-out windows (bench/quality.py parses the standard library's docstrings for them:
    seconds), built once for the session."""
    from bench import quality

    return quality.held_out_windows()


@pytest.fixture
def art(artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the session's artifact, free to corrupt."""
    return Path(shutil.copytree(artifact, tmp_path / "art"))


API_KEY = "test-key-0123"


@pytest.fixture(scope="session")
def server(artifact: Path) -> Iterator:
    """`graphkiln serve` on the session's artifact (an API key, a 64 KiB body limit): every HTTP test's server. It
    prepares before it serves (`--capture blocking`), so that its answers are the compiled pieces', as `offline`'s."""
    from serve_helpers import serve_process

    args = ("--kv-cache-tokens", "8192", "--max-body-bytes", "65536", "--api-key", API_KEY, "--capture", "blocking")
    with serve_process(str(artifact), *args, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face hub cache holding the tiny model as HUB_REPO, in the hub's layout (refs/main names the
    snapshot folder): this machine is offline, graphkiln only ever looks in the cache."""
    root = tmp_path_factory.mktemp("hf-hub")
    repo = root / f"models--{HUB_REPO.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model_dir(), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


@pytest.fixture(scope="session")
def hub_env(hub_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment that points huggingface_hub at `hub_cache` and graphkiln's compile cache at a folder
    of the session's (for subprocesses; `use_hub_env` sets it in this process)."""
    return {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1",
            "GRAPHKILN_CACHE_DIR": str(tmp_path_factory.mktemp("graphkiln-cache"))}  # fmt: skip


@pytest.fixture(scope="session")
def hub_artifact(hub_env: dict[str, str]) -> Path:
    """HUB_REPO compiled once into the session's compile cache (what `serve HUB_REPO --compile` finds there)."""
    with use_hub_env(hub_env):
        return graphkiln.cached_artifact(HUB_REPO)


@pytest.fixture(scope="session")
def tiny_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (tied embeddings, a tokenizer) compiled for 2 ranks by `compile-model` (its entry point, in
    this process: the compile's fake process group is the same in a fresh one)."""
    out = tmp_path_factory.mktemp("tp") / "tiny-tp2"
    assert cli.compile_model_main(["tiny", "-o", str(out), "--tensor-parallel-size", "2", *SMALL_CONFIG_ARGS,
                                   "--quiet"]) == 0  # fmt: skip
    return out
