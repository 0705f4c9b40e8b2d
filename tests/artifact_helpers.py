"""Helpers shared by test_artifacts.py and test_cli.py: the small compile config, subprocess runners, edits.

Subprocesses inherit this process's environment, so TORCHINDUCTOR_CACHE_DIR (when CI sets it)
points at the same cache as the test process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import graphkiln
from graphkiln import CompileConfig, EngineConfig, SamplingParams, cli
from graphkiln.compiler.manifest import seal

DECODE_SIZES = (1, 2, 4)
PREFILL_BUCKETS = (16, 32)
SMALL_CONFIG = CompileConfig()
SMALL_ENGINE = EngineConfig(decode_batch_sizes=DECODE_SIZES, prefill_token_buckets=PREFILL_BUCKETS)
# The same configs on the command line.
SMALL_CONFIG_ARGS = ("--device", "cpu", "--dtype", "float32", "--decode-batch-sizes", "1,2,4", "--prefill-token-buckets", "16,32")

# Uneven prompts: a 2-token one, a sentence, and 40 token ids (past the largest prefill bucket).
PROMPTS: list = ["hi", "The kiln is hot and the tokens flow through every layer", list(range(5, 45))]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
ENGINE = {"kv_cache_tokens": 2048}  # keeps every engine in these tests small
# A load whose steps all run the compiled pieces: a background load (the default) serves with the model itself
# until they are in, so a test comparing what an artifact computes right after `load` would compare the eager model.
COMPILED = {**ENGINE, "capture": "blocking"}

SUBPROCESS_TIMEOUT_S = 300
RESULT_PREFIX = "RESULT-JSON "


def greedy_tokens(llm: graphkiln.LLM, prompts: list = PROMPTS) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, GREEDY)]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The model is tiny and CI has 2 cores: one intra-op thread per subprocess, like conftest does in-process.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(args: list[str], timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def popen(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def compile_cmd(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "graphkiln.compile_model", *map(str, args)]


def graphkiln_cmd(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "graphkiln", *map(str, args)]


def run_python_json(code: str, timeout: float = SUBPROCESS_TIMEOUT_S) -> dict:
    """Run `code` in a fresh interpreter; it must print one line `RESULT-JSON {...}`; return that object."""
    proc = run([sys.executable, "-c", code], timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, f"expected one {RESULT_PREFIX!r} line, stdout was:\n{proc.stdout[-4000:]}"
    return json.loads(lines[0][len(RESULT_PREFIX) :])


def temp_folders(out: Path) -> list[Path]:
    """The hidden temporary folders a compile of `out` writes beside it (and the files that mark them as its own),
    or folders of such a name."""
    return sorted(out.parent.glob(f".{out.name}.tmp-*"))


def edit_manifest(out: Path, edit: Callable[[dict], None], reseal: bool = True) -> None:
    """Edit manifest.json. `reseal` updates its fields_sha256 too: the manifest then reads as if graphkiln
    had written it that way (another torch, another pass); without it the edit is a hand edit."""
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    if reseal and "fields_sha256" in manifest:
        manifest["fields_sha256"] = seal(manifest)
    path.write_text(json.dumps(manifest, indent=1))


def set_torch_version(out: Path, version: str = "0.0") -> None:
    """Make the artifact look built by another torch: stale, though every file is intact."""
    edit_manifest(out, lambda m: m["environment"].__setitem__("torch", version))


def compile_error(capsys, *args: str | Path) -> str:
    """Run compile-model in-process with the small config: it must exit 2, print nothing on stdout and
    one line on stderr; return that line."""
    assert cli.compile_model_main([*map(str, args), *SMALL_CONFIG_ARGS, "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return single_error_line(captured.err)


def single_error_line(stderr: str) -> str:
    """stderr must be exactly one newline-terminated line; return it without the newline."""
    lines = stderr.rstrip("\n").split("\n")
    assert len(lines) == 1 and lines[0], f"expected exactly one line on stderr, got {stderr!r}"
    assert "Traceback" not in stderr, stderr
    return lines[0]


def rehash(out: Path, *files: Path) -> None:
    """Fix up the manifest's sha256 of edited files, as someone tampering with an artifact would."""
    digests = {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    edit_manifest(out, lambda m: m["files"].update(digests))


_MARKER_KERNEL = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>
static void mark(const char* what) { FILE* f = fopen(MARKER, "a"); if (f) { fputs(what, f); fclose(f); } }
static PyObject* kernel(PyObject* self, PyObject* args) { mark("called\n"); Py_RETURN_NONE; }
static PyMethodDef methods[] = {{"kernel", kernel, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kernel(void) { mark("loaded\n"); return PyModule_Create(&module); }
"""


def plant_marker_kernel(out: Path, marker: Path) -> Path:
    """Replace one compiled C++ kernel of a CPU artifact with a library Inductor loads the same way that
    computes nothing and appends to `marker` when loaded or called; fix up its sha256. Returns its path."""
    library = sorted((out / "cpu-kernels").rglob("*.main.so"))[0]  # a kernel library the pieces load
    source = out.parent / "marker_kernel.c"
    source.write_text(_MARKER_KERNEL)
    compiler = shutil.which("gcc") or shutil.which("cc")
    command = [compiler, "-shared", "-fPIC", "-O1", f"-I{sysconfig.get_paths()['include']}",
               f'-DMARKER="{marker}"', str(source), "-o", str(library)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    rehash(out, library)
    return library


def flip_piece_byte_and_rehash(art: Path) -> Path:
    """Corrupt one compiled piece of `art` and fix its sha256 in the manifest, so only loading it fails."""
    piece = sorted((art / "pieces").rglob("*.bin"))[0]
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0xFF
    piece.write_bytes(bytes(data))
    rehash(art, piece)
    return piece
