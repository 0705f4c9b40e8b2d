"""Pass-debugging dumps: compile the tiny model with a dump dir and check every promised file;
the depyf compat wrapper; clear errors for a foreign folder and a missing depyf."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from urllib.parse import unquote

import pytest
from test_passes import NAMES, OFF_BY_DEFAULT, toy_model

import graphkiln
from graphkiln import CompileConfig
from graphkiln import compat
from graphkiln.compiler.compile import compile_module
from graphkiln.errors import ConfigError
from graphkiln.passes.dump import MARKER, kernel_counts

SIZES = ("dynamic", "1", "16")


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    root = tmp_path_factory.mktemp("dump")
    config = CompileConfig(specialize_sizes=(1, 16),
                           dump_dir=str(root / "dump"))
    manifest, report = graphkiln.compile_model("tiny", root / "out", config)
    index = (root / "dump" / "index.md").read_text()
    files = re.findall(r"^- \[`([^`]+)`\]\(([^)]+)\): (.*)$", index, re.MULTILINE)
    assert all(unquote(link) == name for name, link, _ in files)
    return root / "dump", {name: what for name, _, what in files}, manifest, report


def test_every_link_in_the_index_opens_a_file(dumped):
    dump = dumped[0]
    index = (dump / "index.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", index)
    assert links and len(links) == index.count("\n- ") == len(dumped[1])
    assert all((dump / unquote(link)).is_file() for link in links)


def test_index_lists_files_that_exist_in_pipeline_order(dumped):
    dump, files, _, _ = dumped
    assert all((dump / name).is_file() for name in files)
    on_disk = {str(p.relative_to(dump)) for p in dump.rglob("*") if p.is_file()} - {"index.md", MARKER}
    assert on_disk == set(files)
    numbered = [name[:2] for name in files if name[:2].isdigit()]
    assert numbered == sorted(numbered)


def test_decompiled_bytecode_and_every_pass_before_and_after(dumped):
    dump, files, _, _ = dumped
    assert any(name.startswith("00-dynamo/full_code_for_forward") for name in files)
    transformed = next(dump.glob("00-dynamo/__transformed_code_*.py")).read_text()
    assert "def __transformed_code_0_for_forward(self, input_ids, positions)" in transformed
    for number, name in enumerate(NAMES, 1):
        if name in OFF_BY_DEFAULT:  # no dumps of a pass that did not run
            assert not list(dump.glob(f"{number:02d}-{name}.*"))
            continue
        piece = ".submod_0.dynamic" if name == "linear_op" else ""  # the post-grad pass: per piece and size
        for when in ("before", "after"):
            assert "def forward(self" in (dump / f"{number:02d}-{name}.{when}{piece}.py").read_text()
    number = {name: i for i, name in enumerate(NAMES, 1)}
    assert "submod_1" in (dump / f"{number['attention_split']:02d}-attention_split.after.py").read_text()
    before, after = ((dump / f"{number['linear_op']:02d}-linear_op.{when}.submod_0.dynamic.py").read_text()
                     for when in ("before", "after"))
    assert "aten.mm.default" in before and "aten.mm.default" not in after and "graphkiln.linear.default" in after
    before, after = ((dump / f"{number['silu_mul_epilogue']:02d}-silu_mul_epilogue.{when}.py").read_text()
                     for when in ("before", "after"))
    assert "silu" in before and "linear_silu_mul" not in before and "graphkiln.linear_silu_mul.default" in after
    summary = (dump / f"{number['attention_split']:02d}-split.summary.md").read_text()
    assert "5 pieces, 4 attention submodules; 28 tensors cross 8 cuts" in summary
    assert "`x: float32[s" in summary
    assert "silu_mul_epilogue" in (dump / "passes.md").read_text()


def test_post_grad_graphs_are_named_by_piece_and_size(dumped):
    """The post-grad pass runs once per compiled (piece, size); each dump names which, as the output code does."""
    dump, files, manifest, _ = dumped
    number = NAMES.index("linear_op") + 1
    first = {}
    for piece, key in manifest["compiled"]["pieces"].items():
        first.setdefault(key, piece)
    expected = {f"{number:02d}-linear_op.{when}.{piece}.{size}.py"
                for piece in first.values() for size in SIZES for when in ("before", "after")}
    post_grad = {name for name in files if name.startswith(f"{number:02d}-linear_op.")}
    assert post_grad == expected
    assert files[f"{number:02d}-linear_op.after.submod_8.16.py"] == "Inductor post-grad graph of submod_8 (16) after pass linear_op"


def test_inductor_code_for_every_piece_and_size(dumped):
    dump, files, manifest, report = dumped
    for piece in manifest["compiled"]["pieces"]:
        for size in SIZES:
            name = next(n for n, what in files.items() if "inductor" in n and piece in what and f"({size})" in what)
            code = (dump / name).read_text()
            assert "def call(" in code and kernel_counts(code)["kernels"] >= 1
            # linear_op: every weight product goes through graphkiln::linear, none to extern mm/addmm
            assert "torch.ops.graphkiln.linear.default(" in code and "extern_kernels" not in code.split("def call(")[1]
    assert [p["name"] for p in manifest["passes"]] == [n for n in NAMES if n not in OFF_BY_DEFAULT]  # those that ran
    assert all(re.fullmatch(r"[0-9a-f]{64}", p["uuid"]) for p in manifest["passes"])
    assert [r.name for r in report.passes] == NAMES


def test_depyf_output_is_kept_in_the_dump(dumped):
    dump, files, _, _ = dumped
    assert "depyf" in files["00-dynamo/depyf.log"]
    assert "You are trying to debug `torch.compile`" in (dump / "00-dynamo/depyf.log").read_text()


def test_depyf_debug_passes_other_warnings_on(tmp_path):
    with pytest.warns(UserWarning, match="not from depyf"):
        with compat.depyf_debug(tmp_path / "dynamo", tmp_path / "depyf.log"):
            warnings.warn("not from depyf", UserWarning)
            print("printed inside")
    log = (tmp_path / "depyf.log").read_text()
    assert "printed inside" in log and "You are trying to debug" in log and "not from depyf" not in log


def test_a_foreign_non_empty_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        compile_module(toy_model(), CompileConfig(dump_dir=str(tmp_path)))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_missing_depyf_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "depyf", None)
    monkeypatch.setitem(sys.modules, "depyf.explain", None)
    with pytest.raises(ConfigError, match=re.escape("pip install 'graphkiln[dump]'")):
        compile_module(toy_model(), CompileConfig(dump_dir=str(tmp_path / "dump")))
    assert not (tmp_path / "dump").exists()


def test_depyf_compat_forwards_keyword_arguments(monkeypatch, tmp_path):
    from depyf.explain import enable_debugging
    from depyf.explain.global_variables import data

    calls = []
    monkeypatch.setitem(data, "dump_src_dir", str(tmp_path))
    monkeypatch.setitem(data, "unpatched_load_by_key_path", lambda *args, **kwargs: calls.append((args, kwargs)))
    kernel = tmp_path / "kernel.py"
    kernel.write_text("x = 1\n")
    compat.load_by_key_path("key", str(kernel), None, None, set_sys_modules=False)
    (args, kwargs), = calls
    assert kwargs == {"set_sys_modules": False} and args[0] == "key" and Path(args[1]).read_text() == "x = 1\n"
    original = enable_debugging.patched_load_by_key_path
    with compat.depyf_debug(tmp_path / "dynamo", tmp_path / "depyf.log"):
        assert enable_debugging.patched_load_by_key_path is compat.load_by_key_path
    assert enable_debugging.patched_load_by_key_path is original
