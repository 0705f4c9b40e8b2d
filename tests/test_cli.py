"""The command line: `compile-model` and `graphkiln inspect | generate | compile`.

Exit codes: 0 success, 2 bad input with one line on stderr naming the problem. The tiny model is
compiled once, by `python -m graphkiln.compile_model ... --json --quiet` in a subprocess; the cheap
checks call the entry points in-process.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import graphkiln
from artifact_helpers import (
    RESULT_PREFIX,
    SMALL_CONFIG_ARGS,
    compile_cmd,
    run,
    run_python_json,
    single_error_line,
    temp_folders,
)
from graphkiln import cli
from graphkiln.models.tiny import tiny_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """(OUT, the parsed --json summary, stderr) of one `compile-model tiny -o OUT --json --quiet`."""
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = run(compile_cmd("tiny", "-o", out, "--json", "--quiet", *SMALL_CONFIG_ARGS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads(proc.stdout), proc.stderr


@pytest.fixture(scope="module")
def manifest(compiled: tuple[Path, dict, str]) -> dict:
    return json.loads((compiled[0] / "manifest.json").read_text())


# ---------------------------------------------------------------- help and entry points


@pytest.mark.parametrize(
    "entry, argv",
    [
        (cli.compile_model_main, ["--help"]),
        (cli.main, ["--help"]),
        (cli.main, ["inspect", "--help"]),
        (cli.main, ["generate", "--help"]),
        (cli.main, ["compile", "--help"]),
    ],
    ids=["compile-model", "graphkiln", "inspect", "generate", "compile"],
)
def test_help_exits_0(entry, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        entry(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    if entry is cli.compile_model_main or argv[0] == "compile":
        for option in ("--out", "--decode-batch-sizes", "--prefill-token-buckets", "--force", "--json", "--quiet"):
            assert option in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"graphkiln {graphkiln.__version__}\n"


def test_cli_offers_the_quantizations_compile_config_takes() -> None:
    """The CLI keeps its own copy (compiler.config imports torch, which its help must not)."""
    from graphkiln.compiler.config import QUANTIZATIONS

    assert cli.QUANTIZATIONS == QUANTIZATIONS


def test_inspect_version_and_help_import_neither_torch_nor_transformers(compiled: tuple[Path, dict, str]) -> None:
    """Reading JSON needs neither (nor the server's packages): a fresh interpreter runs each command and
    reports what it imported."""
    commands = [["inspect", str(compiled[0])], ["--version"], ["--help"], ["inspect", "--help"], ["generate", "--help"],
                ["serve", "--help"]]
    result = run_python_json(f"""
import contextlib, io, json, sys
from graphkiln.cli import main
outputs = []
for argv in {commands!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    outputs.append([code, out.getvalue()])
heavy = ("torch", "transformers", "fastapi", "uvicorn")
print("{RESULT_PREFIX}" + json.dumps({{"outputs": outputs, "imported": [m for m in heavy if m in sys.modules]}}))
""")
    assert result["imported"] == []
    (inspect, version, *helps) = result["outputs"]
    assert inspect[0] == 0 and "submodule    kind" in inspect[1] and "tokenizer     snapshot" in inspect[1]
    assert version == [0, f"graphkiln {graphkiln.__version__}\n"]
    assert all(code == 0 and text.startswith("usage: ") for code, text in helps)


def test_console_scripts_point_at_the_cli() -> None:
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("compile-model") == "graphkiln.cli:compile_model_main"
    assert scripts.get("graphkiln") == "graphkiln.cli:main"


# ---------------------------------------------------------------- compile-model


def test_compile_json_summary(compiled: tuple[Path, dict, str], manifest: dict) -> None:
    out, summary, stderr = compiled
    assert {"pieces", "unique_pieces", "counters", "timings_s", "artifact_bytes"} <= set(summary)
    assert summary["pieces"] == len(manifest["compiled"]["pieces"]) == 5  # 4 layers -> 5 pieces
    assert summary["unique_pieces"] == len(manifest["compiled"]["unique_pieces"]) == 3
    assert summary["counters"]["inductor_compiles"] == 3
    assert summary["counters"]["attention_pieces"] == 4
    assert summary["artifact_bytes"] == sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert set(summary["timings_s"]) >= {"trace", "inductor", "save"}
    assert summary["device"] == "cpu" and summary["dtype"] == "float32"
    assert "load weights" not in stderr and "[" not in stderr  # --quiet: no progress bar
    assert manifest["engine"]["decode_batch_sizes"] == [1, 2, 4]
    assert manifest["engine"]["prefill_token_buckets"] == [16, 32]
    assert not temp_folders(out)


@pytest.fixture(scope="module")
def nonexistent_model(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("nonexistent") / "X"
    return out, run(compile_cmd("/nonexistent", "-o", out))


def test_nonexistent_model_exits_2_naming_it(nonexistent_model) -> None:
    out, proc = nonexistent_model
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("error:") == 1
    assert re.search(r"error: /nonexistent: [^\n]+\n$", proc.stderr), repr(proc.stderr)  # the last line names it
    assert not out.exists() and not temp_folders(out)


def test_nonexistent_model_prints_exactly_one_line(nonexistent_model) -> None:
    _, proc = nonexistent_model
    line = single_error_line(proc.stderr)  # the model is checked before any progress is printed
    assert line.startswith("error: /nonexistent"), line


@pytest.mark.parametrize("entry", [cli.compile_model_main, lambda argv: cli.main(["compile", *argv])], ids=["compile-model", "graphkiln-compile"])
def test_compile_existing_out_without_force_exits_2(
    entry, compiled: tuple[Path, dict, str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = compiled[0]
    before = (out / "manifest.json").read_bytes()
    assert entry(["tiny", "-o", str(out), *SMALL_CONFIG_ARGS]) == 2
    captured = capsys.readouterr()
    line = single_error_line(captured.err)
    assert line.startswith("error: ") and str(out) in line and "already exists" in line
    assert captured.out == ""
    assert (out / "manifest.json").read_bytes() == before


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--decode-batch-sizes", "4,2", r"decode_batch_sizes=\[4, 2\].*strictly increasing"),
        ("--prefill-token-buckets", "16,16", r"prefill_token_buckets=\[16, 16\].*strictly increasing"),
        ("--decode-batch-sizes", "0,1", r"decode_batch_sizes=\[0, 1\].*positive"),
    ],
    ids=["decode-decreasing", "prefill-repeated", "decode-zero"],
)
def test_bad_sizes_exit_2(flag: str, value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli.compile_model_main(["tiny", "-o", str(out), flag, value]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith("error: ") and re.search(message, line), line
    assert not out.exists() and not temp_folders(out)


@pytest.mark.parametrize("flags, size, bound", [
    (("--specialize-sizes", "16,99999999999"), 99999999999, 2048),
    (("--specialize-sizes", "16,128", "--max-num-batched-tokens", "64"), 128, 64),
], ids=["huge", "above-the-recorded-bound"])  # fmt: skip
def test_a_specialized_size_no_step_reaches_exits_2(
    flags: tuple[str, ...], size: int, bound: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step holds at most max_num_batched_tokens tokens: a larger size's compile would never be called (and a huge
    one failed inside torch's allocator)."""
    out = tmp_path / "out"
    assert cli.compile_model_main(["tiny", "-o", str(out), *flags, *SMALL_CONFIG_ARGS]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: CompileConfig.specialize_sizes holds {size}, more tokens than a step holds "
                           f"(EngineConfig.max_num_batched_tokens={bound}); "), line
    assert not out.exists() and not temp_folders(out)


def test_a_specialized_size_the_machine_cannot_hold_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Within a huge --max-num-batched-tokens, a specialized size whose example inputs no allocator holds is
    one line naming the size, not the allocator's error from inside torch."""
    out, size = tmp_path / "out", 10**11
    flags = ["--specialize-sizes", str(size), "--max-num-batched-tokens", str(size)]
    assert cli.compile_model_main(["tiny", "-o", str(out), *flags, *SMALL_CONFIG_ARGS]) == 2
    progress, line = capsys.readouterr().err.rstrip("\n").rsplit("\n", 1)
    assert "Traceback" not in progress and "error" not in progress
    assert line.startswith(f"error: specialize size {size}: a piece's example inputs take "), line
    assert line.endswith("choose smaller --specialize-sizes (CompileConfig.specialize_sizes)"), line
    assert not out.exists() and not temp_folders(out)


def test_sizes_that_are_not_integers_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.compile_model_main(["tiny", "-o", str(tmp_path / "out"), "--decode-batch-sizes", "1,two"])
    assert info.value.code == 2
    assert "'1,two' is not a comma-separated list of integers" in capsys.readouterr().err


def test_dump_dir_without_depyf_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "depyf", None)
    monkeypatch.setitem(sys.modules, "depyf.explain", None)
    out, dump = tmp_path / "out", tmp_path / "dump"
    assert cli.compile_model_main(["tiny", "-o", str(out), "--dump-dir", str(dump), *SMALL_CONFIG_ARGS]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith("error: CompileConfig.dump_dir (--dump-dir) needs depyf") and "graphkiln[dump]" in line
    assert not out.exists() and not dump.exists() and not temp_folders(out)


def test_piece_keys_are_reproducible(manifest: dict, artifact: Path) -> None:
    """The same model and config compiled in another process names its pieces the same: the session's artifact,
    compiled in this process with SMALL_CONFIG and SMALL_ENGINE, against the subprocess's."""
    again = json.loads((artifact / "manifest.json").read_text())
    assert again["compiled"]["pieces"] == manifest["compiled"]["pieces"]


# ---------------------------------------------------------------- inspect


def test_inspect_prints_the_piece_table(compiled: tuple[Path, dict, str], manifest: dict, capsys: pytest.CaptureFixture[str]) -> None:
    out = compiled[0]
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    table = text[text.index("submodule") :].splitlines()[1:]
    assert len(table) == len(manifest["compiled"]["submodules"])
    for row, (name, is_attention) in zip(table, manifest["compiled"]["submodules"]):
        assert row.split()[0] == name
        if is_attention:
            assert "attention" in row
        else:
            assert manifest["compiled"]["pieces"][name] in row
    assert set(manifest["compiled"]["unique_pieces"]) <= set(text.split())
    assert "attention" in text and "float32" in text and manifest["environment"]["torch"] in text
    assert "tokenizer     snapshot in the artifact" in text


def test_inspect_json(compiled: tuple[Path, dict, str], manifest: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", str(compiled[0]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == manifest


def test_inspect_missing_artifact_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert cli.main(["inspect", str(missing)]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {missing}: no such artifact directory")


def test_inspect_corrupt_manifest_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{not json")
    assert cli.main(["inspect", str(tmp_path / "art")]) == 2
    assert "manifest.json: not valid JSON" in single_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------- generate


def test_generate(compiled: tuple[Path, dict, str], capsys: pytest.CaptureFixture[str]) -> None:
    """With the engine's own defaults (no --kv-cache-tokens); `python -m graphkiln generate` itself runs in
    test_tensor_parallel.py's torchrun test."""
    assert cli.main(["generate", str(compiled[0]), "--prompt", "hi", "--max-tokens", "4"]) == 0
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0].startswith("'hi' -> ")
    assert re.search(r"\b[1-4] tokens, first token [\d.]+ ms, [\d.]+ tokens/s", stdout), stdout


def test_generate_missing_artifact_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "no such artifact directory" in single_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("command", ["generate", "inspect"])
def test_a_folder_that_is_no_artifact_says_so(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not "recompile with --force": --force refuses a folder that is not an artifact."""
    (tmp_path / "notes.txt").write_text("mine\n")
    assert cli.main([command, str(tmp_path), *(["--prompt", "hi"] if command == "generate" else [])]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line == (f"error: {tmp_path}: not a graphkiln artifact (it holds no manifest.json); compile one into a "
                    "new folder with `compile-model MODEL -o OUT`")


def test_generate_on_a_model_directory_says_to_compile_it(capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_model_dir()
    assert cli.main(["generate", str(model), "--prompt", "hi"]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {model}: a model directory (config.json), not a graphkiln artifact (no "
                           f"manifest.json); compile it first with `compile-model {model} -o OUT`, or "), line


def _generate(capsys: pytest.CaptureFixture[str], artifact: Path, *flags: str) -> str:
    argv = ["generate", str(artifact), "--prompt", "hi", "--kv-cache-tokens", "2048", *flags]
    assert cli.main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_generate_logprobs_stop_token_and_ignore_eos(compiled: tuple[Path, dict, str], capsys: pytest.CaptureFixture[str]) -> None:
    text = _generate(capsys, compiled[0], "--max-tokens", "4", "--ignore-eos", "--logprobs", "1")
    assert "  4 tokens, " in text and "finish length" in text
    pairs = [pair.split(":") for pair in re.search(r"^  logprobs (.*)$", text, re.MULTILINE).group(1).split()]
    ids, logprobs = [int(t) for t, _ in pairs], [float(lp) for _, lp in pairs]
    assert len(ids) == 4 and all(lp <= 0 for lp in logprobs)
    stopped = _generate(capsys, compiled[0], "--max-tokens", "4", "--ignore-eos", "--stop-token-id", str(ids[1]))
    assert f"  {ids.index(ids[1]) + 1} tokens, " in stopped and "finish stop" in stopped
    assert "logprobs" not in stopped


def test_generate_with_the_fp8_kv_cache(compiled: tuple[Path, dict, str], capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    load, loaded = graphkiln.load, []
    monkeypatch.setattr(graphkiln, "load", lambda *args, **kwargs: loaded.append(load(*args, **kwargs)) or loaded[-1])
    assert "finish" in _generate(capsys, compiled[0], "--max-tokens", "2", "--kv-cache-dtype", "fp8_e4m3")
    assert [llm.stats().config.kv_cache_dtype for llm in loaded] == ["fp8_e4m3"]  # the engine that answered
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", str(compiled[0]), "--prompt", "hi", "--kv-cache-dtype", "fp8"])
    assert info.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp8'" in single_error_line(capsys.readouterr().err)


def test_generate_model_flag_names_where_the_weights_are(
    compiled: tuple[Path, dict, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = Path(shutil.copytree(tiny_model_dir(), tmp_path / "moved"))
    assert "finish" in _generate(capsys, compiled[0], "--max-tokens", "2", "--model", str(moved))
    assert cli.main(["generate", str(compiled[0]), "--prompt", "hi", "--model", str(tmp_path / "gone")]) == 2
    assert str(tmp_path / "gone") in single_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seed", "2**63"], "argument --seed: invalid int value: '2**63'"),
        (["--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
        (["--seed", "-1"], "SamplingParams.seed=-1"),
        (["--seed", str(2**63)], f"SamplingParams.seed={2**63}"),
        (["--logprobs", "all"], "argument --logprobs: invalid int value: 'all'"),
        (["--stop-token-id", "eos"], "argument --stop-token-id: invalid int value: 'eos'"),
        (["--top-p", "0"], "SamplingParams.top_p=0.0"),
        (["--max-tokens", "0"], "SamplingParams.max_tokens=0"),
    ],
    ids=["seed-expression", "seed-word", "seed-negative", "seed-2**63", "logprobs", "stop-token-id", "top-p", "max-tokens"],
)
def test_generate_bad_values_are_one_line_exit_2(flags: list[str], message: str, tmp_path: Path, capsys) -> None:
    """Usage errors and SamplingParams errors alike: one line, exit 2, before any artifact is read."""
    try:
        code = cli.main(["generate", str(tmp_path / "missing"), "--prompt", "hi", *flags])
    except SystemExit as e:  # argparse
        code = e.code
    assert code == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith("error: ") and message in line, line


def test_generate_with_a_decode_kernel(compiled: tuple[Path, dict, str], capsys: pytest.CaptureFixture[str]) -> None:
    """--decode-kernel reaches the engine: rows serves any backend; blocks on the CPU's SDPA is one line, exit 2."""
    assert "finish" in _generate(capsys, compiled[0], "--max-tokens", "2", "--decode-kernel", "rows")
    assert cli.main(["generate", str(compiled[0]), "--prompt", "hi", "--decode-kernel", "blocks"]) == 2
    assert "decode_kernel='blocks' is a Triton kernel, but the attention backend is 'sdpa'" in single_error_line(
        capsys.readouterr().err)
