"""manifest.json: what an artifact directory holds and the setup it is valid for.

`environment()` describes this process (versions, device); `check_environment` and
`check_files` compare a manifest against it and against the files on disk. Each mismatch raises
an ArtifactError that says what differs and how to fix it. torch is imported only inside the
functions that describe this process, so reading a manifest (`graphkiln inspect`) imports
neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

from graphkiln.errors import ArtifactError
from graphkiln.version import __version__

FORMAT_VERSION = 3  # 3: serving defaults in section "engine", out of "config"
MANIFEST = "manifest.json"
FIX = "recompile with `compile-model ... --force`, or load with on_mismatch='recompile'"
REWRITE = "recompile with `compile-model ... --force`"
SECTIONS = {
    "environment": dict, "model": dict, "config": dict, "engine": dict, "passes": list, "compiled": dict, "files": dict,
}  # fmt: skip


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


def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact directory; create it with `compile-model MODEL -o {root}`")
    if not path.is_file():
        raise ArtifactError(f"{path}: missing, so {root} is not a complete artifact; {REWRITE}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e}); {REWRITE}") from e
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format_version {version!r}, this graphkiln reads {FORMAT_VERSION}; {REWRITE}")
    for section, kind in SECTIONS.items():
        if not isinstance(manifest.get(section), kind):
            raise ArtifactError(f"{path}: section {section!r} is missing or not a {kind.__name__}; {REWRITE}")
    return manifest


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


def check_files(manifest: dict, root: Path) -> None:
    """Exactly the listed files exist, each with its recorded sha256; checked before anything is unpickled."""
    present = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} - {MANIFEST}
    unlisted = sorted(present - set(manifest["files"]))
    if unlisted:
        raise ArtifactError(f"{root / unlisted[0]}: present but not listed in {MANIFEST} (tampered?); {FIX}")
    for rel, digest in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in {MANIFEST} but missing; {FIX}")
        if sha256_file(path) != digest:
            raise ArtifactError(f"{path}: sha256 differs from {MANIFEST} (modified or truncated); {FIX}")
