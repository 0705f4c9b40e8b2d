"""`python -m bench COMMAND ...`: one subcommand per module; heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

COMMANDS = {  # command -> (module, one line of help)
    "run": ("run", "graphkiln vs transformers vs the bandwidth floor (the main run)"),
    "report": ("report", "markdown, short table, plot or HISTORY.md rows from a run's JSON"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_startup"]:  # a start-up child of `run`: nothing imported before it starts timing
        from .startup import child_main

        child_main(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="graphkiln's benchmark harness (bench/README.md)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.set_defaults(module=module)
        if argv[:1] == [name]:  # import only the command asked for
            importlib.import_module(f"bench.{module}").add_arguments(p)
    a = parser.parse_args(argv)
    return importlib.import_module(f"bench.{a.module}").main(a) or 0


if __name__ == "__main__":
    sys.exit(main())
