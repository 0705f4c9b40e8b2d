"""Can the ranks of a tensor-parallel group share compiled code? Compile rank 0 and rank 1 each on their own.

Each rank's shard of a model (default: the built-in tiny model) is traced and compiled as
compile-model does (torch's fake process group, a private Inductor cache per rank), and the saved
artifacts are compared file by file: identical bytes, or else the printable lines that differ.
"""

from __future__ import annotations

import difflib
import json
import re
import tempfile
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="model directory or 'tiny' (default)")
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here too")


def _compile_rank(model_dir: Path, rank: int, size: int, folder: Path) -> None:
    from graphkiln.compat import private_inductor_cache
    from graphkiln.compiler.artifacts import save_compiled
    from graphkiln.compiler.compile import compile_module
    from graphkiln.compiler.config import CompileConfig
    from graphkiln.models import load_model
    from graphkiln.models.sharding import Shard

    with private_inductor_cache(folder / "cache"):
        net = load_model(model_dir, shard=Shard(rank, size))
        compiled, _ = compile_module(net, CompileConfig(tensor_parallel_size=size))
    (folder / "artifact").mkdir()
    save_compiled(compiled, folder / "artifact")


def _text_lines(data: bytes) -> list[str]:
    return [m.decode() for m in re.findall(rb"[ -~]{12,}", data)]


def main(a) -> int:
    from graphkiln.compat import fake_process_group
    from graphkiln.llm import resolve_model_dir

    model_dir = resolve_model_dir(a.model)
    with tempfile.TemporaryDirectory() as tmp, fake_process_group(a.ranks):
        folders = [Path(tmp) / f"rank{r}" for r in (0, 1)]
        for rank, folder in enumerate(folders):
            _compile_rank(model_dir, rank, a.ranks, folder)
        first_artifact = folders[0] / "artifact"
        files = sorted(str(p.relative_to(first_artifact)) for p in first_artifact.rglob("*") if p.is_file())
        rows = []
        for rel in files:
            first, second = ((f / "artifact" / rel).read_bytes() for f in folders)
            diff = [line for line in difflib.unified_diff(_text_lines(first), _text_lines(second), lineterm="", n=0)
                    if line[:1] in "+-" and not line.startswith(("+++", "---"))]  # fmt: skip
            rows.append({"file": rel, "identical": first == second, "differing_lines": diff})
            state = "identical" if first == second else f"differs in {len(diff)} lines: " + " | ".join(diff)
            print(f"{rel}: {state}")
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "ranks": a.ranks, "files": rows}, indent=1))
    return 0
