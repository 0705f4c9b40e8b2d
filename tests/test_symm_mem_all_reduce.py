"""symm_mem_all_reduce on the CPU: where it is refused, that it is off by default and changes nothing then, and the
rewrite itself on a traced tensor-parallel layer (o_proj's partial sum, the all-reduce, residual add, RMSNorm).
Running the rewritten code needs CUDA and 2 GPUs: tests/gpu/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphkiln
from graphkiln import CompileConfig, EngineConfig
from graphkiln.compat import (
    SYMM_MEM_MULTICAST, all_reduce_sum, fake_process_group, functional_all_reduce_ops, inductor_output_code,
    one_shot_all_reduce_copy, symm_mem_multicast_off,
)  # fmt: skip
from graphkiln.errors import ConfigError
from graphkiln.passes.manager import PassManager
from graphkiln.passes.pipeline import default_passes
from graphkiln.passes.symm_mem_all_reduce import NAME, SymmMemAllReduce, SymmMemAllReduceConfig

CUDA_TP2 = {"device": "cuda", "dtype": "bfloat16", "tensor_parallel_size": 2, "specialize_sizes": (1, 2, 4)}


def test_accepted_for_cuda_ranks_with_specialized_sizes() -> None:
    config = CompileConfig(enabled_passes=(NAME,), **CUDA_TP2)
    assert NAME not in PassManager(default_passes(), enabled=config.enabled_passes).disabled
    CompileConfig(enabled_passes=(NAME,), **{**CUDA_TP2, "dtype": "float32"})


@pytest.mark.parametrize(
    "change, named",
    [
        ({"device": "cpu"}, r"device='cpu' \(symmetric memory is CUDA's"),
        ({"tensor_parallel_size": 1}, r"tensor_parallel_size=1 \(one rank traces no all-reduce\)"),
        ({"dtype": "float16"}, r"dtype='float16' \(the one-shot kernel takes float32 and bfloat16\)"),
        ({"specialize_sizes": ()}, "no specialize_sizes"),
    ],
)
def test_refused_where_it_cannot_apply(change: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=f"enabled_passes names symm_mem_all_reduce, which cannot apply with {named}"):
        CompileConfig(enabled_passes=(NAME,), **{**CUDA_TP2, **change})


def test_refused_on_the_command_line_in_one_line(tmp_path: Path) -> None:
    from artifact_helpers import compile_cmd, run

    result = run(compile_cmd("tiny", "-o", tmp_path / "art", "--tensor-parallel-size", "2", "--enable-pass", NAME))
    assert result.returncode == 2, result.stderr
    assert "symm_mem_all_reduce, which cannot apply with device='cpu'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "art").exists()


def test_off_by_default() -> None:
    assert NAME in PassManager(default_passes()).disabled
    assert CompileConfig().enabled_passes == ()


def layer(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor):
    """A row-parallel projection's partial sum, summed over the ranks, added to the residual, RMS-normalized."""
    h = residual + all_reduce_sum(x @ w)
    return gamma * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), h


def traced_layer(tokens: int, dtype: torch.dtype = torch.bfloat16, mode: str = "fake", hidden: int = 64):
    """The post-grad-like ATen graph of `layer` for `tokens` rows, traced under a fake group of 2 ranks."""
    args = (torch.randn(tokens, 32, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype),
            torch.randn(32, hidden, dtype=dtype), torch.ones(hidden, dtype=dtype))  # fmt: skip
    with fake_process_group(2):
        return make_fx(layer, tracing_mode=mode)(*args)


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_small_all_reduce_becomes_the_one_shot_copy() -> None:
    gm = traced_layer(4)
    all_reduce, wait = functional_all_reduce_ops()
    assert SymmMemAllReduce()(gm.graph) == 1
    gm.graph.lint()
    assert all_reduce not in targets(gm) and wait not in targets(gm)
    (reduced,) = [n for n in gm.graph.nodes if n.target is one_shot_all_reduce_copy()]
    buffer, local, op, group = reduced.args
    assert buffer.target is torch.ops.aten.empty.memory_format and buffer.args == ([4, 64],)
    assert buffer.kwargs["dtype"] is torch.bfloat16 and local.target is torch.ops.aten.mm.default
    assert (op, group) == ("sum", "0")  # the default group's name, which every rank's world group has too
    assert reduced.meta["val"].shape == (4, 64) and reduced.meta["val"].dtype is torch.bfloat16
    (add,) = reduced.users  # the residual add reads the sum, and the RMSNorm the add, as before
    assert add.target is torch.ops.aten.add.Tensor and len(add.users) == 3


