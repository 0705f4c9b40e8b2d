"""Start-up on CUDA: a request submitted right after load is answered while graphs are still being captured,
with the tokens of a fully captured engine, no step waiting long for a capture, nothing compiled and none of
graphkiln's modules imported after load; and the weights reader's rate from the page cache to the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import graphkiln
from graphkiln import CompileConfig, SamplingParams
from greedy_helpers import assert_greedy_agrees
from graphkiln.models.safetensors_header import read_header
from graphkiln.models.weights_reader import TensorRead, WeightsReader

REPORT = os.environ.get("GRAPHKILN_GPU_REPORT")
ENGINE = dict(kv_cache_tokens=16384, attention_backend="auto")  # the default 13 decode sizes and 9 prefill buckets


def record(name: str, value) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({name: value}) + "\n")


def test_request_during_background_capture_matches_a_captured_engine(tmp_path: Path) -> None:
    out = tmp_path / "art"
    graphkiln.compile_model("tiny", out, CompileConfig(device="cuda", dtype="bfloat16"))
    prompts = [[5 + i] * (1 + 3 * i) for i in range(6)]
    script = f"""
import json, sys, time, dataclasses, graphkiln
from graphkiln.compiler.counters import torch_compile_events
llm = graphkiln.load({str(out)!r}, **{ENGINE!r})
after_load = torch_compile_events()
loaded = set(sys.modules)
engine = llm.engine
seqs = [engine.add_request(p, graphkiln.SamplingParams(max_tokens=32, ignore_eos=True)) for p in {prompts!r}]
ready_at_first_step = llm.stats().ready
steps = []
while any(s.finish_reason is None for s in seqs):
    t = time.perf_counter()
    engine.step()
    steps.append(time.perf_counter() - t)
