"""Pass-debugging dumps: a folder a person reads to see what the compiler did, listed in index.md.

Files are numbered in pipeline order: `00-dynamo/` (depyf's decompiled Dynamo bytecode and the
captured graph, and `depyf.log`: what depyf printed and warned, kept off the terminal), then
`NN-<pass>.before.py` / `.after.py` for every enabled pass (NN is the pass's place in the
pipeline; a post-grad pass runs inside Inductor once per compiled piece and size, so its files
are `NN-<pass>.before.<piece>.<size>.py`), the split's summary and each submodule's code,
Inductor's output code for every compiled piece and size, and `passes.md`, the pass table.
`index.md` lists every file in the order it was written, one line each, as a relative link a
Markdown viewer follows.

A dump folder is emptied for the next dump only if graphkiln wrote it: `.graphkiln-dump`, written
last, records every file of the dump, and a folder holding anything else is left alone. A symbolic link
stands for the folder it points at: that folder is checked, emptied and written, and the link kept.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from urllib.parse import quote

import torch

from graphkiln.errors import ConfigError
from graphkiln.listed import first_unlisted

from .attention_split import summary

DYNAMO_DIR = "00-dynamo"
DEPYF_LOG = "depyf.log"
INDEX = "index.md"
MARKER = ".graphkiln-dump"
MARKER_FORMAT = "graphkiln-dump/1"
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)
_EXTERN_CALL = re.compile(r"\bextern_kernels\.\w+\(")
_DEPYF = (
    ("full_code_for_", "depyf: Dynamo's bytecode for the whole forward, decompiled, with its guards"),
    ("__transformed_code_", "depyf: the bytecode Dynamo wrote in place of forward, decompiled"),
    ("pre_insert_deferred_runtime_asserts", "depyf: the captured FX graph before Dynamo added its runtime asserts"),
    ("__compiled_fn_", "depyf: the FX graph Dynamo captured and handed to the compiler, before any pass"),
)


def kernel_counts(code: str) -> dict[str, int]:
    """Generated kernels (C++ or Triton) defined in Inductor output code, and kernel launches:
    calls of those kernels plus extern (GEMM) calls."""
    names = _KERNEL_DEF.findall(code)
    body = code[code.find("def call(") :]
    launches = sum(len(re.findall(rf"\b{name}(\.run)?\(", body)) for name in names)
    externs = len(_EXTERN_CALL.findall(body))
    return {"kernels": len(names), "launches": launches + externs, "extern_calls": externs}


def check_dump_dir(root: Path) -> None:
    """A dump folder must be new, empty, or written by an earlier dump and nothing else."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"CompileConfig.dump_dir={str(root)!r} is a file; pick a new or empty folder")
    foreign = _foreign_content(root) if root.exists() and any(root.iterdir()) else None
    if foreign:
        raise ConfigError(
            f"CompileConfig.dump_dir={str(root)!r} is not empty and {foreign}; graphkiln empties only its "
            "own dumps, so pick a new or empty folder"
        )


def _foreign_content(root: Path) -> str | None:
    """None when every file in `root` was written by an earlier dump (its marker lists it); else why not."""
    try:
        marker = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        marker = None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT or not isinstance(marker.get("files"), list):
        return f"holds no {MARKER} marker of an earlier dump"
    unlisted = first_unlisted(root, [*(str(name) for name in marker["files"]), MARKER])
    return None if unlisted is None else f"holds {unlisted}, which no earlier dump wrote"


def _readable(graph: torch.fx.GraphModule | torch.fx.Graph) -> str:
    if isinstance(graph, torch.fx.Graph):
        owner = graph.owning_module
        return owner.print_readable(print_output=False) if owner is not None else graph.python_code("self").src
    return graph.print_readable(print_output=False)


