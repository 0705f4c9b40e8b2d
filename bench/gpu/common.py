"""Paths, the run's clock and log, error text, the watchdog's exception, and importing graphkiln."""

from __future__ import annotations

import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO = BENCH_DIR.parent
ENTRY = BENCH_DIR / "gpu_bench.py"  # the children run it as `--child SPEC`

T0 = time.time()  # the run's start: the log, --budget-s and --hard-limit-s count from here


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


class OutOfTime(BaseException):
    """Raised by the SIGALRM watchdog at --hard-limit-s inside whatever runs; like KeyboardInterrupt, the
    rows' `except Exception` handlers let it through, so the run stops and still writes its tables."""


def ensure_graphkiln() -> str:
    """Import graphkiln; when it is not installed, from this repository's folders, mapped as pyproject maps
    them (graphkiln/ plus models/, compiler/, passes/, runtime/ as its subpackages). Returns how."""
    try:
        import graphkiln  # noqa: F401

        return "installed"
    except ImportError:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "graphkiln", REPO / "graphkiln" / "__init__.py", submodule_search_locations=[str(REPO / "graphkiln"), str(REPO)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["graphkiln"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop("graphkiln", None)
            raise
        return "from the repository (not installed)"
