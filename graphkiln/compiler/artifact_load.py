"""Reading an artifact directory: every check first (the manifest, its signature, the files' sha256s, the
environment, the passes, the model files), then the weights, the tokenizer and the compiled pieces, under a
shared lock on the artifact so that no compile replaces it meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from graphkiln.compat import import_inductor
from graphkiln.checks import torch_device
from graphkiln.errors import ArtifactError
from graphkiln.kernels.shipped import TRITON_KERNELS
from graphkiln.models import resolve_dtype
from graphkiln.models.config import ModelConfig
from graphkiln.models.fingerprint import model_fingerprint
from graphkiln.models.kernel_loads import calls_triton, launch_eager_kernels
from graphkiln.models.linear import import_kernels
from graphkiln.models.loader import empty_model, fill_model
from graphkiln.models.quant_scheme import QuantScheme
from graphkiln.models.sharding import Shard
from graphkiln.models.switch_interval import load_switch_interval, lowered_switch_interval
from graphkiln.models.tokenizer import Tokenizer
from graphkiln.models.transformer import CausalLM
from graphkiln.models.weights_reader import indexed
from graphkiln.passes.pipeline import default_passes
from graphkiln.timing import Stopwatch

from .artifact_dir import locked
from .artifacts import TOKENIZER_FILE, load_compiled, quantized_file
from .compiled_model import CompiledModel
from .manifest import FIX, MANIFEST, REWRITE, check_environment, check_files, read_manifest

log = logging.getLogger(__name__)


def check_artifact(
    out: Path, model_dir: Path, device: str | None = None, dtype: str | None = None, trusted_keys: Sequence = (),
    unread: frozenset[str] = frozenset(),
) -> dict:
    """Every check a load needs, without loading anything; returns the manifest. With `trusted_keys`
    (signing.load_public_keys) the manifest's signature is checked first. `unread`: files this process will not
    read (the other tensor-parallel ranks' quantized weights), whose presence alone is checked."""
    manifest = read_manifest(out, trusted_keys)
    config = manifest["config"]
    if device is not None and torch_device(device).type != config["device"]:
        raise ArtifactError(f"{out}: compiled for device {config['device']!r}, asked for {device!r}; {FIX}")
    if dtype is not None and resolve_dtype(dtype) != resolve_dtype(config["dtype"]):
        raise ArtifactError(f"{out}: compiled for dtype {config['dtype']!r}, asked for {dtype!r}; {FIX}")
    check_environment(manifest, config["device"])
    check_files(manifest, out, already_read=unread)
    check_passes(manifest, out)
    recorded = manifest["model"]
    now = model_fingerprint(model_dir)
    for field in ("config_sha256", "weights", "tokenizer_files"):
        if recorded[field] != now[field]:
            raise ArtifactError(
                f"{out}: model files in {model_dir} differ from those compiled ({field} changed); {FIX}"
            )
    return manifest


def check_passes(manifest: dict, out: Path) -> None:
    """Every built-in pass the artifact records must be this graphkiln's pass of that name, source for source
    (its uuid): a graph rewritten by other pass code may call ops this code no longer has. Passes given
    to compile_model by name only the caller knows are left to the caller."""
    here = {p.name: p.uuid() for p in default_passes()}
    for recorded in manifest["passes"]:
        name, uuid = recorded.get("name"), recorded.get("uuid")
        if name in here and uuid != here[name]:
            raise ArtifactError(f"{out / MANIFEST}: pass {name} has changed since this artifact was compiled; {FIX}")


def recorded_config(manifest: dict, out: Path) -> ModelConfig:
    """The ModelConfig compile-model read from config.json (whose sha256 the manifest checked)."""
    try:
        return ModelConfig.from_dict(manifest["model"]["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{out / MANIFEST}: field model.config is missing or invalid ({e!r}); {REWRITE}") from e


def recorded_scheme(manifest: dict, out: Path) -> QuantScheme | None:
    """The quantization scheme compile-model found or applied, or None."""
    recorded = manifest["model"].get("quantization")
    try:
        return QuantScheme(**recorded["scheme"]) if recorded else None
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{out / MANIFEST}: field model.quantization is invalid ({e!r}); {REWRITE}") from e


def _fill_on(device: torch.device, model: CausalLM, model_dir: Path, clock: Stopwatch) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fill_model(model, model_dir, clock)


@contextlib.contextmanager
def _weights_beside(model: CausalLM, model_dir: Path, clock: Stopwatch, switch_interval: float | None,
                    kernels: bool = False, warm_rows: tuple[int, ...] = (), shipped: Path | None = None
                    ) -> Iterator[None]:  # fmt: skip
    """Read the weights into `model` on a thread of their own while the block runs (stage "weights"), under
    the lowered switch interval so that the reading threads wait less for the interpreter lock; done at exit.
    With `kernels`, another thread imports the kernels meanwhile (then the only thread to import triton: two
    importing it at once could deadlock; `shipped`: the artifact's Triton kernels, installed by it first), and
    this one makes its cuBLAS handle, which its eager steps use. A third thread launches the eager model's
    kernels at `warm_rows` (kernel_loads.py; after the kernels' import where the model's projections call
    Triton)."""
    device = _device(model)
    with (
        lowered_switch_interval(switch_interval),
        ThreadPoolExecutor(3, thread_name_prefix="graphkiln-fill") as pool,
    ):
        weights = pool.submit(_fill_on, indexed(device), model, model_dir, clock)
        jobs = [pool.submit(import_kernels, device, shipped)] if kernels else []
        after = jobs[0] if jobs and calls_triton(model) else None
        if warm_rows:
            jobs.append(pool.submit(_launch_after, after, model, warm_rows))
        if kernels and device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.current_blas_handle()
        yield
        weights.result()
        for job in jobs:
            job.result()


@contextlib.contextmanager
def _running(job: Callable[[], None] | None) -> Iterator[None]:
    """`job` on a thread of its own while the block runs; done at exit, also where the block raises."""
    if job is None:
        yield
        return
    with ThreadPoolExecutor(1, thread_name_prefix="graphkiln-ahead") as pool:
        done = pool.submit(job)
        yield
        done.result()


def _launch_after(imported: Future | None, model: CausalLM, rows: tuple[int, ...]) -> None:
    """The launches, after the kernels' import where given; a launch that fails is logged, not raised: the
    engine's first calls then load what it did not, and report what is wrong with the model themselves."""
    if imported is not None:
        imported.result()
    try:
        launch_eager_kernels(model, rows)
    except Exception as e:  # noqa: BLE001  (an optimisation: the load goes on without it)
        log.warning("launching the eager model's kernels beside the weights failed (%s: %s); the first calls "
                    "load them instead", type(e).__name__, e)


def read_artifact(
    out: Path, model_dir: Path, device=None, dtype=None, trusted_keys: Sequence = (), clock: Stopwatch | None = None,
    shard: Shard = Shard(),
) -> tuple[CausalLM, CompiledModel, Tokenizer | None, dict]:
    """Check, then load weights (`shard`: one tensor-parallel rank's), compiled pieces and the tokenizer: no
    Dynamo trace, no Inductor compile, and no transformers import where the artifact keeps a tokenizer snapshot.
    The weights are read on a thread of their own while the tokenizer and Inductor are imported and the pieces
    load (they bind the parameters, not their values). `clock` gets the stages checks, weights (with the count
    weight_bytes), tokenizer, inductor (importing it, which is torch's cost) and pieces; weights overlap the
    three after them."""
    out = out.resolve()
    clock = clock or Stopwatch()
    with locked(out, shared=True):
        manifest, model = _checked_model(out, model_dir, device, dtype, trusted_keys, clock, shard)
        with _weights_beside(model, model_dir, clock, load_switch_interval()):
            with clock.stage("tokenizer"):
                tokenizer = read_tokenizer(manifest, out, model_dir)
            compiled = _read_pieces(out, manifest, model, clock, shipped=out / TRITON_KERNELS)
        return model, compiled, tokenizer, manifest


def read_weights(
    out: Path, model_dir: Path, device=None, dtype=None, trusted_keys: Sequence = (), clock: Stopwatch | None = None,
    warm_rows: tuple[int, ...] = (), ahead: Callable[[], None] | None = None,
) -> tuple[CausalLM, Tokenizer | None, dict, Callable[[], CompiledModel]]:
    """Check, then load the weights and the tokenizer but not the compiled pieces, for an engine that serves
    eagerly until they are in (`load` with background capture): the weights are read on a thread of their own
    beside the tokenizer and the kernels' import, with no Inductor import beside them. The pieces come from the
    returned function (on a background thread), which imports Inductor and checks the manifest and the code
    files again first (not the weights, read already), since the artifact may have been compiled anew
    meanwhile. `clock` gets checks, weights and tokenizer now, inductor and pieces when the function runs.
    `warm_rows`: the row counts at which the eager model's kernels are launched beside the weights (the engine's
    first calls'), so that those calls find them loaded; `ahead`, the caller's own work that needs neither the
    model nor the checks, runs on a thread of its own from the start, done before this returns or raises."""
    out = out.resolve()
    clock = clock or Stopwatch()
    switch_interval = load_switch_interval()  # a bad setting is the caller's error, not the background job's
    threads = torch.get_num_threads()  # per thread in torch: the job's thread takes the caller's
    with _running(ahead), locked(out, shared=True):
        manifest, model = _checked_model(out, model_dir, device, dtype, trusted_keys, clock, Shard())
        with (_weights_beside(model, model_dir, clock, switch_interval, kernels=True, warm_rows=warm_rows,
                              shipped=out / TRITON_KERNELS), clock.stage("tokenizer")):  # fmt: skip
            tokenizer = read_tokenizer(manifest, out, model_dir)

    def pieces() -> CompiledModel:
        with locked(out, shared=True):
            if read_manifest(out, trusted_keys) != manifest:
                raise ArtifactError(f"{out}: the artifact changed while it was loading; load it again")
            ranks = manifest["config"].get("tensor_parallel_size", 1)  # the code, not the weights again
            check_files(manifest, out, already_read=frozenset(quantized_file(rank) for rank in range(ranks)))
            torch.set_num_threads(threads)  # Inductor's CPU kernels are keyed by it: else they would build again
            # (under the preparation's switch interval; the shipped kernels were installed beside the weights)
            return _read_pieces(out, manifest, model, clock)

    return model, tokenizer, manifest, pieces


def _checked_model(out: Path, model_dir: Path, device, dtype, trusted_keys: Sequence, clock: Stopwatch,
                   shard: Shard) -> tuple[dict, CausalLM]:  # fmt: skip
    """The checked manifest and the model its weights will fill (allocated, not read)."""
    with clock.stage("checks"):
        others = frozenset(quantized_file(rank) for rank in range(shard.size) if rank != shard.rank)
        manifest = check_artifact(out, model_dir, device, dtype, trusted_keys, others)
        config = manifest["config"]
        model_config = recorded_config(manifest, out)
        scheme = recorded_scheme(manifest, out)
    quantized = out / quantized_file(shard.rank) if config.get("quantization") else None
    return manifest, empty_model(model_dir, torch.device(config["device"]), config["dtype"], model_config, scheme,
                                 quantized, shard)  # fmt: skip


def _device(model: CausalLM) -> torch.device:
    return next(model.parameters()).device


def _read_pieces(out: Path, manifest: dict, model: CausalLM, clock: Stopwatch,
                 shipped: Path | None = None) -> CompiledModel:  # fmt: skip
    """The compiled pieces bound to `model`'s parameters (importing Inductor first: its own stage); `shipped`:
    the artifact's Triton kernels, to install first where the load has not."""
    with clock.stage("inductor"):
        try:
            import_inductor()
        except (ImportError, RuntimeError, AttributeError):  # another thread's import deadlocked with this one
            import_inductor()
    with clock.stage("pieces"):
        import_kernels(_device(model), shipped)
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        return load_compiled(manifest["compiled"], manifest["files"], out, tensors)


def read_tokenizer(manifest: dict, out: Path, model_dir: Path) -> Tokenizer | None:
    """The artifact's tokenizer snapshot where it keeps one, else the model directory's tokenizer."""
    if manifest["model"].get("tokenizer") == "snapshot":
        try:
            return Tokenizer.from_snapshot(model_dir, out / TOKENIZER_FILE)
        except Exception as e:  # noqa: BLE001 (the tokenizers library raises plain Exceptions)
            raise ArtifactError(f"{out / TOKENIZER_FILE}: the tokenizer snapshot cannot be read ({e}); {FIX}") from e
    return Tokenizer.from_dir(model_dir)
