"""Tensor parallel on the CPU: real gloo process groups of 2 ranks, float32, a 2-layer model of each family.

Every LLM here starts its second rank in a process of its own, and a process holds one group at a
time, so each test closes its LLM before the next one starts.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist

import graphkiln
from artifact_helpers import COMPILED, ENGINE, SMALL_ENGINE, popen, run
from graphkiln import CompileConfig, SamplingParams
from graphkiln.compat import fake_process_group
from graphkiln.compiler.capture import capture
from graphkiln.compiler.inductor import structure_key
from graphkiln.compiler.split import split_pieces
from graphkiln.errors import ConfigError, UnsupportedModelError
from graphkiln.models import load_model
from graphkiln.models.sharding import Shard
from graphkiln.passes.manager import PassManager
from graphkiln.passes.pipeline import default_passes
from graphkiln.runtime.rank_gpus import shared_gpus
from graphkiln.runtime.tensor_parallel import parallel_engine

if TYPE_CHECKING:
    from conftest import Checkpoint

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Compiled on 2 ranks as well: the families whose graphs hold more than Llama's (biases, q/k norms). Llama's
# compiled 2-rank graphs are `tiny_tp`'s; Mistral's are Llama's.
COMPILED_FAMILIES = ("qwen2", "qwen3")
TP = CompileConfig(tensor_parallel_size=2)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3) % vocab for i in range(n)] for n in (1, 9, 23)]


def single_rank(checkpoint: Checkpoint) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits of the longest prompt and greedy tokens of every prompt, from the single-rank eager engine."""
    with graphkiln.LLM.eager(checkpoint.path, **ENGINE) as llm:
        ids = prompts(checkpoint.vocab_size)
        return llm.score(ids[-1]), [o.token_ids for o in llm.generate(ids, GREEDY)]


def check_against(llm: graphkiln.LLM, checkpoint: Checkpoint, logits: torch.Tensor, tokens: list[list[int]]) -> None:
    ids = prompts(checkpoint.vocab_size)
    torch.testing.assert_close(llm.score(ids[-1]), logits, atol=1e-4, rtol=0)
    assert [o.token_ids for o in llm.generate(ids, GREEDY)] == tokens
    streamed = [delta.token_id for delta in llm.generate_stream(ids[1], GREEDY)]
    assert streamed == tokens[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_one_rank(family: str, hf_checkpoint, tmp_path: Path) -> None:
    """Eager and, for COMPILED_FAMILIES, compiled (compile-model, then load) on 2 ranks against the single-rank
    engine."""
    checkpoint = hf_checkpoint(family)
    logits, tokens = single_rank(checkpoint)
    with graphkiln.LLM.eager(checkpoint.path, tensor_parallel_size=2, **ENGINE) as llm:
        check_against(llm, checkpoint, logits, tokens)
    assert not dist.is_initialized()
    if family not in COMPILED_FAMILIES:
        return
    manifest, _ = graphkiln.compile_model(checkpoint.path, tmp_path / "art", TP, engine=SMALL_ENGINE)
    assert manifest["config"]["tensor_parallel_size"] == 2
    with graphkiln.load(tmp_path / "art", **COMPILED) as llm:
        check_against(llm, checkpoint, logits, tokens)
        assert set(llm.engine.runner.peers.pids) == {1}
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"num_key_value_heads": 1, "vocab_size": 511}, id="one-kv-head-odd-vocab"),
        pytest.param({"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}, id="row-biases-tied"),
    ],
)
def test_eager_two_ranks_match_one_rank(hf_checkpoint, overrides: dict) -> None:
    """1 KV head on 2 ranks: each rank holds it, and an odd vocabulary pads the last rank's rows; biases of
    the row-parallel o and down projections are added once; tied embeddings share the vocabulary shard."""
    checkpoint = hf_checkpoint("llama", **overrides)
    logits, tokens = single_rank(checkpoint)
    with graphkiln.LLM.eager(checkpoint.path, tensor_parallel_size=2, **ENGINE) as llm:
        check_against(llm, checkpoint, logits, tokens)


