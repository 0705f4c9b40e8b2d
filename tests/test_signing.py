"""Signed artifacts: `graphkiln keygen` makes a key pair, `compile-model --sign-key` signs the manifest,
and `load(trusted_keys=...)` / `generate --trusted-key` refuse unsigned or wrongly signed artifacts before
anything in them is loaded. The signature file can carry nothing but a signature."""

from __future__ import annotations

import re
import shutil
import stat
import sys
from pathlib import Path

import pytest

import graphkiln
from artifact_helpers import (
    COMPILED,
    ENGINE,
    PROMPTS,
    SMALL_CONFIG,
    SMALL_CONFIG_ARGS,
    edit_manifest,
    greedy_tokens,
    plant_marker_kernel,
    single_error_line,
)
from graphkiln import cli
from graphkiln.compiler.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, load_private_key, sign
from graphkiln.errors import ArtifactError, ConfigError

pytestmark = pytest.mark.slow


def keygen(tmp_path_factory: pytest.TempPathFactory, owner: str) -> tuple[Path, Path]:
    """(private, public) PEM files written by `graphkiln keygen`."""
    folder = tmp_path_factory.mktemp("keys") / owner
    assert cli.main(["keygen", str(folder)]) == 0
    return folder / PRIVATE_KEY_FILE, folder / PUBLIC_KEY_FILE


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return keygen(tmp_path_factory, "publisher")


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return keygen(tmp_path_factory, "someone-else")


@pytest.fixture(scope="module")
def signed(keys: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model compiled by `compile-model ... --sign-key KEY`."""
    out = tmp_path_factory.mktemp("signed") / "tiny"
    argv = ["tiny", "-o", str(out), "--sign-key", str(keys[0]), "--quiet", *SMALL_CONFIG_ARGS]
    assert cli.compile_model_main(argv) == 0
    return out


@pytest.fixture
def signed_copy(signed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(signed, tmp_path / "signed"))


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(
    keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    private, public = keys
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    before = private.read_bytes(), public.read_bytes()
    assert cli.main(["keygen", str(private.parent)]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line == f"error: {private}: already exists and a key is never overwritten; pick another folder"
    assert (private.read_bytes(), public.read_bytes()) == before


def test_signed_artifact_loads_with_its_public_key(
    signed: Path, keys: tuple[Path, Path], eager_tokens: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    files = ["graph.json", "manifest.json", "manifest.sig", "tokenizer.json"]
    assert sorted(p.name for p in signed.iterdir() if p.is_file()) == files
    llm = graphkiln.load(signed, trusted_keys=[keys[1]], **COMPILED)
    assert greedy_tokens(llm, PROMPTS[:1]) == eager_tokens[:1]
    graphkiln.load(signed, trusted_keys=[keys[1].read_bytes()], **ENGINE)  # a key given as PEM bytes
    graphkiln.load(signed, **ENGINE)  # without trusted keys the signature is not needed
    argv = ["generate", str(signed), "--trusted-key", str(keys[1]), "--prompt", "hi", "--max-tokens", "2"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("'hi' -> ")


@pytest.mark.parametrize("case", ["unsigned", "signed-by-another-key", "changed-after-signing", "signature-deleted"])
def test_untrusted_artifact_is_refused_before_any_code_loads(
    case: str, art: Path, signed_copy: Path, keys: tuple[Path, Path], other_keys: tuple[Path, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    out = art if case == "unsigned" else signed_copy
    kernel = tmp_path / "kernel-loaded"
    plant_marker_kernel(out, kernel)
    if case == "signed-by-another-key":
        sign(out, load_private_key(other_keys[0]))
    elif case == "signature-deleted":
        (out / "manifest.sig").unlink()
    missing = case in ("unsigned", "signature-deleted")
    message = "missing, so .* is unsigned" if missing else "not a signature of .*manifest.json by any trusted key"
    with pytest.raises(ArtifactError, match=re.escape(str(out / "manifest.sig")) + ": " + message):
        graphkiln.load(out, trusted_keys=[keys[1]], **ENGINE)
    assert cli.main(["generate", str(out), "--trusted-key", str(keys[1]), "--prompt", "hi"]) == 2
    assert single_error_line(capsys.readouterr().err).startswith(f"error: {out / 'manifest.sig'}: ")
    assert not kernel.exists()


def test_signature_file_carries_nothing_but_a_signature(signed_copy: Path) -> None:
    signature = signed_copy / "manifest.sig"
    refused = re.escape(str(signature)) + r": not an Ed25519 signature \(a plain file of 64 bytes\)"
    signature.write_bytes(signature.read_bytes() + b"import os; os.system('...')")
    with pytest.raises(ArtifactError, match=refused):
        graphkiln.load(signed_copy, **ENGINE)  # refused even when no key is asked for
    signature.unlink()
    (signature / "payload").mkdir(parents=True)
    (signature / "payload" / "x.py").write_text("print('smuggled')\n")
    with pytest.raises(ArtifactError, match=refused):
        graphkiln.load(signed_copy, **ENGINE)
    shutil.rmtree(signature)
    (signed_copy / "pieces" / "manifest.sig").write_bytes(bytes(64))  # only the top-level one is a signature
    with pytest.raises(ArtifactError, match=r"pieces/manifest\.sig: present but not listed"):
        graphkiln.load(signed_copy, **ENGINE)


def test_hand_edit_of_a_signed_manifest_is_refused(signed_copy: Path, keys: tuple[Path, Path]) -> None:
    # resealed, so only the signature tells
    edit_manifest(signed_copy, lambda m: m["config"].__setitem__("max_seq_len", 64))
    with pytest.raises(ArtifactError, match="not a signature of"):
        graphkiln.load(signed_copy, trusted_keys=[keys[1]], **ENGINE)


@pytest.mark.parametrize("which", ["public-as-private", "not-pem", "missing"])
def test_bad_sign_key_is_a_config_error_before_compiling(
    which: str, keys: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = {"public-as-private": keys[1], "not-pem": tmp_path / "key.txt", "missing": tmp_path / "nowhere.pem"}[which]
    if which == "not-pem":
        key.write_text("hunter2\n")
    out = tmp_path / "out"
    assert cli.compile_model_main(["tiny", "-o", str(out), "--sign-key", str(key), "--quiet"]) == 2
    line = single_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {key}: ") and "graphkiln keygen" in line, line
    assert not out.exists()


def test_bad_trusted_keys_are_config_errors(signed: Path, keys: tuple[Path, Path]) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(keys[0])) + ": not a PEM public key"):
        graphkiln.load(signed, trusted_keys=[keys[0]], **ENGINE)
    with pytest.raises(ConfigError, match="trusted_keys is empty"):
        graphkiln.load(signed, trusted_keys=[], **ENGINE)
    with pytest.raises(ConfigError, match="a recompiled artifact is unsigned"):
        graphkiln.load(signed, trusted_keys=[keys[1]], on_mismatch="recompile", **ENGINE)


def test_missing_cryptography_names_the_extra(
    keys: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cryptography", None)
    with pytest.raises(ConfigError, match=re.escape("pip install 'graphkiln[sign]'")):
        graphkiln.compile_model("tiny", tmp_path / "out", SMALL_CONFIG, sign_key=keys[0])
    assert not (tmp_path / "out").exists()