@pytest.mark.parametrize(
    "why, gm, config",
    [
        ("a token count known only at run time", lambda: traced_layer(4, mode="symbolic"), SymmMemAllReduceConfig()),
        ("over max_bytes", lambda: traced_layer(4), SymmMemAllReduceConfig(max_bytes=4 * 64 * 2 - 1)),
        ("float16", lambda: traced_layer(4, torch.float16), SymmMemAllReduceConfig()),
    ],
)
def test_left_to_nccl(why: str, gm, config: SymmMemAllReduceConfig) -> None:
    traced = gm()
    before = targets(traced)
    assert SymmMemAllReduce(config)(traced.graph) == 0, why
    assert targets(traced) == before


def test_exactly_max_bytes_is_rewritten() -> None:
    assert SymmMemAllReduce(SymmMemAllReduceConfig(max_bytes=4 * 64 * 2))(traced_layer(4).graph) == 1


def test_a_reduction_other_than_sum_is_left() -> None:
    all_reduce, wait = functional_all_reduce_ops()
    with fake_process_group(2):
        gm = make_fx(lambda x: wait(all_reduce(x, "max", "0")) + 1, tracing_mode="fake")(torch.randn(4, 8))
    assert SymmMemAllReduce()(gm.graph) == 0


@pytest.mark.slow
def test_inductor_lowers_the_rewrite_up_to_the_symmetric_buffer_which_needs_cuda() -> None:
    """On the CPU Inductor takes the rewritten graph as far as the wrapper's allocation of the symmetric buffer
    (the `empty` became a comm buffer), which it writes for a CUDA device only: why the CPU is refused."""
    manager = PassManager(default_passes(), enabled=[NAME])
    layer_with_linear = torch.compile(lambda x, residual, w, gamma: layer(x, residual, w.t(), gamma), fullgraph=True,
                                      dynamic=False, options={"post_grad_custom_post_pass": manager})  # fmt: skip
    args = [torch.randn(s, dtype=torch.bfloat16) for s in ((4, 32), (4, 64), (64, 32), (64,))]
    with fake_process_group(2), pytest.raises(Exception, match="Comm buffer requires a valid CUDA device"):
        layer_with_linear(*args)
    assert manager.records[NAME].matches == 1 and manager.records["linear_op"].matches == 1


@pytest.mark.slow
def test_the_default_compile_keeps_nccl_all_reduces(tmp_path: Path) -> None:
    """tiny at 2 ranks, one specialized size: the pass is registered but never runs, the manifest does not list
    it, and every compiled piece still calls the functional all-reduce."""
    engine = EngineConfig(decode_batch_sizes=(2,), prefill_token_buckets=(16,), kv_cache_tokens=1024)
    config = CompileConfig(tensor_parallel_size=2, specialize_sizes=(2,))
    with inductor_output_code() as codes:
        manifest, report = graphkiln.compile_model("tiny", tmp_path / "art", config, engine=engine)
    record = {r.name: r for r in report.passes}[NAME]
    assert not record.enabled and record.runs == 0
    assert NAME not in [p["name"] for p in manifest["passes"]] and not manifest["config"]["enabled_passes"]
    assert codes and all("one_shot_all_reduce" not in code and "= empty_strided_p2p(" not in code for code in codes)
    assert all("_c10d_functional.all_reduce" in code for code in codes)  # the dynamic pieces and the specialized


def test_multicast_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SYMM_MEM_MULTICAST, raising=False)
    symm_mem_multicast_off()
    assert os.environ[SYMM_MEM_MULTICAST] == "1"
    monkeypatch.setenv(SYMM_MEM_MULTICAST, "0")
    with pytest.warns(UserWarning, match="TORCH_SYMM_MEM_DISABLE_MULTICAST='0' replaced by '1'"):
        symm_mem_multicast_off()
    assert os.environ[SYMM_MEM_MULTICAST] == "1"
