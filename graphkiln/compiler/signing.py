"""Ed25519 signatures over manifest.json, for people who distribute artifacts.

The manifest lists every other file's sha256 (and a digest of its own fields), so a signature
over its bytes covers the whole artifact. `compile-model --sign-key KEY` writes `manifest.sig`,
the 64 signature bytes and nothing else; `load(OUT, trusted_keys=[...])` checks it against the
manifest's bytes before anything is unpickled or loaded. Keys are PEM files (unencrypted PKCS#8
private keys, SubjectPublicKeyInfo public keys), made by `generate_key_pair` (`graphkiln keygen`).
Needs the `cryptography` package: `pip install 'graphkiln[sign]'`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from graphkiln.errors import ArtifactError, ConfigError

from .manifest import MANIFEST, SIGNATURE

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KeySource = str | os.PathLike | bytes  # a PEM file's path, or its bytes
PRIVATE_KEY_FILE = "graphkiln-sign.pem"
PUBLIC_KEY_FILE = "graphkiln-sign.pub.pem"
KEYGEN = "make a key pair with `graphkiln keygen DIR`"


def _ed25519() -> tuple[ModuleType, ModuleType]:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise ConfigError(
            "signing and checking artifact signatures needs the cryptography package: pip install 'graphkiln[sign]'"
        ) from e
    return serialization, ed25519


def _pem(source: KeySource, what: str) -> tuple[bytes, str]:
    """The PEM bytes of `source` and how to name it in an error."""
    if isinstance(source, bytes):
        return source, f"the {what} given as bytes"
    try:
        return Path(source).read_bytes(), str(source)
    except OSError as e:
        raise ConfigError(f"{source}: cannot read this {what} ({e.strerror}); {KEYGEN}") from e


def load_private_key(source: KeySource) -> Ed25519PrivateKey:
    """The Ed25519 private key of a PEM file (path or bytes), or a ConfigError naming it."""
    serialization, ed25519 = _ed25519()
    data, name = _pem(source, "private signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{name}: not an unencrypted PEM private key ({e}); {KEYGEN}") from e
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ConfigError(f"{name}: a {type(key).__name__}, not an Ed25519 private key; {KEYGEN}")
    return key


def load_public_keys(sources: KeySource | Sequence[KeySource]) -> list[Ed25519PublicKey]:
    """The Ed25519 public keys of PEM files (paths or bytes); at least one."""
    if isinstance(sources, (str, bytes, os.PathLike)):
        sources = [sources]
    if not sources:
        raise ConfigError("trusted_keys is empty; give the public key (PEM) of each publisher you trust")
    serialization, ed25519 = _ed25519()
    keys = []
    for source in sources:
        data, name = _pem(source, "trusted public key")
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{name}: not a PEM public key ({e}); use the publisher's public key file") from e
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise ConfigError(f"{name}: a {type(key).__name__}, not an Ed25519 public key")
        keys.append(key)
    return keys


def sign(root: Path, key: Ed25519PrivateKey) -> None:
    """Write root/manifest.sig: `key`'s signature over root/manifest.json as it is on disk."""
    (root / SIGNATURE).write_bytes(key.sign((root / MANIFEST).read_bytes()))


def verify(root: Path, manifest_bytes: bytes, keys: Sequence[Ed25519PublicKey]) -> None:
    """`manifest_bytes` (root/manifest.json, read once by the caller) must carry a signature of one of `keys`."""
    from cryptography.exceptions import InvalidSignature

    path = root / SIGNATURE
    if not path.is_file() or path.is_symlink():
        raise ArtifactError(
            f"{path}: missing, so {root} is unsigned and the trusted keys refuse it; ask its publisher for a "
            "signed artifact (`compile-model ... --sign-key KEY`), or load without trusted keys only what you compiled"
        )
    signature = path.read_bytes()
    for key in keys:
        try:
            key.verify(signature, manifest_bytes)
            return
        except InvalidSignature:
            continue
    raise ArtifactError(
        f"{path}: not a signature of {root / MANIFEST} by any trusted key (the artifact was changed after "
        "signing, or another key signed it); get the artifact again from its publisher, or trust their public key"
    )


def generate_key_pair(folder: str | os.PathLike) -> tuple[Path, Path]:
    """Write a new Ed25519 key pair into `folder` (private key readable by its owner only); never overwrites."""
    serialization, ed25519 = _ed25519()
    folder = Path(folder)
    private, public = folder / PRIVATE_KEY_FILE, folder / PUBLIC_KEY_FILE
    for path in (private, public):
        if path.exists() or path.is_symlink():
            raise ConfigError(f"{path}: already exists and a key is never overwritten; pick another folder")
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_new(private, private_pem, 0o600)
        try:
            _write_new(public, public_pem, 0o644)
        except OSError:
            private.unlink()  # written just now: a private key without its public half is of no use
            raise
    except OSError as e:
        raise ConfigError(f"{e.filename or folder}: cannot write a key here ({e.strerror}); pick another folder") from e
    return private, public


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with `mode` (never an existing file: O_EXCL) and write `data`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # the umask may have narrowed it; it never widens the private key's 0600
