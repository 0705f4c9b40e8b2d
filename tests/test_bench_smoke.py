"""The benchmark's main run and its studies, end to end on the CPU with tiny shapes (`python -m bench
run --smoke`, `python -m bench serve --smoke`, ...), so the harness keeps pace with the API it measures. Start-up
children and transformers' compiled row are left out to stay near 30 s each (bench/README.md runs them).

A study runs through `python -m bench`'s entry point in this process, whose torch and Inductor are already
imported and set up (its own children, the start-up ones among them, are still fresh processes); the weights
study, which times reads in its own process under switch intervals it sets, runs as `python -m bench`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
Bench = Callable[..., str]


@pytest.fixture
def bench(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Bench:
    """bench(*argv): `python -m bench ARGV` in this process, which must return 0; what it printed. The global
    random state is kept, and no process group is left behind."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.__main__ import main

    def run(*argv: str) -> str:
        capsys.readouterr()
        with torch.random.fork_rng():
            assert main(list(argv)) == 0
        assert not dist.is_initialized()
        return capsys.readouterr().out

    return run


@pytest.mark.timeout(600, method="thread")  # the run's watchdog takes SIGALRM, which the signal method also uses
def test_main_run_smoke(bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import run

    monkeypatch.setattr(run, "T0", time.time())  # the command's start, from which its budget counts
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # it points them at fresh caches it then removes
        monkeypatch.setenv(name, os.environ.get(name, str(tmp_path / name)))
    alarm = signal.getsignal(signal.SIGALRM)
    stdout = bench("run", "--smoke", "--no-start", "--static-models", "", "--no-plot", "--enable-pass", "add_rms_norm",
                   "--out", str(tmp_path))
    signal.signal(signal.SIGALRM, alarm)  # its watchdog's handler (the alarm itself is off once it returns)
    [result] = tmp_path.glob("*-cpu-smoke.json")
    results = json.loads(result.read_text())
    assert results["errors"] == []
    rows = results["models"]["smoke"]["rows"]
    assert set(rows) == {"floor", "transformers_eager", "graphkiln_compiled", "graphkiln_eager"}
    for name, row in rows.items():
        assert row["error"] is None, (name, row["error"])
        assert all("ms_per_token" in row["decode"][b] for b in ("1", "2")), (name, row["decode"])
        assert all("ms" in row["prefill"][n] for n in ("16", "48")), (name, row["prefill"])
    compiled = rows["graphkiln_compiled"]
    assert "add_rms_norm" in compiled["passes"]  # off on the CPU unless named, as --enable-pass named it
    assert compiled["check"]["argmax_agreement"] == 1.0
    assert compiled["stats"]["graphs"] == {}  # no CUDA graphs on the CPU: every step ran the compiled pieces
    assert compiled["stats"]["steps_without_graph"]["decode"] > 0
    markdown = result.with_suffix(".md").read_text()
    assert "| graphkiln compiled + CUDA graphs |" in markdown
    assert "| graphkiln compiled + CUDA graphs |" in stdout


def test_serve_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """`graphkiln serve` driven over HTTP beside the offline engine: every cell measured both ways."""
    stdout = bench("serve", "--smoke", "--clients-per-process", "4", "--server-switch-interval", "0.0005",
                   "--out", str(tmp_path))  # fmt: skip
    results = json.loads((tmp_path / "serve.json").read_text())
    assert results["errors"] == [] and results["meta"]["smoke"]
    assert results["settings"]["server_switch_interval"] == "0.0005"
    assert results["meta"]["cpu"] and results["meta"]["cpu_count"] >= 1  # the host the CPU figures depend on
    cells = [(int(c), cell) for by_level in results["cells"].values() for c, cell in by_level.items()]
    assert len(cells) == 6
    for clients, cell in cells:
        for side in ("server", "offline"):
            assert cell[side]["requests"] >= 16 and cell[side]["output_tokens_per_s"] > 0
            assert cell[side]["ttft_ms"]["p50"] <= cell[side]["ttft_ms"]["p99"]
        assert cell["overhead"] > 0
        cpu = cell["server"]["cpu"]  # both sides' CPU time was read and counted per token
        assert cpu["client_processes"] == -(-clients // 4) and cpu["clients_us_per_token"] > 0
        assert cpu["server_us_per_token"] >= cpu["server_main_thread_us_per_token"] >= 0
    assert results["server_metrics"]['graphkiln_steps_without_graph_total{kind="decode"}'] > 0
    assert "overhead" in stdout


def test_quantized_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """The quantized products study on the CPU: its bf16 rows and floors, the LM head's among them (the fp8 and int4
    kernels need CUDA)."""
    bench("quantized", "--smoke", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "quantized.json").read_text())["shapes"]
    names = ("qkv", "o", "gate_up", "down", "lm_head")
    assert {(r["name"], r["m"]) for r in rows} == {(n, m) for n in names for m in (1, 8)}
    assert all(r["format"] == "bf16" and r["cublas_us"] > 0 and r["floor_us"] > 0 for r in rows)


def test_quantized_quality_smoke(bench: Bench, tmp_path: Path, held_out_windows: list[list[int]],
                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`bench quantized --quality --smoke`: the tiny model's fp8, int8 and int4 logits (and those of its fp8 KV
    cache) against the unquantized ones and its held-out perplexity per format, compiled on the CPU; int8 (weight
    rounding alone, to 255 levels) stays closer to the unquantized model than fp8, and fp8 than int4."""
    from bench import quality

    monkeypatch.setattr(quality, "held_out_windows", lambda: held_out_windows)  # built by the same function, once
    bench("quantized", "--quality", "--smoke", "--out", str(tmp_path))
    results = json.loads((tmp_path / "quality-smoke.json").read_text())
    logits, ppl = results["logits"], results["perplexity"]
    for fmt, worst in (("fp8", 0.1), ("int4", 0.2)):
        assert 0 < logits[fmt]["median_relative_l2"] <= logits[fmt]["worst_relative_l2"] < worst, logits
        assert 0.8 < logits[fmt]["top1_agreement"] < 1, logits
    assert logits["int8"]["median_relative_l2"] < logits["fp8"]["median_relative_l2"] < logits["int4"]["median_relative_l2"]
    assert abs(ppl["int8"] / ppl["unquantized"] - 1) < 0.01
    # the weights rounded through fp8 and nothing else: a part of what fp8 moves
    assert 0 < logits["fp8-rounded"]["median_relative_l2"] < logits["fp8"]["worst_relative_l2"], logits
    # a few windows only: the formats land on either side of the unquantized model (the full set is in
    # tests/test_quantized_artifacts.py), but within the 1% and 5%
    assert abs(ppl["fp8"] / ppl["unquantized"] - 1) < 0.01 and abs(ppl["int4"] / ppl["unquantized"] - 1) < 0.05
    # the fp8 KV cache: within the 0.9-1.3% of the logits' norm and 99% greedy agreement tests/test_kv_cache_dtype.py
    # measures on this model, and within 1% of its perplexity
    cache = logits["fp8-kv-cache"]
    assert 0 < cache["median_relative_l2"] <= cache["worst_relative_l2"] < 0.03 and cache["top1_agreement"] > 0.95
    assert abs(ppl["fp8-kv-cache"] / ppl["unquantized"] - 1) < 0.01, ppl
    markdown = (tmp_path / "quality-smoke.md").read_text()
    assert "| fp8 |" in markdown and "| int4 |" in markdown and "| fp8-rounded |" in markdown
    assert "| fp8-kv-cache |" in markdown
    assert "tiny perplexity" in markdown


def test_startup_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """`python -m bench startup --smoke`: the tiny model's warm starts in fresh processes, one breakdown table."""
    stdout = bench("startup", "--smoke", "--out", str(tmp_path))
    results = json.loads((tmp_path / "startup-cpu.json").read_text())
    starts = results["starts"]
    assert list(starts) == ["tiny warm", "tiny warm (again)"]
    for child in starts.values():
        assert "error" not in child, child
        assert child["prepare_errors"] == [] and not child["transformers_imported"]
        assert child["compile_events_after_load"]["dynamo_graphs"] == 0
        assert child["compile_events_after_load"]["inductor_compiles"] == 0
        phases = child["phases_s"]
        assert {"import_torch", "import_api", "load", "weights", "inductor", "pieces", "first_token", "ready"} <= set(phases)
        assert phases["inductor"] > 0 and child["compiled_after_load_s"] > 0  # the background job loaded the pieces
        assert child["load"]["weight_bytes"] > 0 and child["start_to_first_token_s"] <= child["start_to_ready_s"]
        seconds = [job["seconds"] for job in child["slowest_jobs"]]  # the pieces job and warm-ups, slowest first
        assert seconds and seconds == sorted(seconds, reverse=True) and seconds[0] > 0
        assert {job["kind"] for job in child["slowest_jobs"]} <= {"pieces", "decode-warmup", "prefill-warmup"}
    assert "| tiny warm |" in stdout and "| tiny warm |" in (tmp_path / "startup-cpu.md").read_text()


def test_serving_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """`python -m bench serving --smoke`: decode rows and a long prompt on the CPU (SDPA), each with its floor."""
    bench("serving", "--smoke", "--out", str(tmp_path))
    result = json.loads((tmp_path / "serving-smoke.json").read_text())
    assert [(r["batch"], r["prompt"]) for r in result["decode"]] == [(1, 16), (2, 64)]
    assert all(r["backend"] == "sdpa" and r["ms_per_step"] > 0 and r["floor_ms"] > 0 for r in result["decode"])
    assert [r["tokens"] for r in result["long"]] == [256] and result["long"][0]["tflops"] > 0
    assert result["long"][0]["steps_without_graph"] == {"prefill": 1}  # one step a prompt, no graphs on the CPU
    assert result["errors"] == {} and set(result["load_s"]) == {"sdpa"}
    assert result["copy_gbs"] == max(result["copy_gbs_start"], result["copy_gbs_end"])


@pytest.mark.parametrize("content, words", [
    (None, "No such file or directory"), ("# notes\n", "not JSON ("), ("[1, 2]", "no object at its top"),
], ids=["missing", "not-json", "not-an-object"])  # fmt: skip
def test_a_report_of_a_file_that_is_no_result_json_is_one_line(
    content: str | None, words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from bench.__main__ import main

    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    for argv in (["report", str(path)], ["report", "--history", str(path)]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        message = str(info.value.code)
        assert message.startswith(f"{path}: ") and words in message and "\n" not in message, message


def test_serving_floors_take_the_faster_copy_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy rate measured after the rows 10% above the one before lowers every floor by 10%; a slower one
    leaves them."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.serving import floor_by_best_copy

    result = {"copy_gbs": 4000.0, "decode": [{"ms_per_step": 2.2, "floor_ms": 1.1, "x_floor": 2.0}]}
    floor_by_best_copy(result, 3.9e12)
    assert result["decode"][0]["floor_ms"] == pytest.approx(1.1) and result["copy_gbs"] == pytest.approx(4000)
    floor_by_best_copy(result, 4.4e12)
    row = result["decode"][0]
    assert row["floor_ms"] == pytest.approx(1.0) and row["x_floor"] == pytest.approx(2.2)
    assert (result["copy_gbs_start"], result["copy_gbs_end"]) == (pytest.approx(4000), pytest.approx(4400))


def test_results_name_the_commit_of_their_own_repository_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark tree that is its repository's top level records its commit; a copy of it unpacked inside another
    repository's work tree records 'unknown', not the other repository's commit."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.common import git_commit

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    assert git_commit(repo=tmp_path) == (head.stdout.strip(), False)
    copy = tmp_path / "copy"
    copy.mkdir()
    assert git_commit(repo=copy) == ("unknown", None)
    assert git_commit("abc1234", repo=copy) == ("abc1234", None)


def test_serving_decode_row_times_the_whole_batch_while_prompts_take_many_steps(artifact: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts prefilled over many steps (8 of 600 tokens, 256 a step): the first requests decode meanwhile,
    yet every timed step still decodes all 8, and the floor counts the contexts they reach."""
    monkeypatch.syspath_prepend(str(REPO))
    import graphkiln
    from bench.serving import decode_row

    mb = {"kv_bytes_per_token": 1.0, "weight_bytes_read": 0.0}
    with graphkiln.load(artifact, max_seq_len=1024, max_num_batched_tokens=256) as llm:
        row = decode_row(llm, 8, 600, 6, "cpu", mb, 1e9, llm.engine.vocab_size)
    assert row["batch"] == 8 and 600 + 4 < row["mean_context"] < 1024
    assert row["kv_gb"] * 1e9 == pytest.approx(8 * row["mean_context"])


def test_tp_decode_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """`python -m bench tp-decode --smoke`: the tiny shapes on 2 gloo ranks, decode and prefill timed, their greedy
    tokens those of one rank; the symm_mem_all_reduce row is skipped on the CPU, saying why."""
    bench("tp-decode", "--smoke", "--configs", "tp2,tp2-symm-mem,tp1", "--batches", "1", "--prefill", "16", "--out",
          str(tmp_path))
    rows = json.loads((tmp_path / "tp-decode.json").read_text())["rows"]
    assert rows["tp2-symm-mem"] == {"config": "tp2-symm-mem", "skipped": "needs CUDA and 2 GPUs"}
    tp2, tp1 = rows["tp2"], rows["tp1"]
    assert tp2["ranks"] == 2 and tp2["decode_ms_b1"] > 0 and tp2["prefill_ms_16"] > 0 and tp2["x_floor_b1"] > 0
    assert len(tp2["tokens"]) == 4 and all(len(g) == 32 and min(g) >= 0 for g in tp2["top2_gaps"])
    assert tp1["ranks"] == 1 and tp1["tokens"] == tp2["tokens"]  # the study compares only 2-rank rows


def test_tp_parity_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """`python -m bench tp-parity --smoke`: Qwen2's 2-layer model (q/k/v biases) at TP 2 on gloo against TP 1,
    float32: the same greedy tokens, logits within float32 rounding."""
    bench("tp-parity", "--smoke", "--families", "qwen2", "--prompts", "3", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "tp-parity.json").read_text())["rows"]
    assert (row["family"], row["dtype"], row["prompts"], row["sequences_equal"]) == ("qwen2", "float32", 3, 3)
    assert row["token_agreement"] == 1.0 and row["divergence_gaps"] == [] and row["logits_rel_diff"] < 1e-5


def test_tp_decode_names_the_reference_gap_where_tokens_part(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from bench.tp_decode import compare

    reference = {"tokens": [[1, 2, 3], [4, 5, 6]], "top2_gaps": [[0.5, 0.01, 0.2], [0.3, 0.4, 0.6]],
                 "logits": torch.zeros(2, 4)}  # fmt: skip
    row = {"tokens": [[1, 9, 8], [4, 5, 6]], "logits": torch.tensor([[0.0, 0.5, 0, 0], [0, 0, -2.0, 0]])}
    compare(row, reference)
    assert row["token_agreement"] == 4 / 6 and row["max_logit_diff"] == 2.0 and row["divergence_gaps"] == [0.01]


def test_a_model_written_a_layer_at_a_time_is_the_one_transformers_and_graphkiln_load(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """bench's by-layer writer (models over WHOLE_BUILD_BYTES, the 70B-shaped one): a file per layer plus the
    embeddings' and the head's, which transformers and graphkiln load to the same logits."""
    from transformers import LlamaForCausalLM

    import graphkiln

    monkeypatch.syspath_prepend(str(REPO))
    from bench.models import save_by_layer, shape_of

    shape = shape_of("smoke-untied")
    save_by_layer(shape, tmp_path, "cpu", torch.float32)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == shape["num_hidden_layers"] + 2 and "lm_head.weight" in index
    ids = [1, 5, 9, 200, 17]
    want = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    with graphkiln.LLM.eager(tmp_path, "cpu", "float32") as llm:
        torch.testing.assert_close(llm.score(ids), want, atol=1e-5, rtol=0)


def test_weights_study_smoke(tmp_path: Path) -> None:
    """`python -m bench weights` on the CPU: the reader and the one before it, alone, beside a thread running
    Python and beside the Inductor import in fresh processes (and that import alone), under a lowered interval."""
    cmd = [sys.executable, "-m", "bench", "weights", "--device", "cpu", "--gib", "0.1", "--ways", "graphkiln,baseline",
           "--beside-busy-thread", "--beside-import", "--switch-intervals", "0.0001", "--reps", "1",
           "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "weights-cpu.json").read_text())["rows"]
    cells = {(r["condition"], r["switch_interval"], r["way"]) for r in rows}
    ways = {"graphkiln", "baseline"}
    assert cells == {("alone", 0.005, w) for w in ways} | {
        (c, 0.0001, w) for c in ("busy-thread", "import") for w in ways
    } | {("import", 0.0001, "none")}
    for r in rows:
        assert r["way"] == "none" or r["best_GBps"] >= r["median_GBps"] > 0
        assert r["condition"] != "import" or r["import_s"] > 0
    assert "| import | 0.0001 | graphkiln |" in proc.stdout


def test_aoti_load_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """`python -m bench aoti-load --smoke`: an AOTInductor package with a mutating op loads and runs in fresh
    processes; with the op registered through torch.library.Library nothing of Inductor, Dynamo or sympy is
    imported, while a torch.library.custom_op imports Dynamo at its first call."""
    bench("aoti-load", "--smoke", "--out", str(tmp_path))
    rows = {r["registration"]: r for r in json.loads((tmp_path / "aoti-load.json").read_text())["rows"]}
    assert rows["library"]["matches"] and rows["custom_op"]["matches"]
    assert not (rows["library"]["inductor"] or rows["library"]["dynamo"] or rows["library"]["sympy"])
    assert rows["custom_op"]["dynamo"]


def test_steps_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """Steps beside the background preparation, in a fresh process: every step of the six requests timed, the
    pieces job recorded first, a slow step's sample holding the main thread's stack."""
    bench("steps", "--smoke", "--processes", "1", "--slow-ms", "1", "--out", str(tmp_path))
    [run] = json.loads((tmp_path / "steps.json").read_text())["processes"]
    assert len(run["steps_s"]) >= 32 and all(s > 0 for s in run["steps_s"][:-1])
    assert run["prepared"][0][:2] == ["pieces", "compiled"]
    assert run["slow_steps"] and "MainThread" in run["slow_steps"][0]["stacks"]


def test_resources_occupancy_is_the_tightest_of_registers_warps_and_shared_memory() -> None:
    """Programs a Hopper multiprocessor holds: registers (8 a thread at a time), warps, shared memory, 32 at most."""
    from bench.resources import occupancy

    assert occupancy(255, 4, 106752) == 2  # 256 registers x 128 threads: 2 of 64K
    assert occupancy(64, 8, 20480) == 4  # registers, though warps allow 8 and shared memory 11
    assert occupancy(32, 4, 200 * 1024) == 1  # shared memory
    assert occupancy(24, 16, 0) == 4  # warps: 64 / 16
    assert occupancy(16, 1, 0) == 32


def test_resources_study_smoke(bench: Bench, tmp_path: Path) -> None:
    """Our kernels compiled for sm90 without a GPU (where Triton is installed): one row per decode batch, the row
    and block kernels on bf16 and fp8 caches at the last batch, a variant, prefill, rope, and one per one-row
    product (bf16, int4 byte and dp4a, fp8, int8), each GEMV's loop counted, and at 8 rows per-channel fp8 as
    fp8_linear dispatches sm90 (the smoke model's narrow weights on fp8_mma); the decode grid as the engine plans
    it, every kernel fitting a multiprocessor."""
    pytest.importorskip("triton")
    from graphkiln.runtime.attention.triton_backend import decode_tiles

    bench("resources", "--models", "smoke", "--batches", "1", "2", "--max-context", "256", "--prefill-tokens", "32",
          "--decode-variants", "1x16x2x1", "--rows", "1", "8", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "resources.json").read_text())["kernels"]
    assert [r["what"] for r in rows[:8]] == [
        "decode b=1", "decode b=2", "decode b=2 fp8 cache", "block decode b=2", "block decode b=2 fp8 cache",
        "decode b=1 variant", "prefill 32", "rope 32"]
    assert (rows[5]["grid"], rows[5]["warps"]) == ("2x1x1", 2)
    products = [r["what"] for r in rows[8:] if r["tiles"] and r["what"].endswith("m=1")]  # not their helpers
    assert products == [f"{p} {kind} m=1" for p in ("qkv", "o", "gate_up", "down", "lm_head") for kind in
                        ("bf16", "int4 byte", "int4 dp4a", "fp8 per channel", "fp8 per block", "int8 w8a8",
                         "int8 w8a16", "int8 w8a16-groups")]
    narrow = [r["kernel"] for r in rows if r["what"].endswith("per channel m=8") and r["tiles"]]
    assert narrow == ["mma_kernel"] * 5  # weights of fewer than TMA_MIN_N rows keep fp8_mma on sm90
    gemvs = [r for r in rows[8:] if r["tiles"] and r["what"].endswith("m=1") and "per block" not in r["what"]]
    assert all(r["loop"] > 1 and r["per_weight"] > 0 for r in gemvs)  # a one-row GEMV: a loop over the weight
    plan = decode_tiles(2, 2, 256, 16, 2, 132)
    assert rows[1]["grid"] == f"2x{plan.num_splits}x2"
    assert all(0 < r["registers"] <= 255 and r["per_sm"] >= 1 and r["waves"] >= 1 for r in rows)
