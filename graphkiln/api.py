"""graphkiln.compile_model and graphkiln.load: compile once into an artifact directory, start fast later;
graphkiln.cached_artifact: the same through a cache folder keyed by model and config (`serve --compile`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from graphkiln.cache_dir import cache_root
from graphkiln.compat import pin_triton_environment
from graphkiln.kernels.shipped import TRITON_KERNELS, ship_loaded_kernels
from graphkiln.compiler.artifact_dir import write_artifact
from graphkiln.compiler.artifact_load import check_artifact, read_artifact, read_tokenizer, read_weights
from graphkiln.compiler.compile import CompileReport, Progress
from graphkiln.compiler.config import CompileConfig
from graphkiln.compiler.manifest import MANIFEST, REWRITE, read_manifest, recorded_source
from graphkiln.compiler.signing import KeySource, load_private_key, load_public_keys
from graphkiln.errors import ArtifactError, ConfigError, ModelFileError
from graphkiln.llm import LLM, is_hub_id, resolve_model_dir
from graphkiln.models.fingerprint import model_fingerprint
from graphkiln.models.sharding import Shard
from graphkiln.runtime.builder import build_engine
from graphkiln.runtime.capture_pause import captures_paused
from graphkiln.runtime.config import EngineConfig, engine_config
from graphkiln.runtime.gc_pauses import collections_deferred
from graphkiln.runtime.stats import LoadStats
from graphkiln.runtime.warmup import first_call_sizes, sampler_ahead
from graphkiln.timing import Stopwatch
from graphkiln.runtime.tensor_parallel import parallel_engine
from graphkiln.version import __version__

IMPORTED = time.perf_counter()  # with graphkiln.IMPORT_STARTED: what importing the API cost
KERNEL_BUILDS_TIMEOUT_S = 600.0
log = logging.getLogger(__name__)


def compile_model(
    model: str | Path,
    out: str | Path,
    config: CompileConfig | None = None,
    *,
    engine: EngineConfig | None = None,
    force: bool = False,
    sign_key: KeySource | None = None,
    progress: Progress = lambda stage, done, total: None,
    build_kernels: bool = True,
) -> tuple[dict, CompileReport]:
    """Compile a model directory, a hub id in the local cache, or "tiny" into the artifact directory `out`;
    returns (manifest, report).

    `engine` is recorded as the artifact's default EngineConfig (capture sizes, KV cache, ...), which
    `load` starts from. `force` replaces an existing artifact at `out`, never anything else.
    `sign_key` (an Ed25519 private key PEM: path or bytes) signs the manifest, for
    `load(..., trusted_keys=...)`. `build_kernels` (on CUDA, one rank): load the artifact once, as a
    server would, so that graphkiln's Triton kernels for its buckets are in this machine's Triton cache
    when it first starts here (`build_serving_kernels`), and carry them in the artifact for a first start
    on another machine of the same kind (kernels/shipped.py).
    """
    config = config or CompileConfig()
    key = load_private_key(sign_key) if sign_key is not None else None
    model_dir = resolve_model_dir(model)
    source = str(model) if str(model) == "tiny" or is_hub_id(model) else str(model_dir.resolve())
    defaults = engine_config(engine).to_dict()
    if config.device == "cuda":  # before Inductor's first kernel: the serving kernels below, and a server's, alike
        pin_triton_environment()
    serving = build_kernels and config.device == "cuda" and config.tensor_parallel_size == 1
    # (`compiling`: Inductor's autotuning draws CUDA random numbers: none beside an engine's capture)
    return write_artifact(model_dir, source, Path(out), config, defaults, force=force, sign_key=key, progress=progress,
                          compiling=captures_paused, finish=partial(_ship_serving_kernels, progress=progress)
                          if serving else None)  # fmt: skip


def _ship_serving_kernels(artifact: Path, progress: Progress) -> dict[str, float]:
    """Build the serving kernels of the artifact in `artifact` and put them into it (TRITON_KERNELS)."""
    progress("serving kernels", 0, 1)
    seconds = build_serving_kernels(artifact)
    try:
        shipped = ship_loaded_kernels(artifact / TRITON_KERNELS)
    except (OSError, AttributeError, TypeError) as e:  # (Triton's internals moved: the artifact is sound without)
        shipped = 0
        shutil.rmtree(artifact / TRITON_KERNELS, ignore_errors=True)  # (no entry half copied)
        log.warning("%s: copying graphkiln's Triton kernels into the artifact failed (%s: %s); a first start on "
                    "another machine builds them", artifact, type(e).__name__, e)  # fmt: skip
    progress("serving kernels", 1, 1)
    log.info("%s: %d Triton kernel cache entries of graphkiln's shipped", artifact, shipped)
    return {"serving_kernels": seconds}


def build_serving_kernels(out: Path, timeout_s: float = KERNEL_BUILDS_TIMEOUT_S) -> float:
    """Load the artifact at `out` once and wait until its every graph is prepared, then close it; the seconds
    it took. Triton builds a kernel the first time a process launches it with new specializations and keeps
    it in its cache on disk: a first start whose cache lacks graphkiln's kernels at the artifact's buckets
    builds them while it serves (seconds longer to the first token, and steps slowed beside the builds), a
    later one reads them. The KV cache holds just the largest decode bucket, so that a server running on the
    same device keeps the memory it may still need. Best effort: a failure is logged, and the first start
    builds what is missing."""
    start = time.perf_counter()
    try:
        engine = recorded_engine(read_manifest(out), out)
        tokens = engine.block_size * max(engine.decode_batch_sizes, default=1)
        with load(out, kv_cache_tokens=tokens) as llm:
            if not (llm.wait_compiled(timeout_s) and llm.wait_ready(timeout_s)):  # (pieces that fail to load raise)
                log.warning("%s: the serving kernels were still building after %.0f s; the first start here "
                            "builds the rest", out, timeout_s)  # fmt: skip
            failed = [f"{p.kind} {p.key}: {p.error}" for p in llm.stats().prepared if p.error]
            if failed:
                log.warning("%s: preparing these buckets after the compile failed, so their kernels may be "
                            "missing at the first start: %s", out, "; ".join(failed))  # fmt: skip
    except Exception as e:  # noqa: BLE001  (the artifact is written and sound without this)
        log.warning("%s: loading the artifact to build its serving kernels failed (%s: %s); the first start "
                    "here builds them", out, type(e).__name__, e)  # fmt: skip
    return time.perf_counter() - start


def cached_artifact(
    model: str | Path, config: CompileConfig | None = None, *, progress: Progress = lambda stage, done, total: None
) -> Path:
    """The artifact of `model` compiled with `config` in graphkiln's cache, compiled on first use:
    `cache_root()/artifacts/<key>`, the key a hash of the model's identity (its files, not their folder),
    the CompileConfig and the graphkiln and torch versions. A moved model keeps its artifact; load it with
    `load(path, model=MODEL_DIR, on_mismatch="recompile")`, which rebuilds one gone stale in place."""
    config = config or CompileConfig()
    identity = {"model": model_fingerprint(resolve_model_dir(model)), "config": asdict(config),
                "graphkiln": __version__, "torch": torch.__version__}  # fmt: skip
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    out = cache_root() / "artifacts" / key
    if not (out / MANIFEST).is_file():
        _writable_cache(out.parent)
        try:
            compile_model(model, out, config, progress=progress, build_kernels=False)  # (the caller loads it next)
        except ArtifactError:
            if not (out / MANIFEST).is_file():  # not another process's compile of the same key, finished first
                raise
    return out


def _writable_cache(folder: Path) -> None:
    """Make the cache's artifact folder, or name the setting to change (a failed compile would name -o)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(folder, os.W_OK | os.X_OK) else "not writable"
    except OSError as e:
        problem = e.strerror
    if problem:
        raise ConfigError(f"{folder}: graphkiln's compile cache cannot be written there ({problem}); set "
                          "GRAPHKILN_CACHE_DIR to a writable folder")


