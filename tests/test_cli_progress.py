"""`compile-model`'s progress on stderr: a line per stage start and end off a terminal, tqdm bars on one, a
compile waiting for another's lock naming it, and the summary's times in stage order."""

from __future__ import annotations

import io
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from artifact_helpers import SMALL_CONFIG_ARGS, SUBPROCESS_TIMEOUT_S, compile_cmd, subprocess_env, temp_folders
from graphkiln import report

pytestmark = pytest.mark.slow


SECONDS = r"done in \d+\.\d\d s"
# (start line, end line) of every compile stage, in order, as printed off a terminal
STAGES = [
    *((f"{stage} ...", rf"{stage}: {SECONDS}") for stage in ("load weights", "trace", "passes", "split")),
    ("inductor 0/3 ...", rf"inductor: 3/3 {SECONDS}"),
    ("save ...", rf"save: {SECONDS}"),
]


@dataclass
class Finished:
    pid: int
    returncode: int
    stdout: str
    stderr: str


def _start(args: list[str]) -> subprocess.Popen:
    """A subprocess whose output is read as bytes: text mode would turn a "\r" into a line break."""
    return subprocess.Popen(args, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen) -> Finished:
    try:
        out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        proc.kill()
    return Finished(proc.pid, proc.returncode, out.decode(), err.decode())


@pytest.fixture(scope="module")
def two_compiles(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Finished, Finished]:
    """(OUT, first, second): two `compile-model tiny -o OUT` with stderr a pipe, as in a log or CI (the
    first also dumps, into OUT's sibling `dump`); the second starts once the first holds OUT's lock
    (its temp folder exists), so it waits, then finds OUT."""
    out = (tmp_path_factory.mktemp("two") / "tiny").resolve()
    first = _start(compile_cmd("tiny", "-o", out, "--dump-dir", out.parent / "dump", *SMALL_CONFIG_ARGS))
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while not temp_folders(out):
            assert first.poll() is None and time.monotonic() < deadline, "the first compile took no lock"
            time.sleep(0.02)
        second = _start(compile_cmd("tiny", "-o", out, *SMALL_CONFIG_ARGS))
    finally:
        done = _finish(first)
    return out, done, _finish(second)


def test_progress_off_a_terminal_is_one_line_per_stage_start_and_end(two_compiles) -> None:
    _, first, _ = two_compiles
    assert first.returncode == 0, first.stderr[-4000:]
    assert "\r" not in first.stderr
    lines = first.stderr.splitlines()
    assert len(lines) == 2 * len(STAGES), first.stderr
    for (start, end), (start_line, end_line) in zip(STAGES, zip(lines[::2], lines[1::2])):
        assert start_line == start and re.fullmatch(end, end_line), lines


def test_a_dump_keeps_depyf_off_the_terminal(two_compiles) -> None:
    out, first, _ = two_compiles
    assert "depyf" not in first.stderr and "You are trying to debug" not in first.stderr
    assert "You are trying to debug" in (out.parent / "dump" / "00-dynamo" / "depyf.log").read_text()


def test_a_compile_waiting_for_the_lock_says_for_whom(two_compiles) -> None:
    out, first, second = two_compiles
    waiting = f"waiting for another compile of {out} (pid {first.pid}) to finish"
    start, end, error = second.stderr.splitlines()
    assert start == f"{waiting} ..." and re.fullmatch(rf"{re.escape(waiting)}: {SECONDS}", end), second.stderr
    assert second.returncode == 2 and error == f"error: {out}: already exists; pass --force (force=True) to replace it"


def test_summary_times_follow_the_stages_and_end_with_wall_time(two_compiles) -> None:
    rows = [line.split("  ")[0] for line in two_compiles[1].stdout.splitlines() if line.startswith(("time ", "wall "))]
    assert rows == ["time load", "time trace", "time passes", "time split", "time inductor", "time save", "wall time"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_draws_tqdm_bars() -> None:
    stream = _Terminal()
    progress = report.ProgressDisplay(stream=stream)
    for stage, total in (("load weights", 1), ("inductor", 3)):
        for done in range(total + 1):
            progress(stage, done, total)
    progress("save", 0, 1)
    progress.close()
    text = stream.getvalue()
    assert re.search(r"\rload weights +100%\|[█#]+\| 1/1 \[00:00\]", text), text
    assert "| 0/3 [" in text and re.search(r"\rinductor +100%\|[█#]+\| 3/3", text), text  # tqdm skips updates within 0.1 s
    assert re.search(r"\rsave +0%\|", text) and "100%" not in text.split("save")[-1], text
    assert text.count("\n") == 3  # each stage's bar keeps its line
