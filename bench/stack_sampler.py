"""A sampling profiler of every thread's Python stack, for the start-up study (`bench startup --profile`).

cProfile sees one thread and slows what it sees; a start-up is several threads (the weights reader,
the background captures, the caller) whose time goes mostly to C calls (module loads, CUDA, file
reads) made from Python. So a daemon thread looks at `sys._current_frames()` every few milliseconds
and counts, per phase and thread, each function on the stack (inclusive) and on top (self): a C
call's time shows as the Python function that made it.
"""

from __future__ import annotations

import collections
import sys
import threading
from types import FrameType

TOP = 40


def short_path(path: str) -> str:
    """A source path named from site-packages or from the repository (graphkiln/, bench/), not by this machine's
    folders; others (the standard library) as they are."""
    for marker in ("site-packages/", "graphkiln/", "bench/"):
        if marker in path:
            rest = path.split(marker, 1)[1]
            return rest if marker == "site-packages/" else marker + rest
    return path


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{short_path(code.co_filename)}:{code.co_firstlineno} {code.co_name}"


class StackSampler:
    """Counts samples per (phase, thread): `phase(name)` switches the label, `stop()` returns the counts."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.label = "start"
        self.samples: dict[tuple[str, str], int] = collections.Counter()
        self.inclusive: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
        self.own: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    def phase(self, label: str) -> None:
        self.label = label

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                key = (self.label, names.get(ident, str(ident)))
                self.samples[key] += 1
                self.own[key][_where(frame)] += 1
                seen = set()
                while frame is not None:
                    where = _where(frame)
                    if where not in seen:
                        seen.add(where)
                        self.inclusive[key][where] += 1
                    frame = frame.f_back

    def stop(self) -> dict:
        """{phase: {thread: {"samples", "ms_per_sample", "inclusive": [[function, samples]...], "self": [...]}}}."""
        self._stop.set()
        self._thread.join()
        out: dict[str, dict] = {}
        for (label, thread), n in self.samples.items():
            out.setdefault(label, {})[thread] = {
                "samples": n, "ms_per_sample": self.interval_s * 1e3,
                "inclusive": self.inclusive[(label, thread)].most_common(TOP),
                "self": self.own[(label, thread)].most_common(TOP // 2),
            }
        return out