def load(
    out: str | Path,
    *,
    model: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    on_mismatch: str = "error",
    engine: EngineConfig | None = None,
    trusted_keys: Sequence[KeySource] | None = None,
    **options,
) -> LLM:
    """Load an artifact directory into an LLM without tracing or compiling.

    `model` overrides where the weights are (default: the directory recorded at compile time).
    `device`/`dtype`, when given, must match the artifact. `on_mismatch="recompile"` recompiles
    a stale artifact in place instead of raising. The engine starts from `engine`, else from the
    EngineConfig the artifact records; `options` override single fields (decode_batch_sizes,
    kv_cache_tokens, attention_backend, ...).
    Artifacts contain executable code: load only those you would run the compiling code for, or
    pass `trusted_keys` (Ed25519 public key PEMs: paths or bytes) to refuse any artifact not signed
    by one of them, before anything in it is unpickled or loaded.
    An artifact compiled with `tensor_parallel_size=N` starts N-1 more processes here, one per GPU (or CPU
    rank); under torchrun, every rank but 0 serves rank 0's steps and then exits the program.
    """
    start = time.perf_counter()
    clock = Stopwatch()
    if on_mismatch not in ("error", "recompile"):
        raise ConfigError(f"on_mismatch={on_mismatch!r}; use 'error' or 'recompile'")
    if trusted_keys is not None and on_mismatch == "recompile":
        raise ConfigError("trusted_keys with on_mismatch='recompile': a recompiled artifact is unsigned; use one of them")
    keys = load_public_keys(trusted_keys) if trusted_keys is not None else ()
    out = Path(out)
    manifest = read_manifest(out, keys)
    serving = engine_config(recorded_engine(manifest, out) if engine is None else engine, **options)
    source = model if model is not None else recorded_source(manifest, out)
    model_dir = resolve_model_dir(source)
    if model is None and not model_dir.is_dir():
        raise ModelFileError(
            f"{model_dir}: the model directory {out / MANIFEST} names (model.source) is gone; if the weights "
            "moved, load with graphkiln.load(OUT, model=NEW_DIR) or `graphkiln generate OUT --model NEW_DIR`"
        )
    if manifest["config"].get("tensor_parallel_size", 1) > 1:
        return _load_parallel(out, source, model_dir, device, dtype, on_mismatch, keys, trusted_keys, serving, manifest)
    pieces = None
    try:
        with collections_deferred():  # no collection pauses among the load's imports (runtime/gc_pauses.py)
            if serving.capture == "background":  # serve eagerly until the pieces are in
                decode_sizes, prefill_size = first_call_sizes(serving)
                first_rows = (*decode_sizes, prefill_size)  # the engine's first calls'
                net, tokenizer, manifest, pieces = read_weights(out, model_dir, device, dtype, keys, clock, first_rows,
                                                                ahead=sampler_ahead(manifest, device))  # fmt: skip
                compiled = None
            else:
                net, compiled, tokenizer, manifest = read_artifact(out, model_dir, device, dtype, keys, clock)
    except ArtifactError:
        if on_mismatch == "error":
            raise
        with clock.stage("recompile"):
            _recompile(source, out, manifest, device, dtype)
        clock = Stopwatch({"recompile": clock.stages["recompile"]})
        net, compiled, tokenizer, manifest = read_artifact(out, model_dir, device, dtype, clock=clock)
    with clock.stage("engine"):
        engine = build_engine(net, compiled, serving, pieces=pieces)
    llm = LLM(engine, tokenizer, manifest.get("counters"))
    llm.manifest = manifest
    llm.load_stats = LoadStats(_import_seconds(), clock.stages, clock.counts.get("weight_bytes", 0),
                               time.perf_counter() - start, started=start)  # fmt: skip
    return llm