class Dump:
    """Writes the files of one dump folder and keeps their one-line descriptions for index.md."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()  # a link to an earlier dump: that dump is checked, emptied and written
        self.entries: list[tuple[str, str]] = []
        self.compiling_piece: tuple[str, str] | None = None  # (piece, variant) while Inductor compiles it

    def __enter__(self) -> Dump:
        """Empty the folder (only if an earlier dump wrote all of it) and start listing files."""
        check_dump_dir(self.root)
        if self.root.exists() and any(self.root.iterdir()):
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.entries.clear()
        return self

    def __exit__(self, *exc) -> None:
        lines = ["# graphkiln compile dump", "", "Every file, in the order the compiler wrote it.", ""]
        lines += [f"- [`{name}`]({quote(name)}): {what}" for name, what in self.entries]
        (self.root / INDEX).write_text("\n".join(lines) + "\n")
        files = sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if not p.is_dir())
        (self.root / MARKER).write_text(json.dumps({"format": MARKER_FORMAT, "files": files}, indent=1) + "\n")

    def write(self, name: str, text: str, what: str) -> None:
        """Write `name` (a repeated name gets a run number) and list it with its one-line `what`."""
        path = self.root / name
        stem, suffix = name.rsplit(".", 1)
        run = 1
        while path.exists():
            run += 1
            path = self.root / f"{stem}.{run}.{suffix}"
        path.write_text(text)
        self.entries.append((path.name, what))

    @property
    def dynamo_dir(self) -> Path:
        return self.root / DYNAMO_DIR

    @property
    def depyf_log(self) -> Path:
        return self.dynamo_dir / DEPYF_LOG

    def add_dynamo(self) -> None:
        """List what depyf wrote into `00-dynamo/`, its log last."""

        def kind(path: Path) -> int:
            return next((i for i, (key, _) in enumerate(_DEPYF) if key in path.name), len(_DEPYF))

        for path in sorted(self.dynamo_dir.glob("*.py"), key=lambda p: (kind(p), p.name)):
            what = _DEPYF[kind(path)][1] if kind(path) < len(_DEPYF) else "depyf: a file Dynamo wrote"
            self.entries.append((f"{DYNAMO_DIR}/{path.name}", what))
        self.entries.append((f"{DYNAMO_DIR}/{DEPYF_LOG}", "depyf's warnings and messages while Dynamo traced"))

    @contextlib.contextmanager
    def compiling(self, piece: str, variant: str) -> Iterator[None]:
        """Inside, post-grad graphs are dumped as those of `piece` ('dynamic' or a token count `variant`)."""
        self.compiling_piece = (piece, variant)
        try:
            yield
        finally:
            self.compiling_piece = None

    def graph(self, number: int, name: str, when: str, graph: torch.fx.GraphModule | torch.fx.Graph) -> None:
        """The pass manager's dump hook: the graph before or after pass `name`, as readable Python.
        Post-grad graphs (an fx.Graph) come only inside `compiling`, which names their piece and size."""
        stage, suffix = "Dynamo FX graph", ""
        if not isinstance(graph, torch.fx.GraphModule):
            piece, variant = self.compiling_piece
            stage, suffix = f"Inductor post-grad graph of {piece} ({variant})", f".{piece}.{variant}"
        self.write(f"{number:02d}-{name}.{when}{suffix}.py", _readable(graph), f"{stage} {when} pass {name}")

    def split(self, number: int, split: torch.fx.GraphModule, attention: dict[str, bool], keys: dict[str, str]) -> None:
        """The split's summary (ops per submodule, tensors crossing each cut) and every submodule's code."""
        self.write(f"{number:02d}-split.summary.md", summary(split, attention, keys),
                   "the split: ops per submodule and the tensors (symbolic shapes) crossing each cut")
        for name, attn in attention.items():
            self.write(f"{number:02d}-split.{name}.py", split.get_submodule(name).print_readable(print_output=False),
                       f"{name}: {'attention (runs eagerly)' if attn else 'piece compiled by Inductor'}")

    def inductor(self, number: int, codes: Iterable[tuple[str, str, str]], keys: Mapping[str, str]) -> None:
        """Inductor's output code of each (piece key, variant: 'dynamic' or a token count, code) compiled."""
        for key, variant, code in codes:
            pieces = [name for name, k in keys.items() if k == key]
            counts = kernel_counts(code)
            self.write(f"{number:02d}-inductor.{pieces[0]}.{variant}.py", code,
                       f"Inductor output code for {', '.join(pieces)} ({variant}): {counts['kernels']} generated "
                       f"kernels, {counts['launches']} launches ({counts['extern_calls']} extern)")
