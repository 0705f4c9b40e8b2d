"""manifest.json: what an artifact directory holds and the setup it is valid for.

`environment()` describes this process (versions, device); `check_environment` and
`check_files` compare a manifest against it and against the files on disk. Each mismatch raises
an ArtifactError that says what differs and how to fix it. torch is imported only inside the
functions that describe this process, so reading a manifest (`graphkiln inspect`) imports
neither torch nor transformers.

The manifest lists every other file's sha256, and `fields_sha256` holds a short sha256 of each
of its own fields, so a hand edit (a dtype, a layer count) is refused naming the field instead of
failing later inside a kernel. `model.source` (where the weights are, checked by their
fingerprint), the informational timings and counters, and the file list (checked against the
files themselves) are left out. This guards against mistakes, not attackers: signing
(`signing.py`) does that.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Sequence
from pathlib import Path

from graphkiln.errors import ArtifactError
from graphkiln.listed import first_unlisted
from graphkiln.version import __version__

FORMAT_VERSION = 4  # 4: the graph as JSON (graph.json); 3: serving defaults in "engine", fields_sha256 seals
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"  # an Ed25519 signature over manifest.json's bytes (signing.py)
SIGNATURE_BYTES = 64
FIX = "recompile with `compile-model ... --force`, or load with on_mismatch='recompile'"
REWRITE = "recompile with `compile-model ... --force`"
NEW = "compile one into a new folder with `compile-model MODEL -o OUT`"  # for a folder --force would refuse
SECTIONS = {
    "environment": dict,
    "model": dict,
    "config": dict,
    "engine": dict,
    "passes": list,
    "compiled": dict,
    "files": dict,
    "fields_sha256": dict,
}
UNSEALED = ("fields_sha256", "files", "timings", "counters", "model.source")
SEALED_DEPTH = 3  # model.config.num_layers is a field of its own; deeper values are hashed whole


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def device_identity(device: str) -> dict:
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}"}
    return {"type": "cpu", "name": platform.machine(), "capability": torch.backends.cpu.get_cpu_capability()}


def environment(device: str) -> dict:
    import torch

    return {
        "graphkiln": __version__,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "device": device_identity(device),
    }


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _fields(value, name: str = ""):
    """(dotted name, value) of every sealed field, down to SEALED_DEPTH names."""
    if isinstance(value, dict) and value and name.count(".") < SEALED_DEPTH - 1:
        for key, item in value.items():
            child = f"{name}.{key}" if name else key
            if child not in UNSEALED:
                yield from _fields(item, child)
    else:
        yield name, value


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def seal(manifest: dict) -> dict:
    """The fields_sha256 section for `manifest`: a short sha256 of each field, as JSON writes it."""
    return {name: _digest(value) for name, value in _fields(json.loads(json.dumps(manifest)))}


def check_seal(manifest: dict, path: Path) -> None:
    """Every field must be as compile-model wrote it: an edited manifest describes code that was never compiled."""
    recorded, now = manifest["fields_sha256"], seal(manifest)
    values = dict(_fields(manifest))
    for name in sorted(recorded.keys() | now.keys()):
        if name not in now:
            change = "was removed"
        elif name not in recorded:
            change = f"was added ({_short(values[name])})"
        elif recorded[name] != now[name]:
            change = f"was changed (now {_short(values[name])})"
        else:
            continue
        raise ArtifactError(f"{path}: field {name} {change} after compile-model wrote it; {REWRITE}")


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_manifest(root: Path, trusted_keys: Sequence = ()) -> dict:
    """Parse and check manifest.json; with `trusted_keys` (signing.load_public_keys) its signature first."""
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact directory; create it with `compile-model MODEL -o {root}`")
    if not path.is_file():
        raise ArtifactError(_not_an_artifact(root))
    data = path.read_bytes()
    if trusted_keys:
        from .signing import verify

        verify(root, data, trusted_keys)
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e}), so {root} is not a graphkiln artifact; {NEW}") from e
    if lacks := _lacks(manifest):
        raise ArtifactError(f"{path}: not a graphkiln manifest ({lacks}), so {root} is not a graphkiln artifact; {NEW}")
    version = manifest["format_version"]
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format_version {version!r}, this graphkiln reads {FORMAT_VERSION}; {REWRITE}")
    for section, kind in SECTIONS.items():
        if not isinstance(manifest.get(section), kind):
            raise ArtifactError(f"{path}: section {section!r} is missing or not a {kind.__name__}; {REWRITE}")
    check_seal(manifest, path)
    return manifest


def recorded_source(manifest: dict, root: Path) -> str:
    """model.source: where the weights were at compile time. Left out of the seal so that a user may point it
    at weights that moved, so read_manifest cannot vouch for it."""
    source = manifest["model"].get("source")
    if not isinstance(source, str) or not source:
        raise ArtifactError(
            f"{root / MANIFEST}: model.source is {source!r}, not a model directory; set it to the directory the "
            "weights are in, or load with graphkiln.load(OUT, model=DIR) or `graphkiln generate OUT --model DIR`"
        )
    return source


def _not_an_artifact(root: Path) -> str:
    """Why a folder without manifest.json is no artifact, and what to do (not --force: it would refuse the folder)."""
    if (root / "config.json").is_file():
        return (f"{root}: a model directory (config.json), not a graphkiln artifact (no {MANIFEST}); compile it first "
                f"with `compile-model {root} -o OUT`, or run it uncompiled with graphkiln.LLM.eager({str(root)!r})")
    return f"{root}: not a graphkiln artifact (it holds no {MANIFEST}); {NEW}"


def foreign_content(root: Path) -> str | None:
    """None when `root` is a graphkiln artifact (of any format version) holding only the files its manifest
    lists, or an empty folder; else why not. Only such a folder may be replaced (`--force`)."""
    if not root.is_dir():
        return "it is a file, not a folder"
    if not any(root.iterdir()):
        return None
    try:
        manifest = json.loads((root / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return f"it holds no readable {MANIFEST}, so it is not a graphkiln artifact"
    if _lacks(manifest):
        return f"its {MANIFEST} is not a graphkiln manifest"
    unlisted = first_unlisted(root, [*manifest["files"], MANIFEST, SIGNATURE])
    return None if unlisted is None else f"it holds {unlisted}, which is not part of the artifact"


def _lacks(manifest: object) -> str | None:
    """What a parsed manifest.json lacks of the fields graphkiln writes in every format version; None: nothing."""
    if not isinstance(manifest, dict):
        return "it is not a JSON object"
    environment = manifest.get("environment")
    fields = {"format_version": isinstance(manifest.get("format_version"), int),
              "environment.graphkiln": isinstance(environment, dict) and "graphkiln" in environment,
              "files": isinstance(manifest.get("files"), dict)}
    return next((f"no {name}" for name, present in fields.items() if not present), None)


def holds_artifact(root: Path) -> bool:
    """Whether `root` holds a graphkiln manifest.json: an artifact, whose load refuses any file it does not list."""
    try:
        return _lacks(json.loads((root / MANIFEST).read_bytes())) is None
    except (OSError, ValueError):
        return False


def check_environment(manifest: dict, device: str) -> None:
    """The artifact must come from this graphkiln/torch/triton/python and this device kind."""
    import torch

    recorded = manifest["environment"]
    if device == "cuda" and not torch.cuda.is_available():
        raise ArtifactError(f"artifact was compiled for cuda but this machine has no CUDA device; {FIX}")
    here = environment(device)
    for field in ("graphkiln", "torch", "triton", "python", "device"):
        if recorded.get(field) != here[field]:
            raise ArtifactError(f"artifact {field} is {recorded.get(field)!r} but this process has {here[field]!r}; {FIX}")


def check_signature_file(root: Path) -> None:
    """manifest.sig, when present, is a plain file of one signature's 64 bytes: it can carry nothing else."""
    path = root / SIGNATURE
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() or not path.is_file() or path.stat().st_size != SIGNATURE_BYTES:
        raise ArtifactError(
            f"{path}: not an Ed25519 signature (a plain file of {SIGNATURE_BYTES} bytes); delete it, or get "
            "the artifact again from its publisher"
        )


def check_files(manifest: dict, root: Path, already_read: frozenset[str] = frozenset()) -> None:
    """Exactly the listed files exist, each with its recorded sha256 (but those in `already_read`: checked and
    read before, or never read by this process); checked before anything is unpickled."""
    check_signature_file(root)
    present = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} - {MANIFEST, SIGNATURE}
    unlisted = sorted(present - set(manifest["files"]))
    if unlisted:
        raise ArtifactError(f"{root / unlisted[0]}: present but not listed in {MANIFEST} (tampered?); {FIX}")
    for rel, digest in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in {MANIFEST} but missing; {FIX}")
        if rel not in already_read and sha256_file(path) != digest:
            raise ArtifactError(f"{path}: sha256 differs from {MANIFEST} (modified or truncated); {FIX}")
