"""The switch interval a load reads its weights under: lowered for the overlap with the Inductor import and
restored after, an interval set meanwhile kept, a shorter one left alone, and the environment variable checked;
the same interval for a background preparation's work beside the steps."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import graphkiln
from artifact_helpers import ENGINE
from graphkiln.errors import ConfigError
from graphkiln.models.switch_interval import (
    LOAD_SWITCH_INTERVAL_ENV,
    LOAD_SWITCH_INTERVAL_S,
    SERVE_SWITCH_INTERVAL_ENV,
    load_switch_interval,
    lowered_switch_interval,
    serve_switch_interval,
)
from graphkiln.runtime.preparation import Preparation
from graphkiln.runtime.step_lock import StepLock


@pytest.fixture(autouse=True)
def interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(before)


def test_lowered_inside_and_restored_after() -> None:
    with lowered_switch_interval(1e-4):
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_restored_after_an_error() -> None:
    with pytest.raises(KeyError), lowered_switch_interval(1e-4):
        raise KeyError("x")
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_interval_set_meanwhile_is_kept() -> None:
    with lowered_switch_interval(1e-4):
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_shorter_interval_or_none_is_left_alone() -> None:
    sys.setswitchinterval(5e-5)
    with lowered_switch_interval(1e-4):
        assert sys.getswitchinterval() == pytest.approx(5e-5)
    with lowered_switch_interval(None):
        assert sys.getswitchinterval() == pytest.approx(5e-5)
    assert sys.getswitchinterval() == pytest.approx(5e-5)


def test_nested_uses_end_with_the_first_interval() -> None:
    with lowered_switch_interval(1e-3):
        with lowered_switch_interval(1e-4):
            assert sys.getswitchinterval() == pytest.approx(1e-4)
        assert sys.getswitchinterval() == pytest.approx(1e-3)
    assert sys.getswitchinterval() == pytest.approx(0.005)


SETTINGS = {"load": (LOAD_SWITCH_INTERVAL_ENV, load_switch_interval, LOAD_SWITCH_INTERVAL_S),
            "serve": (SERVE_SWITCH_INTERVAL_ENV, serve_switch_interval, None)}  # fmt: skip


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize(("value", "want"), [(None, "default"), ("off", None), ("OFF", None), ("0.0005", 0.0005),
                                             (" 1e-3 ", 0.001)])  # fmt: skip
def test_environment_variable(monkeypatch: pytest.MonkeyPatch, setting: str, value: str | None,
                              want: float | str | None) -> None:  # fmt: skip
    variable, read, default = SETTINGS[setting]
    if value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, value)
    assert read() == (default if want == "default" else want)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("value", ["fast", "0", "-1", "2", "nan"])
def test_a_bad_environment_variable_names_itself(monkeypatch: pytest.MonkeyPatch, setting: str, value: str) -> None:
    variable, read, _ = SETTINGS[setting]
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"{variable}={value!r}.*'off'"):
        read()


def _intervals_during_load(artifact: Path) -> list[float]:
    seen: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(sys.getswitchinterval())
            stop.wait(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with graphkiln.load(artifact, capture="blocking", **ENGINE):  # the weights read beside the Inductor import
            pass
    finally:
        stop.set()
        watcher.join()
    return seen


def test_load_reads_under_the_lowered_interval_and_restores_it(artifact: Path, monkeypatch) -> None:
    monkeypatch.delenv(LOAD_SWITCH_INTERVAL_ENV, raising=False)
    seen = _intervals_during_load(artifact)
    assert min(seen) == pytest.approx(LOAD_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    monkeypatch.setenv(LOAD_SWITCH_INTERVAL_ENV, "off")
    assert min(_intervals_during_load(artifact)) == pytest.approx(0.005)
    monkeypatch.setenv(LOAD_SWITCH_INTERVAL_ENV, "slow")
    with pytest.raises(ConfigError, match=LOAD_SWITCH_INTERVAL_ENV):
        graphkiln.load(artifact, **ENGINE)


def test_background_jobs_run_their_part_off_the_step_lock_under_the_lowered_interval() -> None:
    """A background preparation job's part beside the steps (Inductor's import, the kernels' dry steps: seconds
    of Python) runs under the lowered interval, its part under the step lock and what follows under the one
    found before."""
    seen: dict[str, float] = {}

    class Probe:
        kind, key = "probe", "interval"

        def unlocked(self) -> None:
            seen["beside the steps"] = sys.getswitchinterval()

        def run(self) -> None:
            seen["under the lock"] = sys.getswitchinterval()

        def withdraw(self) -> None:
            """Nothing to undo."""

    preparation = Preparation([Probe()], StepLock(), torch.device("cpu"), switch_interval=1e-4)
    preparation.start()
    assert preparation.wait(60) and not preparation.errors
    assert seen == {"beside the steps": pytest.approx(1e-4), "under the lock": pytest.approx(0.005)}
    assert sys.getswitchinterval() == pytest.approx(0.005)
