"""Python's thread switch interval while a load reads its weights beside Python work, and while a background
preparation runs Python beside the steps.

A thread that wants the interpreter lock while another thread runs Python waits for the switch
interval (5 ms by default) before the running thread is asked to let go. A load reads its weights
on threads that take the lock back after each read and copy call, while its own thread imports
Inductor and loads the compiled pieces (seconds of pure Python): every take can cost the whole
interval. `lowered_switch_interval` shortens the interval for the length of that overlap; the
Python beside it pays a switch (microseconds) only when a reading thread is waiting. The same holds for
an engine's steps beside its background preparation (Inductor's import, the kernels' dry steps), whose
part off the step lock runs under the same interval (preparation.py). The interval
is process-wide: on the way out the one found on the way in is restored, unless something else
set another meanwhile (that one is kept), and an interval already shorter is left as it is.

`GRAPHKILN_LOAD_SWITCH_INTERVAL` sets the interval a load (and that preparation) uses, in seconds, or `off`
to leave the interpreter's own. `GRAPHKILN_SERVE_SWITCH_INTERVAL` sets the one a server runs under (by default
the interpreter's own): its engine thread, back from waiting on a step, wants the lock while the event loop
runs Python (HTTP, the streamed events), and the other way round.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from graphkiln.errors import ConfigError

LOAD_SWITCH_INTERVAL_ENV = "GRAPHKILN_LOAD_SWITCH_INTERVAL"
LOAD_SWITCH_INTERVAL_S = 1e-4
SERVE_SWITCH_INTERVAL_ENV = "GRAPHKILN_SERVE_SWITCH_INTERVAL"


def load_switch_interval() -> float | None:
    """The interval a load reads its weights under (None: the interpreter's own)."""
    return switch_interval_setting(LOAD_SWITCH_INTERVAL_ENV, LOAD_SWITCH_INTERVAL_S)


def serve_switch_interval() -> float | None:
    """The interval a server runs under (None: the interpreter's own)."""
    return switch_interval_setting(SERVE_SWITCH_INTERVAL_ENV, None)


def switch_interval_setting(variable: str, default: float | None) -> float | None:
    """The interval environment variable `variable` gives (seconds, or None for `off`), `default` if unset."""
    value = os.environ.get(variable, "").strip()
    return parse_switch_interval(variable, value) if value else default


def parse_switch_interval(variable: str, value: str) -> float | None:
    """`value` of setting `variable` as seconds, or None for `off`; anything else a ConfigError naming both."""
    value = value.strip()
    if value.lower() == "off":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1:
        raise ConfigError(
            f"{variable}={value!r}: give seconds between 0 and 1 (such as 0.0001), or 'off'"
        )
    return seconds


@contextlib.contextmanager
def lowered_switch_interval(seconds: float | None) -> Iterator[None]:
    """The interpreter's switch interval at most `seconds` inside (None: as it is), restored after."""
    before = sys.getswitchinterval()
    if seconds is None or seconds >= before:
        yield
        return
    sys.setswitchinterval(seconds)
    ours = sys.getswitchinterval()
    try:
        yield
    finally:
        if sys.getswitchinterval() == ours:
            sys.setswitchinterval(before)
