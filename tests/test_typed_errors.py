"""Mistakes that used to end in a traceback end in a typed graphkiln error: one line on the command line,
exit 2, naming the file, field or value and what to do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import graphkiln
from artifact_helpers import ENGINE, edit_manifest, single_error_line
from graphkiln import cli
from graphkiln.errors import ArtifactError

pytestmark = pytest.mark.slow


def generate_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = cli.main(["generate", *map(str, args), "--prompt", "hi", "--max-tokens", "2"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "field, edit",
    [
        ("config.dtype", lambda m: m["config"].__setitem__("dtype", "bfloat16")),
        ("model.config.num_layers", lambda m: m["model"]["config"].__setitem__("num_layers", 3)),
        ("config.block_size", lambda m: m["config"].__setitem__("block_size", 32)),
        ("environment.torch", lambda m: m["environment"].__setitem__("torch", torch.__version__ + "-edited")),
    ],
    ids=["dtype", "num_layers", "block_size", "torch-version"],
)
def test_hand_edited_manifest_field_is_named(art: Path, field: str, edit, capsys: pytest.CaptureFixture[str]) -> None:
    edit_manifest(art, edit, reseal=False)
    manifest = re.escape(str(art / "manifest.json"))
    pattern = rf"{manifest}: field {re.escape(field)} was changed \(now .*\) after compile-model wrote it; recompile"
    with pytest.raises(ArtifactError, match=pattern):
        graphkiln.load(art, **ENGINE)
    code, out, err = generate_cli(capsys, art)
    assert code == 2 and re.match("error: " + pattern, single_error_line(err))
