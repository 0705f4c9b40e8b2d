"""Hugging Face hub ids (`org/name`) found in the hub's local cache, and graphkiln's compile cache.

The hub cache is built by conftest in the hub's layout: this machine is offline and graphkiln never downloads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import graphkiln
from artifact_helpers import COMPILED, compile_error, greedy_tokens
from hub_helpers import HUB_REPO, use_hub_env
from graphkiln.errors import ModelFileError
from graphkiln.llm import is_hub_id, resolve_model_dir

pytestmark = pytest.mark.slow


def test_a_hub_id_is_its_snapshot_in_the_local_cache(hub_env: dict, hub_cache: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    with use_hub_env(hub_env):
        snapshot = resolve_model_dir(HUB_REPO)
        assert snapshot.parent.parent.parent == hub_cache and (snapshot / "config.json").is_file()
        monkeypatch.chdir(tmp_path)
        (tmp_path / HUB_REPO).mkdir(parents=True)  # a folder here of that name wins: it is what the user meant
        assert not is_hub_id(HUB_REPO) and resolve_model_dir(HUB_REPO) == Path(HUB_REPO)
    assert not is_hub_id("/abs/path") and not is_hub_id("./rel") and not is_hub_id(Path("org/name"))


def test_a_missing_hub_id_says_where_it_looked_and_how_to_download_it(hub_env: dict, hub_cache: Path, capsys) -> None:
    with use_hub_env(hub_env):
        with pytest.raises(ModelFileError) as info:
            resolve_model_dir("graphkiln-test/absent")
        line = compile_error(capsys, "graphkiln-test/absent", "-o", hub_cache.parent / "never")
    for message in (str(info.value), line):
        assert "graphkiln-test/absent" in message and str(hub_cache) in message
        assert "hf download graphkiln-test/absent" in message


def test_the_compile_cache_compiles_once_keyed_on_the_model_s_content(
    hub_artifact: Path, hub_env: dict, artifact: Path, tmp_path: Path
) -> None:
    """The artifact records the hub id as its model, loads through the hub cache, and serves what the tiny
    artifact serves; asked again (or for a copy of the model elsewhere) the cache compiles nothing; another
    CompileConfig gets another folder."""
    assert hub_artifact.parent == Path(hub_env["GRAPHKILN_CACHE_DIR"]) / "artifacts"
    assert json.loads((hub_artifact / "manifest.json").read_text())["model"]["source"] == HUB_REPO
    compiles = []

    def refuse(model, out, config, **options):
        compiles.append(out)
        raise RuntimeError("compiled")

    with use_hub_env(hub_env) as patch:
        patch.setattr(graphkiln.api, "compile_model", refuse)
        moved = Path(shutil.copytree(resolve_model_dir(HUB_REPO), tmp_path / "moved"))
        assert graphkiln.cached_artifact(HUB_REPO) == graphkiln.cached_artifact(moved) == hub_artifact
        with pytest.raises(RuntimeError, match="compiled"):
            graphkiln.cached_artifact(moved, graphkiln.CompileConfig(disabled_passes=("silu_mul_epilogue",)))
        assert compiles and compiles[0].parent == hub_artifact.parent and compiles[0] != hub_artifact
        with graphkiln.load(hub_artifact, **COMPILED) as from_hub, graphkiln.load(artifact, **COMPILED) as tiny:
            assert greedy_tokens(from_hub) == greedy_tokens(tiny)
