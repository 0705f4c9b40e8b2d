"""Turn a bench/gpu_bench.py result JSON into markdown, a short text table, ratios and a plot.

    python bench/report.py bench/results/2026-11-29-nvidia-h200.json   # markdown on stdout
    python bench/report.py --latest bench/results                     # the newest JSON there
    python bench/report.py --latest bench/results --write --plot      # also write .md and .png beside it

The code is in bench/gpu/ (results.py, markdown.py, summary.py), which gpu_bench.py uses after every row;
it imports nothing heavy (matplotlib only for the plot, optional).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/gpu/, however this file is run

from gpu.markdown import to_markdown  # noqa: E402
from gpu.results import add_ratios  # noqa: E402
from gpu.summary import plot, short_table  # noqa: E402


def latest(folder: str | Path) -> Path:
    found = sorted(Path(folder).glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        raise FileNotFoundError(f"no result JSON in {folder}")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Markdown from a gpu_bench.py result JSON")
    p.add_argument("json", nargs="?", help="result JSON (or use --latest)")
    p.add_argument("--latest", metavar="DIR", help="use the newest JSON in DIR (e.g. bench/results)")
    p.add_argument("--write", action="store_true", help="write the .md beside the JSON")
    p.add_argument("--plot", action="store_true", help="write the .png beside the JSON (needs matplotlib)")
    p.add_argument("--short", action="store_true", help="print the short text table instead")
    a = p.parse_args(argv)
    if not a.json and not a.latest:
        p.error("give a JSON path or --latest DIR")
    path = Path(a.json) if a.json else latest(a.latest)
    results = json.loads(path.read_text())
    add_ratios(results)
    md = to_markdown(results)
    if a.write:
        path.with_suffix(".md").write_text(md)
    if a.plot and not plot(results, path.with_suffix(".png")):
        print("plot skipped: matplotlib is not installed", file=sys.stderr)
    print(short_table(results) if a.short else md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
