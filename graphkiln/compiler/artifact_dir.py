"""An artifact directory, written atomically (artifact_load.py reads it, after every check passes).

Writing compiles into a hidden temporary folder beside OUT and renames it into place at the
end, under an exclusive lock on a sibling lock file: an interrupted compile leaves no OUT, and
of two concurrent writers the second waits and then finds OUT present. Only what graphkiln wrote
is ever replaced: an artifact holding just its manifest's files (or an empty folder), and the
hidden `.OUT.tmp-*` folders of earlier compiles.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from graphkiln.compat import fake_process_group, forget_vec_isa_checks, private_inductor_cache, require_depyf
from graphkiln.errors import ArtifactError, ConfigError
from graphkiln.kernels.shipped import TRITON_KERNELS
from graphkiln.models import load_model
from graphkiln.models.tokenizer import Tokenizer
from graphkiln.models.fingerprint import model_fingerprint
from graphkiln.models.quant_scheme import check_tensor_parallel, model_scheme
from graphkiln.models.quantized_layers import layer_schemes, save_quantized
from graphkiln.models.sharding import Shard
from graphkiln.models.transformer import CausalLM
from graphkiln.passes.base import Pass
from graphkiln.passes.dump import check_dump_dir
from graphkiln.passes.pipeline import default_passes, passes_off

from .artifacts import CPU_KERNELS, QUANTIZED_FILE, TOKENIZER_FILE, quantized_file, save_compiled
from .compile import CompileReport, Progress, compile_module
from .config import CompileConfig
from .manifest import (
    FORMAT_VERSION,
    MANIFEST,
    environment,
    file_hashes,
    foreign_content,
    holds_artifact,
    seal,
)
from .signing import sign

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


@contextlib.contextmanager
def locked(out: Path, shared: bool = False, progress: Progress = lambda stage, done, total: None) -> Iterator[None]:
    """Writers hold the sibling lock file exclusively, readers shared (skipped where it can't be opened).

    The lock file is opened for appending and never written, truncated or removed: a file of that
    name that graphkiln did not write keeps its bytes. A writer that finds the lock taken says
    through `progress` whom it waits for: the holder's temporary folder carries its pid.
    """
    try:
        if not shared:
            out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_file(out), "a")
    except OSError as e:
        if not shared:
            raise _unwritable(out, e) from e
        yield
        return
    with lock:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(lock, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting = f"waiting for {_lock_holder(out)} to finish"
            progress(waiting, 0, 1)
            fcntl.flock(lock, mode)
            progress(waiting, 1, 1)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def lock_file(out: Path) -> Path:
    """The sibling file `locked` locks for `out`."""
    return out.parent / f".{out.name}.lock"


def _lock_holder(out: Path) -> str:
    """Who holds the lock: the compile whose temporary folder (`.OUT.tmp-<pid>-...`) is there, else a reader
    (or a compile that has not made its folder yet)."""
    prefix = f".{out.name}.tmp-"
    pids = {p.name[len(prefix) :].split("-")[0] for p in out.parent.glob(f"{prefix}*")}
    pids = sorted(p for p in pids if p.isdigit())
    return f"another compile of {out} (pid {pids[0]})" if len(pids) == 1 else f"another process using {out}"


def _unwritable(out: Path, e: OSError) -> ArtifactError:
    where = e.filename or out.parent
    return ArtifactError(f"{out}: cannot write the artifact ({where}: {e.strerror}); pick a writable folder for -o")


def _no_space(out: Path, e: OSError) -> ArtifactError:
    return ArtifactError(f"{out}: the disk filled while the artifact was written ({e.filename or out.parent}: "
                         f"{e.strerror}); nothing was kept: free space there or pick another folder for -o")


def _owned(tmp: Path) -> Path:
    """The empty file beside a temporary folder graphkiln made for OUT: only a folder with one is ever removed."""
    return tmp.with_name(f"{tmp.name}.graphkiln")


def _temporary(out: Path, kind: str) -> Path:
    """A new folder beside OUT, marked as graphkiln's (`_owned`) so that a later compile may remove it if this
    one dies before it does."""
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{kind}"))
    _owned(tmp).touch()
    return tmp


def _remove(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    _owned(tmp).unlink(missing_ok=True)


def _remove_stale(out: Path) -> None:
    """Temporary folders an earlier compile of OUT left behind (killed before it removed them); a folder of that
    name without graphkiln's mark is someone else's and stays."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        if stale.is_dir() and not stale.is_symlink() and _owned(stale).is_file():
            _remove(stale)


def _relation(a: Path, b: Path) -> str | None:
    """How folder a stands to folder b: "is", "is inside", "holds", or None when apart."""
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    return "holds" if a in b.parents else None


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        build = "sees no CUDA device" if torch.version.cuda else "is built without CUDA"
        raise ConfigError(f"CompileConfig.device='cuda' but this torch {torch.__version__} {build}; use --device cpu")


def _enclosing_artifact(folder: Path) -> Path | None:
    """The graphkiln artifact that `folder` is or lies inside, if any (`folder` resolved)."""
    return next((f for f in (folder, *folder.parents) if holds_artifact(f)), None)


def check_specialize_sizes(sizes: tuple[int, ...], engine_defaults: dict) -> None:
    """No specialized size above the tokens a step holds (the recorded EngineConfig.max_num_batched_tokens): no
    call would ever use its compile, which runs on real inputs of that many tokens (a huge one fails in torch)."""
    bound = engine_defaults["max_num_batched_tokens"]
    if too_large := [s for s in sizes if s > bound]:
        raise ConfigError(f"CompileConfig.specialize_sizes holds {too_large[0]}, more tokens than a step holds "
                          f"(EngineConfig.max_num_batched_tokens={bound}); drop it, or raise max_num_batched_tokens "
                          "(--max-num-batched-tokens) to it")


def check_paths(out: Path, model_dir: Path, config: CompileConfig) -> None:
    """OUT stays apart from the model directory and the dump folder (replacing one must never touch the
    other), neither lies inside another artifact (whose load would refuse the files written there), and the
    dump folder is new, empty or an earlier dump."""
    model_dir = model_dir.resolve()
    if relation := _relation(out, model_dir):
        raise ConfigError(f"-o {out} {relation} the model directory {model_dir}; write the artifact to its own folder")
    if artifact := _enclosing_artifact(out.parent):
        raise ConfigError(f"-o {out} is inside the graphkiln artifact {artifact}, whose load would refuse the files "
                          "written there; write the artifact to a folder outside it")
    if config.dump_dir:
        dump = Path(config.dump_dir).resolve()
        if relation := _relation(dump, out):
            raise ConfigError(f"--dump-dir {dump} {relation} -o {out}; keep the dumps and the artifact apart")
        if artifact := _enclosing_artifact(dump):
            relation = "is" if artifact == dump else "is inside"
            raise ConfigError(f"--dump-dir {dump} {relation} the graphkiln artifact {artifact}, whose load would "
                              "refuse the files written there; pick a folder outside it")
        check_dump_dir(dump)


def _claim(out: Path, force: bool) -> None:
    """OUT may be written when absent, or replaced (force) when it is an artifact or empty; nothing else."""
    if not out.exists():
        return
    foreign = foreign_content(out)
    if foreign is not None:
        raise ArtifactError(f"{out}: already exists and {foreign}; graphkiln replaces only its own artifacts, "
                            "so pick a new folder for -o")
    if not force:
        raise ArtifactError(f"{out}: already exists; pass --force (force=True) to replace it")


def write_artifact(
    model_dir: Path,
    model_source: str,
    out: Path,
    config: CompileConfig,
    engine_defaults: dict,
    *,
    force: bool = False,
    sign_key: Ed25519PrivateKey | None = None,
    graph_passes: tuple[Pass, ...] = (),
    progress: Progress = lambda stage, done, total: None,
    compiling: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    finish: Callable[[Path], dict[str, float]] | None = None,
) -> tuple[dict, CompileReport]:
    """Compile `model_dir` for `config` into `out`; return the manifest and the compile report.
    `engine_defaults` (an EngineConfig as a dict) is recorded for `load` to start from. The compile runs inside
    `compiling()`; `finish`, if given, then runs on the complete artifact in its temporary folder, before it is
    signed and renamed into place: the files it adds under TRITON_KERNELS are listed in the manifest, and the
    stage seconds it returns are added to the report's timings.

    The model directory (config.json, weight file headers, quantization), the device, the specialized sizes, the
    paths, the pass names and, for dumps, depyf are checked before anything is locked, created or reported as
    progress.
    `force` replaces an existing artifact (or an empty folder), nothing else. `sign_key` signs the
    manifest.
    """
    out = out.resolve()
    fingerprint = model_fingerprint(model_dir)
    check_device(config.device)
    check_specialize_sizes(config.specialize_sizes, engine_defaults)
    # an unsupported, conflicting or sharded scheme, before anything is written
    check_tensor_parallel(model_scheme(model_dir, config.quantization), config.tensor_parallel_size)
    check_paths(out, model_dir, config)
    passes_off(default_passes(graph_passes), config.disabled_passes, config.enabled_passes, config.device)
    if config.dump_dir:
        require_depyf()
    _claim(out, force)  # before the lock file and OUT's parents are created; again under the lock
    with locked(out, progress=progress):
        _claim(out, force)
        _remove_stale(out)
        try:
            tmp = _temporary(out, f"{os.getpid()}-")
        except OSError as e:
            raise _unwritable(out, e) from e
        try:
            with compiling():
                manifest, report = _compile_into(
                    model_dir, model_source, fingerprint, tmp, config, engine_defaults, graph_passes, progress
                )
            if finish is not None:
                report.timings.update(finish(tmp))
                lock_file(tmp).unlink(missing_ok=True)  # (a load of `tmp` made it: ours)
                manifest = _reseal(tmp, manifest, report.timings)
            if sign_key is not None:
                sign(tmp, sign_key)
            _claim(out, force)  # again: the compile took a while, and OUT is replaced only if it is still ours
            _replace(tmp, out)
        except BaseException as e:
            _remove(tmp)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _no_space(out, e) from e
            raise
        _owned(tmp).unlink()
    return manifest, report


def _compile_into(
    model_dir, model_source, fingerprint, tmp: Path, config, engine_defaults: dict, graph_passes, progress
) -> tuple[dict, CompileReport]:
    size = config.tensor_parallel_size
    with fake_process_group(size) if size > 1 else contextlib.nullcontext():  # rank 0's graph is every rank's
        progress("load weights", 0, 1)
        start = time.perf_counter()
        model = load_model(model_dir, config.device, config.dtype, quantization=config.quantization,
                           shard=Shard(0, size))
        load_s = time.perf_counter() - start
        tokenizer = Tokenizer.from_dir(model_dir)
        snapshot = tokenizer is not None and tokenizer.save_snapshot(tmp / TOKENIZER_FILE)
        progress("load weights", 1, 1)
        private_cache = tmp / ".inductor-cache"
        cpu = config.device == "cpu"
        with private_inductor_cache(private_cache) if cpu else contextlib.nullcontext():
            if cpu:
                forget_vec_isa_checks()  # their libraries then land in the private cache, and are shipped
            compiled, report = compile_module(model, config, graph_passes, progress)
    report.timings = {"load": load_s, **report.timings}
    progress("save", 0, 1)
    t = time.perf_counter()
    section = save_compiled(compiled, tmp)
    if config.quantization:
        _save_quantized_ranks(model, model_dir, config, tmp)
    if private_cache.exists():
        _ship_cpu_kernels(private_cache, tmp / CPU_KERNELS)
    report.timings["save"] = time.perf_counter() - t
    progress("save", 1, 1)
    manifest = {
        "format_version": FORMAT_VERSION,
        "environment": environment(config.device),
        "model": {
            "source": model_source,
            "architecture": model.cfg.architecture,
            "config": asdict(model.cfg),
            "tokenizer": "snapshot" if snapshot else ("transformers" if tokenizer else None),
            "quantization": _quantization(model_dir, config, model),
            **fingerprint,
        },
        "config": asdict(config),
        "engine": engine_defaults,
        "passes": [{"name": r.name, "stage": r.stage, "uuid": r.uuid} for r in report.passes if r.enabled],
        "compiled": section,
        "timings": report.timings,
        "counters": report.counters.as_dict(),
        "files": file_hashes(tmp),
    }
    _write_manifest(tmp, manifest)
    tmp.chmod(0o755)
    return manifest, report


def _write_manifest(tmp: Path, manifest: dict) -> None:
    """Seal `manifest` (its fields_sha256, of every other field) and write it into `tmp`."""
    manifest.pop("fields_sha256", None)
    manifest["fields_sha256"] = seal(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _reseal(tmp: Path, manifest: dict, timings: dict[str, float]) -> dict:
    """The manifest in `tmp` written again with the files under TRITON_KERNELS and `timings`."""
    shipped = tmp / TRITON_KERNELS
    hashes = file_hashes(shipped) if shipped.is_dir() else {}
    files = {f"{TRITON_KERNELS}/{rel}": digest for rel, digest in hashes.items()}
    manifest = {**manifest, "files": {**manifest["files"], **files}, "timings": dict(timings)}
    _write_manifest(tmp, manifest)
    return manifest


def _save_quantized_ranks(model: CausalLM, model_dir: Path, config: CompileConfig, tmp: Path) -> None:
    """Rank 0's quantized projections (`model`), then each other tensor-parallel rank's, loaded and quantized one at
    a time: every rank's file, so that no rank quantizes at load."""
    save_quantized(model, tmp / quantized_file(0))
    size = config.tensor_parallel_size
    for rank in range(1, size):
        with fake_process_group(size):
            share = load_model(model_dir, config.device, config.dtype, quantization=config.quantization,
                               shard=Shard(rank, size))
        save_quantized(share, tmp / quantized_file(rank))
        del share


def _quantization(model_dir: Path, config: CompileConfig, model: CausalLM) -> dict | None:
    """The scheme and each linear layer's format, or None for an unquantized model."""
    scheme = model_scheme(model_dir, config.quantization)
    if scheme is None:
        return None
    file = None if scheme.from_checkpoint else QUANTIZED_FILE
    return {"scheme": asdict(scheme), "description": scheme.describe(), "file": file, "layers": layer_schemes(model)}


def _ship_cpu_kernels(cache: Path, shipped: Path) -> None:
    """Keep the compiled C++ kernels of a private Inductor cache, in its layout; drop the rest."""
    for library in cache.rglob("*.so"):
        dest = shipped / library.relative_to(cache)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(library, dest)
    shutil.rmtree(cache)


def _replace(tmp: Path, out: Path) -> None:
    if out.exists():
        trash = _temporary(out, "old-")
        os.rename(out, trash / "old")
        os.rename(tmp, out)
        _remove(trash)
    else:
        os.rename(tmp, out)