def test_heads_not_divisible_is_refused(hf_checkpoint, tmp_path: Path) -> None:
    checkpoint = hf_checkpoint("llama", num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads=3.*num_key_value_heads=3.*size=2"):
        graphkiln.LLM.eager(checkpoint.path, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads=3"):
        graphkiln.compile_model(checkpoint.path, tmp_path / "art", TP)
    assert not (tmp_path / "art").exists() and not dist.is_initialized()


def test_shards_hold_their_slices(llama: Checkpoint) -> None:
    """Each rank's fused q/k/v rows and o columns are its heads' rows and columns of the checkpoint."""
    full = llama.model.model.layers[0].self_attn
    head_dim, heads, kv_heads = 16, 4, 2
    for rank in range(2):
        net = load_model(llama.path, shard=Shard(rank, 2))
        attn = net.model.layers[0].self_attn
        q, k, v = attn.qkv_proj.weight.split([heads // 2 * head_dim] + [kv_heads // 2 * head_dim] * 2)
        rows = slice(rank * heads // 2 * head_dim, (rank + 1) * heads // 2 * head_dim)
        kv_rows = slice(rank * head_dim, (rank + 1) * head_dim)
        torch.testing.assert_close(q, full.q_proj.weight[rows])
        torch.testing.assert_close(k, full.k_proj.weight[kv_rows])
        torch.testing.assert_close(v, full.v_proj.weight[kv_rows])
        torch.testing.assert_close(attn.o_proj.weight, full.o_proj.weight[:, rows])


def traced_pieces(path: Path, shard: Shard) -> tuple[list[str], list[str], list[str]]:
    """(piece structure keys, the ops of the pieces, the ops of the attention submodules) of one rank's graph."""
    net = load_model(path, shard=shard)
    gm = capture(net).gm
    PassManager(default_passes()).run_dynamo(gm)
    split = split_pieces(gm)
    ops = {name: [str(n.target) for n in split.gm.get_submodule(name).graph.nodes if n.op == "call_function"]
           for name, _ in split.submodules}  # fmt: skip
    pieces = [op for name in split.pieces for op in ops[name]]
    attention = [op for name, attn in split.submodules if attn for op in ops[name]]
    return [structure_key(split.gm.get_submodule(name)) for name in split.pieces], pieces, attention


def test_collectives_stay_in_pieces_and_ranks_share_code(llama: Checkpoint) -> None:
    """The all-reduces sit inside the compiled pieces, none in the attention submodules; both ranks trace
    pieces of the same structure (so one compile serves both); one rank traces no collective."""
    with fake_process_group(2):
        keys0, ops0, attention0 = traced_pieces(llama.path, Shard(0, 2))
        keys1, _, _ = traced_pieces(llama.path, Shard(1, 2))
    assert keys0 == keys1
    assert sum("all_reduce" in op for op in ops0) == 1 + 2 * 2  # the embedding, then o and down in each layer
    assert not any("c10d" in op for op in attention0)
    _, ops, _ = traced_pieces(llama.path, Shard())
    assert not any("c10d" in op for op in ops)


def test_more_ranks_than_gpus_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 but this machine shows 0 CUDA device"):
        parallel_engine(2, "cuda", None, graphkiln.EngineConfig())
    assert not dist.is_initialized()


def test_ranks_sharing_a_gpu_are_found_by_uuid() -> None:
    """Every spawned rank sees its GPU as cuda:0, so the ranks compare the GPUs' UUIDs instead of ordinals."""
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-c"]) == {}
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-a", "GPU-b"]) == {"GPU-a": [0, 2], "GPU-b": [1, 3]}


def test_inspect_shows_the_ranks(tiny_tp: Path) -> None:
    result = run([sys.executable, "-m", "graphkiln", "inspect", str(tiny_tp)])
    assert "tensor parallel 2 rank(s)" in result.stdout, result.stderr


def generate_cmd(out: Path) -> list[str]:
    return ["-m", "graphkiln", "generate", str(out), "--prompt", "The kiln is hot", "--max-tokens", "8",
            "--ignore-eos", "--kv-cache-tokens", "2048"]  # fmt: skip


def test_another_world_size_is_one_line_exit_2(tiny_tp: Path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    result = run([sys.executable, *generate_cmd(tiny_tp)])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert "torchrun started 3 processes but the artifact is compiled for tensor_parallel_size=2" in result.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_serve_from_rank_0(tiny_tp: Path) -> None:
    """Two torchrun invocations (node ranks 0 and 1, one process each, a localhost rendezvous) run the
    same `graphkiln generate`: rank 0 prints what the single-rank engine generates, rank 1 follows it."""
    with graphkiln.LLM.eager("tiny", **ENGINE) as llm:
        expected = llm.generate(["The kiln is hot"], SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    port = free_port()
    nodes = [popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                    *generate_cmd(tiny_tp)]) for rank in range(2)]  # fmt: skip
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr
    assert f"'The kiln is hot' -> {expected!r}" in outputs[0][0]
    assert "->" not in outputs[1][0]


def test_server_on_two_ranks(tiny_tp: Path) -> None:
    """`graphkiln serve` on the 2-rank artifact answers as the single-rank engine generates. Once a rank dies
    the server can serve nothing more: the request says why (503), and the server stops, exit 2, naming the
    rank, for whoever restarts it (rather than answering 500 to every request and 200 to /health)."""
    from serve_helpers import serve_process

    with graphkiln.LLM.eager("tiny", **ENGINE) as llm:
        expected = llm.generate(["The kiln is hot"], SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    with serve_process(str(tiny_tp), "--kv-cache-tokens", "2048") as server, server.http() as http:
        body = {"prompt": "The kiln is hot", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        reply = http.post("/v1/completions", json=body).json()
        pid = server.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        rank_1 = next(int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text())
        os.kill(rank_1, signal.SIGKILL)
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 503 and "RankFailedError" in failed.text, failed.text
        assert server.process.wait(60) == 2
    assert reply["choices"][0]["text"] == expected
    assert re.search(rf"error: tensor-parallel rank 1 \(pid {rank_1}\) exited with code -9", "".join(server.log))



MANY_SIZES = tuple(range(1, 25))  # 24 decode warm-ups, then prefill 16: long enough to step beside and to stop
TINY_PROMPTS = [[1, 5, 9, 200, 17, 3], [1, 7], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45]]


def test_preparation_runs_on_every_rank(tiny_tp: Path) -> None:
    """Both ranks run every warm-up, in rank 0's order, each reporting its own count and time; requests served
    while they run get the tokens of the prepared engine, and the logits of the single-rank engine."""
    with graphkiln.LLM.eager("tiny", dtype="float32", **ENGINE) as one:
        logits = one.score(TINY_PROMPTS[2])
        expected = [o.token_ids for o in one.generate(TINY_PROMPTS, GREEDY)]
    with graphkiln.load(tiny_tp, decode_batch_sizes=MANY_SIZES, **ENGINE) as llm:
        early = [o.token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)]
        first_token_at = llm.engine.first_token_at
        assert llm.wait_ready(120)
        assert first_token_at < llm.engine.preparation.finished_at  # served while the warm-ups still ran
        assert [o.token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)] == early == expected
        torch.testing.assert_close(llm.score(TINY_PROMPTS[2]), logits, atol=1e-4, rtol=0)
        prepared = llm.stats().prepared
    jobs = [("decode-warmup", str(n)) for n in MANY_SIZES] + [("prefill-warmup", "16")]
    assert [(p.kind, p.key) for p in prepared] == jobs
    for done, p in enumerate(prepared, start=1):
        assert p.error is None and [r.rank for r in p.ranks] == [0, 1]
        assert all(r.done == done and r.seconds > 0 and r.error is None for r in p.ranks)