"""Write and read the compiled part of an artifact directory: the split graph and the Inductor pieces.

Layout under the directory:
  graph.pkl                 the stitching graph with its attention submodules (FX code, no weights)
  pieces/<key>/<variant>.bin  Inductor standalone artifacts; variant is "dynamic" or a token count
  cpu-kernels/                (CPU only) the compiled C++ kernels, laid out as in Inductor's cache
  quantized-weights.safetensors  the decoder's projections quantized at compile time (--quantization)
  tokenizer.json              the tokenizer pipeline transformers builds, when it alone reproduces
                              transformers (models/tokenizer.py)

Reading assumes the caller already checked every file's sha256 against the manifest: the graph
is unpickled and the pieces hold compiled code, so artifacts are exactly as trusted as the
process that wrote them. The pieces load through an Inductor cache folder of their own, keyed
by the digest of those checked files (`code_digest`), so no artifact's code runs for another's.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import asdict
from pathlib import Path

import torch

from graphkiln.compat import artifact_cache, install_cpu_kernels, load_artifact, private_inductor_cache
from graphkiln.errors import ArtifactError

from .capture import Binding
from .compiled_model import CompiledModel
from .inductor import CompiledPiece
from .manifest import FIX
from .split import SplitGraph

GRAPH_FILE = "graph.pkl"
PIECES_DIR = "pieces"
CPU_KERNELS = "cpu-kernels"
TOKENIZER_FILE = "tokenizer.json"
QUANTIZED_FILE = "quantized-weights.safetensors"


def stitching_graph(split: SplitGraph) -> torch.fx.GraphModule:
    """The split graph as the artifact keeps it: the attention submodules, and an empty module in place of each
    piece, whose compiled code takes its place at load. Unpickling a GraphModule traces its code again, so the
    pieces' own graphs would cost most of the graph's read and serve nothing there."""
    modules = {name: split.gm.get_submodule(name) if attn else torch.nn.Module() for name, attn in split.submodules}
    return torch.fx.GraphModule(modules, split.gm.graph)


def save_compiled(compiled: CompiledModel, out: Path) -> dict:
    """Write graph and pieces under `out`; return the manifest section that describes them."""
    (out / GRAPH_FILE).write_bytes(pickle.dumps(stitching_graph(compiled.split)))
    unique: dict[str, CompiledPiece] = {p.key: p for p in compiled.pieces.values()}
    for key, piece in unique.items():
        folder = out / PIECES_DIR / key
        folder.mkdir(parents=True)
        for variant, art in piece.artifacts.items():
            art.save(path=str(folder / f"{variant}.bin"), format="binary")
    return {
        "submodules": [[name, attn] for name, attn in compiled.split.submodules],
        "pieces": {name: piece.key for name, piece in compiled.pieces.items()},
        "unique_pieces": {
            key: {
                "sizes": sorted(piece.by_size),
                "size_arg": list(piece.size_arg) if piece.size_arg else None,
                "returns_tuple": piece.returns_tuple,
            }
            for key, piece in unique.items()
        },
        "bindings": [asdict(b) for b in compiled.bindings],
    }


def code_digest(files: dict[str, str]) -> str:
    """A digest of the compiled code's files (pieces, CPU kernels) from the manifest's checked sha256s."""
    code = sorted((rel, sha) for rel, sha in files.items() if rel.startswith((f"{PIECES_DIR}/", f"{CPU_KERNELS}/")))
    return hashlib.sha256(json.dumps(code).encode()).hexdigest()[:32]


def _load_piece(path: Path):
    """One Inductor standalone artifact; its sha256 matched, so a failure means torch cannot read what it wrote."""
    try:
        return load_artifact(path)
    except Exception as e:
        raise ArtifactError(f"{path}: Inductor cannot load this piece ({type(e).__name__}: {e}); {FIX}") from e


def load_graph(out: Path) -> torch.fx.GraphModule:
    """The stitching graph, from its checked file. Unpickling a GraphModule traces its code with torch.fx, which
    patches torch.nn.Module's call for every thread meanwhile: it must not run beside a model's forward."""
    try:  # the file's sha256 matched: what fails here was written by other graphkiln code
        return pickle.loads((out / GRAPH_FILE).read_bytes())
    except Exception as e:
        raise ArtifactError(f"{out / GRAPH_FILE}: this graphkiln cannot rebuild it ({type(e).__name__}: {e}); {FIX}") from e


def load_compiled(section: dict, files: dict[str, str], out: Path, tensors: dict[str, torch.Tensor],
                  gm: torch.fx.GraphModule | None = None) -> CompiledModel:  # fmt: skip
    """Rebuild a CompiledModel from checked files (`files`: their sha256s; `gm`: the stitching graph, if
    already read), with no Dynamo trace and no Inductor compile."""
    gm = load_graph(out) if gm is None else gm
    unique = {}
    cache = artifact_cache(code_digest(files))
    with private_inductor_cache(cache):
        if (out / CPU_KERNELS).is_dir():
            install_cpu_kernels(out / CPU_KERNELS, cache)
        for key, info in section["unique_pieces"].items():
            folder = out / PIECES_DIR / key
            dynamic = _load_piece(folder / "dynamic.bin")
            by_size = {size: _load_piece(folder / f"{size}.bin") for size in info["sizes"]}
            size_arg = tuple(info["size_arg"]) if info["size_arg"] else None
            unique[key] = CompiledPiece(key, dynamic, by_size, size_arg, info["returns_tuple"])
    pieces = {name: unique[key] for name, key in section["pieces"].items()}
    split = SplitGraph(gm, [(name, attn) for name, attn in section["submodules"]])
    bindings = [Binding(**b) for b in section["bindings"]]
    return CompiledModel(split, bindings, pieces, tensors)