tokens = [list(s.output_ids) for s in seqs]
llm.wait_ready()
stats = llm.stats()
imported = sorted(set(sys.modules) - loaded)
print(json.dumps({{"tokens": tokens, "ready_at_first_step": ready_at_first_step, "steps_s": steps,
    "events_after_load": after_load, "events": torch_compile_events(), "load": dataclasses.asdict(stats.load),
    "errors": [p.error for p in stats.prepared if p.error], "prepared": len(stats.prepared),
    "longest_job_s": max(p.seconds for p in stats.prepared), "graphs": stats.graphs_captured,
    "pool_bytes": stats.graph_pool_bytes, "step_waits": dataclasses.asdict(stats.step_waits),
    "imported_after_load": imported, "without_graph": stats.steps_without_graph,
    "flashinfer_imported": "flashinfer" in sys.modules, "backend": engine.runner.backend.name}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    record("startup_background_capture", {k: result[k] for k in ("load", "prepared", "longest_job_s", "graphs",
                                                                 "without_graph", "ready_at_first_step", "pool_bytes",
                                                                 "step_waits", "imported_after_load")}
           | {"first_step_s": result["steps_s"][0], "longest_later_step_s": max(result["steps_s"][1:]),
              "steps": len(result["steps_s"])})  # fmt: skip
    assert not result["ready_at_first_step"], "every graph was captured before the first step: nothing was tested"
    assert result["errors"] == []
    assert result["events"]["dynamo_graphs"] == 0 and result["events"]["inductor_compiles"] == 0
    # load imports our kernels; the background job after it Inductor and the pieces: nothing of ours is left
    assert [m for m in result["imported_after_load"] if m.startswith("graphkiln")] == []
    # auto takes Triton and leaves FlashInfer unimported, installed or not
    assert result["backend"] == "triton" and not result["flashinfer_imported"]
    captured = graphkiln.load(out, capture="blocking", **ENGINE)
    # Captured smallest first in the background, largest first when blocking: what that costs in pool memory.
    record("startup_pool_bytes", {"background": result["pool_bytes"], "blocking": captured.stats().graph_pool_bytes})
    want = [o.token_ids for o in captured.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))]
    # the first steps ran eagerly (the pieces still loading), which may round otherwise than the compiled model
    exact = assert_greedy_agrees(captured, prompts, want, result["tokens"])
    record("startup_background_tokens_exact", {"exact": exact, "of": len(prompts)})
    # A step waits for at most one capture (plus its own run): the longest capture bounds the stall. The
    # first step also pays the first call of every kernel it runs without a graph; it is recorded above.
    assert max(result["steps_s"][1:]) < result["longest_job_s"] + 0.05


def test_kernels_are_built_on_the_builders_pool_with_triton_cache_empty(tmp_path: Path) -> None:
    """With Triton's cache empty (a fresh machine or container) and no kernels shipped in the artifact (compiled
    with `build_kernels=False`), every graphkiln kernel built after `load`
    returned (a short first prompt's prefill served eagerly, the compiled pieces' first calls, the captures) is
    built on the builders' pool (kernels/launch.py), several at once and each specialization once, none by the
    thread that launches it; within `load`, the engine's own first calls build theirs there too, none on the
    main thread; the builds job comes before the captures, and every graph is captured."""
    out = tmp_path / "art"
    graphkiln.compile_model("tiny", out, CompileConfig(device="cuda", dtype="bfloat16"), build_kernels=False)
    assert not (out / "triton-kernels").exists()
    script = f"""
import json, threading, triton, graphkiln
builds, loaded = [], []
def built(**kw):
    info = kw["fn"]
    builds.append([threading.current_thread().name, info.module, info.name, str(kw["compile"]["key"]),
                   bool(loaded)])
triton.knobs.runtime.jit_post_compile_hook = built
llm = graphkiln.load({str(out)!r}, **{ENGINE!r})
loaded.append(True)
first = llm.generate([[5, 6, 7, 8, 9]], graphkiln.SamplingParams(max_tokens=2, ignore_eos=True))  # eager: 16-row tiles
llm.wait_ready()
done = llm.generate([[5, 6, 7], [9] * 40], graphkiln.SamplingParams(max_tokens=8, ignore_eos=True))
stats = llm.stats()
print(json.dumps({{"builds": builds, "prepared": [[p.kind, p.key, p.error] for p in stats.prepared],
                  "tokens": [len(o.token_ids) for o in first + done], "replays": sum(stats.graphs["decode"].replays.values())}}))
"""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    later = [b for b in result["builds"] if b[1].startswith("graphkiln.kernels") and b[4]]
    record("startup_kernel_builds", {"after_load": len(later), "threads": len({b[0] for b in later})})
    assert later, "no graphkiln kernel was built after load: nothing was tested"
    ours = [b for b in result["builds"] if b[1].startswith("graphkiln.kernels")]
    assert [b[:3] for b in ours if b[0] == "MainThread"] == [], "load's first calls built a kernel one at a time"
    assert [b[:3] for b in later if not b[0].startswith("graphkiln-kernel-build")] == []
    assert len({b[3] for b in later}) == len(later), "a specialization was built twice"
    assert len({b[0] for b in later}) > 1 or len(later) == 1 or (os.cpu_count() or 1) < 4
    kinds = [p[0] for p in result["prepared"]]
    assert kinds.index("kernels") < kinds.index("decode") and [p for p in result["prepared"] if p[2]] == []
    assert result["tokens"] == [2, 8, 8] and result["replays"] > 0


def _serve_and_count_builds(out: Path, env: dict) -> dict:
    """A fresh process loads `out` and serves until every graph is in; graphkiln's Triton kernels (Inductor's
    are triton_*) it built, and those it read from Triton's cache."""
    script = f"""
import json, triton, graphkiln
events = []
triton.knobs.compilation.listener = lambda **kw: events.append([kw["src"].name, kw["cache_hit"]])
llm = graphkiln.load({str(out)!r})
first = llm.generate([[5, 6, 7, 8, 9]], graphkiln.SamplingParams(max_tokens=2, ignore_eos=True))
llm.wait_ready()
done = llm.generate([[5, 6, 7], [9] * 40], graphkiln.SamplingParams(max_tokens=8, ignore_eos=True))
assert [len(o.token_ids) for o in first + done] == [2, 8, 8]
assert [p for p in llm.stats().prepared if p.error] == []
ours = [(name, hit) for name, hit in events if not name.startswith("triton_")]
print(json.dumps({{"built": sorted({{name for name, hit in ours if not hit}}), "read": sum(hit for _, hit in ours)}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_compile_builds_the_kernels_its_first_start_needs_here_and_elsewhere(tmp_path: Path) -> None:
    """compile_model on CUDA loads its artifact once (build_serving_kernels) and ships the Triton kernels that load
    used in it (kernels/shipped.py): a first start on this machine reads graphkiln's kernels from Triton's
    cache, and one on another machine of the kind (a Triton cache of its own, empty) from the artifact; neither
    builds any. The processes start with TRITON_CACHE_DIR and TRITON_PTXAS_PATH unset, as a user's do, and the
    compile's Inductor builds in its own process (one compile thread, as on a small machine): there Inductor
    would change both settings midway through the compile, and with them the folder and the cache key of
    graphkiln's kernels built after it, unless graphkiln fixes them first (compat.pin_triton_environment)."""
    out = tmp_path / "art"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")}
    env.update(TRITON_HOME=str(tmp_path / "triton-home"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    compile_script = f"""
import graphkiln
graphkiln.compile_model("tiny", {str(out)!r}, graphkiln.CompileConfig(device="cuda", dtype="bfloat16"),
                        engine=graphkiln.EngineConfig(**{ENGINE!r}))
"""
    done = subprocess.run([sys.executable, "-c", compile_script], capture_output=True, text=True, timeout=600,
                          env={**env, "TORCHINDUCTOR_COMPILE_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    shipped = sorted(p.name for p in (out / "triton-kernels").iterdir())
    here = _serve_and_count_builds(out, env)
    elsewhere = _serve_and_count_builds(out, {**env, "TRITON_HOME": str(tmp_path / "other-machine")})
    record("kernels_built_by_compile", {"shipped": len(shipped), "here": here, "elsewhere": elsewhere})
    assert shipped, "the compile shipped no graphkiln kernel: nothing was tested"
    assert here["built"] == [] and elsewhere["built"] == []
    assert elsewhere["read"] > 0


def test_random_draws_inside_captures_paused_beside_background_captures(tmp_path: Path) -> None:
    """While an engine captures its graphs in the background, random draws on the device inside
    `captures_paused()` succeed and every graph is still captured; without the capture lock a draw raises
    "Offset increment outside graph capture". (A compile beside captures, whose autotuning draws its inputs,
    is test_quantized.py's quality test.)"""
    out = tmp_path / "art"
    graphkiln.compile_model("tiny", out, CompileConfig(device="cuda", dtype="bfloat16"))
    llm = graphkiln.load(out, **ENGINE)
    draws = 0
    while not llm.engine.preparation.ready:
        with graphkiln.captures_paused():
            torch.randn(1024, device="cuda")
        draws += 1
        time.sleep(0.002)  # the lock is not fair: leave the preparation thread a turn
    assert draws > 1, "the captures were done before the first draw: nothing was tested"
    assert [p.error for p in llm.stats().prepared if p.error] == []
    assert llm.stats().graphs["decode"].graphs > 0
    llm.close()


def test_weights_reader_rate_to_the_device(tmp_path: Path) -> None:
    """2 GiB of bfloat16 from the page cache (written just now) to the device: the bytes arrive intact, a column
    shard converted on the device too, and the rate is recorded and held above 5 GB/s (a broken path's; the
    comparison with safetensors' own reader is `python -m bench weights`')."""
    from safetensors.torch import save_file

    shape = (4096, 14336)
    tensors = {f"w{i}": torch.randn(shape).to(torch.bfloat16) for i in range(18)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    entries = read_header(path)
    dests = {n: torch.empty(shape, dtype=torch.bfloat16, device="cuda") for n in tensors}
    reader = WeightsReader(torch.device("cuda"))
    rates = []
    for _ in range(4):
        torch.cuda.synchronize()
        t = time.perf_counter()
        stats = reader.read([TensorRead(entries[n], d) for n, d in dests.items()])
        torch.cuda.synchronize()
        rates.append(stats.bytes / (time.perf_counter() - t) / 1e9)
    record("weights_reader_GBps", {"rates": rates, "bytes": stats.bytes})
    for name in ("w0", "w17"):
        assert torch.equal(dests[name].cpu(), tensors[name])
    right = torch.empty(4096, 7168, dtype=torch.float32, device="cuda")  # a column shard, converted on the device
    half = reader.read([TensorRead(entries["w3"], right, cols=(7168, 14336))])
    assert half.bytes == 4096 * 7168 * 2
    assert torch.equal(right.cpu(), tensors["w3"][:, 7168:].float())
    assert max(rates[1:]) > 5.0  # the target is 10 GB/s (bench/weights.py reports it); this catches a broken path