def _import_seconds() -> float:
    from graphkiln import IMPORT_STARTED

    return IMPORTED - IMPORT_STARTED


def _recompile(source, out: Path, manifest: dict, device, dtype) -> None:
    """Compile `source` into `out` again, with the CompileConfig and engine defaults the stale artifact records."""
    config = CompileConfig(**{**_config_fields(manifest["config"]), **_overrides(device, dtype)})
    compile_model(source, out, config, engine=recorded_engine(manifest, out), force=True, build_kernels=False)


def _load_parallel(out: Path, source, model_dir: Path, device, dtype, on_mismatch: str, keys: Sequence,
                   trusted_keys, serving: EngineConfig, manifest: dict) -> LLM:  # fmt: skip
    """A tensor-parallel artifact, checked (or recompiled) before any other rank starts; each rank then loads
    its own shard and the same pieces (checking the artifact, against `trusted_keys` too, itself)."""
    try:
        manifest = check_artifact(out.resolve(), model_dir, device, dtype, keys)
    except ArtifactError:
        if on_mismatch == "error":
            raise
        _recompile(source, out, manifest, device, dtype)
        manifest = check_artifact(out.resolve(), model_dir, device, dtype)
    tokenizer = read_tokenizer(manifest, out, model_dir)  # before the ranks start: a failure leaves none behind
    load_rank = partial(_artifact_rank, out, model_dir, device, dtype, tuple(trusted_keys or ()))
    engine = parallel_engine(manifest["config"]["tensor_parallel_size"], manifest["config"]["device"], load_rank,
                             serving)  # fmt: skip
    llm = LLM(engine, tokenizer, manifest.get("counters"))
    llm.manifest = manifest
    return llm


def _artifact_rank(out: Path, model_dir: Path, device, dtype, trusted_keys: tuple, shard: Shard):
    """One tensor-parallel rank's weights and compiled pieces (each rank checks the artifact itself)."""
    keys = load_public_keys(trusted_keys) if trusted_keys else ()
    net, compiled, _, _ = read_artifact(out, model_dir, device, dtype, keys, shard=shard)
    return net, compiled


def recorded_engine(manifest: dict, root: Path) -> EngineConfig:
    """The EngineConfig compile-model recorded as the artifact's serving defaults."""
    try:
        return EngineConfig.from_dict(manifest["engine"])
    except (ConfigError, TypeError) as e:
        raise ArtifactError(f"{root / MANIFEST}: section 'engine' is invalid ({e}); {REWRITE}") from e


def _config_fields(recorded: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()}


def _overrides(device, dtype) -> dict:
    return {k: str(v).removeprefix("torch.") for k, v in (("device", device), ("dtype", dtype)) if v is not None}
