"""Write and read the compiled part of an artifact directory: the split graph and the Inductor pieces.

Layout under the directory:
  graph.json                the stitching graph with its attention submodules' graphs (graph_file.py)
  pieces/<key>/<variant>.bin  Inductor standalone artifacts; variant is "dynamic" or a token count
  cpu-kernels/                (CPU only) the compiled C++ kernels, laid out as in Inductor's cache
  quantized-weights.safetensors  the decoder's projections quantized at compile time (--quantization);
                              with tensor parallel, rank 0's, and quantized-weights-rank<r>.safetensors rank r's
  tokenizer.json              the tokenizer pipeline transformers builds, when it alone reproduces
                              transformers (models/tokenizer.py)

Reading assumes the caller already checked every file's sha256 against the manifest: the pieces
hold compiled code, so artifacts are exactly as trusted as the process that wrote them. The pieces
load through an Inductor cache folder of their own, keyed by the digest of those checked files
(`code_digest`), so no artifact's code runs for another's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch

from graphkiln.compat import artifact_cache, install_cpu_kernels, load_artifact, private_inductor_cache
from graphkiln.errors import ArtifactError

from .capture import Binding
from .compiled_model import CompiledModel
from .graph_file import GRAPH_FILE, read_graph, write_graph
from .inductor import CompiledPiece
from .manifest import FIX
from .split import SplitGraph

PIECES_DIR = "pieces"
CPU_KERNELS = "cpu-kernels"
TOKENIZER_FILE = "tokenizer.json"
QUANTIZED_FILE = "quantized-weights.safetensors"


def quantized_file(rank: int) -> str:
    """The file of a tensor-parallel rank's quantized projections (rank 0's is QUANTIZED_FILE)."""
    return QUANTIZED_FILE if rank == 0 else f"quantized-weights-rank{rank}.safetensors"


def save_compiled(compiled: CompiledModel, out: Path) -> dict:
    """Write graph and pieces under `out`; return the manifest section that describes them. The graph keeps the
    attention submodules' graphs, not the pieces': their compiled code takes their place at load."""
    split = compiled.split
    write_graph(out / GRAPH_FILE, split.gm, [name for name, attn in split.submodules if attn], split.pieces)
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


def load_compiled(section: dict, files: dict[str, str], out: Path, tensors: dict[str, torch.Tensor]) -> CompiledModel:
    """Rebuild a CompiledModel from checked files (`files`: their sha256s), with no Dynamo or FX trace and no
    Inductor compile."""
    gm = read_graph(out / GRAPH_FILE)
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
