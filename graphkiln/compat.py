"""The one place for torch-version differences (2.11 to 2.13) and for reaching into torch/depyf internals.

Every private torch name graphkiln uses is reached through here (rooms import this bottom module,
never `torch._...` themselves):

- Dynamo capture: `mark_dynamic_dim`, `size_oblivious()`, `dynamo_counters()`.
- `to_empty(module, device)`: `Module.to_empty` through `Module._apply`, without torch's meta reference.
- `copy_tensors(dests, sources)`: `torch._foreach_copy_`, many copies in one call (the weights reader
  queues a unit's copies with one release of the interpreter lock).
- Inductor: `standalone_compile`, `load_artifact`, `graph_returns_tuple`, `CustomGraphPass`,
  `is_op_overload`, and the ATen-level `TORCH_LINEAR` a Dynamo graph calls for nn.Linear. Inductor
  and Dynamo are imported where they are used, never by importing this module: importing them costs
  more than a second, which `import graphkiln` does not pay and a load pays in `import_inductor`
  while the weights are read.
- `depyf_debug(dir, log)`: depyf's `prepare_debug`, imported lazily (only dumps need depyf), with
  what depyf prints and warns kept in `log` instead of on the terminal. On torch 2.13
  `PyCodeCache.load_by_key_path` gained the keyword-only `set_sys_modules`, which depyf 0.20's
  replacement does not accept; for the duration of the context we swap in a copy that forwards
  `**kwargs` (as vLLM's depyf_compat does).
- `private_inductor_cache(dir)`: compile-model on the CPU compiles into a private Inductor cache
  and ships the compiled C++ kernels. Loading points Inductor at `artifact_cache(digest)`, a folder
  of the active cache keyed by the digest of the artifact's checked code files, and copies the
  kernels there (`install_cpu_kernels`), so the first load on a fresh machine does not run gcc.
  A shared folder would let one artifact's code run for another: Inductor finds a C++ kernel by
  the hash of its source (not of the library), and an FX graph entry by the hash of the graph,
  taking the first entry of that folder whose guards pass.
- Tensor parallel: `all_reduce_sum` and `all_gather_last_dim`, functional collectives
  (`torch.distributed._functional_collectives`) on the default process group, which a Dynamo
  trace keeps as `_c10d_functional` ops; `fake_process_group(size)`, torch's fake backend, so
  compile-model traces and compiles a rank's graph in one process with no peers.
- Symmetric memory: `functional_all_reduce_ops()` (the `_c10d_functional` all-reduce and its wait, as a
  post-grad graph holds them), `one_shot_all_reduce_copy()` (`symm_mem`'s one-shot all-reduce of a
  local input through a symmetric buffer), `symmetric_empty()` (a tensor in symmetric memory, as
  Inductor allocates the pass's buffers; for the benchmark of the kernel alone), and
  `symm_mem_multicast_off()`, which sets `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, read by the
  symmetric-memory rendezvous, so no rank ever creates an NVLink multicast object.
- `inductor_output_code()`: collects the wrapper code (with every C++/Triton kernel inline) of
  each graph Inductor compiles or loads from its cache, through `GraphLowering.save_output_code`,
  the hook torch's own `run_and_get_code` uses; present and called on cache hits in 2.11-2.13.
- Triton: `warm_triton()` replaces `triton.runtime.cache.triton_key` (Triton 3.x's hash of its own
  sources, looked up by name at each use) with the value kept in graphkiln's cache for the installed
  package's files; left alone where Triton has no such function.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from graphkiln.cache_dir import kept_while_unchanged
from graphkiln.errors import ConfigError

__all__ = [
    "CustomGraphPass", "TORCH_LINEAR", "all_gather_last_dim", "all_reduce_sum", "artifact_cache", "copy_tensors",
    "depyf_debug", "dynamo_counters", "fake_process_group", "forget_vec_isa_checks", "functional_all_reduce_ops",
    "graph_returns_tuple", "import_inductor", "inductor_output_code", "install_cpu_kernels", "is_op_overload",
    "load_artifact", "mark_dynamic_dim", "one_shot_all_reduce_copy", "pin_triton_environment",
    "private_inductor_cache", "require_depyf", "size_oblivious", "standalone_compile", "symm_mem_masked_devices",
    "symm_mem_multicast_off", "symmetric_empty", "to_empty", "warm_triton",
]  # fmt: skip

TORCH_LINEAR = torch._C._nn.linear  # what F.linear and nn.Linear appear as in a Dynamo graph


def __getattr__(name: str):
    """`CustomGraphPass`, imported on first use: importing any of Inductor costs a second or more, which a
    load of an artifact pays only once it loads the compiled pieces (`import_inductor`)."""
    if name == "CustomGraphPass":
        from torch._inductor.custom_graph_pass import CustomGraphPass

        return CustomGraphPass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def import_inductor() -> None:
    """Import what loading and running compiled pieces needs of Inductor (and, through it, Dynamo).

    Dynamo first: the two packages import each other, and a thread that enters through Inductor while
    another enters through Dynamo (anything reading Dynamo's counters, or calling torch.compile) can
    deadlock on their module locks, which Python breaks by handing one a half-initialized module. Entered
    through Dynamo by both, the second thread waits for the first."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401  (the package, standalone_compile and CompiledArtifact with it)


def pin_triton_environment() -> None:
    """Fix, before Inductor or graphkiln builds a Triton kernel, the two settings Inductor would change midway
    through a process, so that every kernel of the process is built and cached alike: a compile-model run
    (Inductor first) then builds graphkiln's kernels under the same cache key and in the same folder as a
    serving process (graphkiln's kernels first), and the serving process finds the ones its compile built.
    Where unset, Inductor points TRITON_CACHE_DIR at a folder of its own when it first makes a Triton kernel,
    and TRITON_PTXAS_PATH at torch's own ptxas when it first compiles one; the ptxas version is part of
    Triton's cache key. Here the cache folder is Triton's default and ptxas torch's, as Inductor would pick;
    a setting the user chose is left as it is."""
    try:
        from triton import knobs
    except ImportError:  # triton is optional
        return
    os.environ.setdefault("TRITON_CACHE_DIR", knobs.cache.dir)
    ptxas = Path(torch.__file__).parent / "bin" / "ptxas"
    if "TRITON_PTXAS_PATH" not in os.environ and ptxas.is_file() and os.access(ptxas, os.X_OK):
        os.environ["TRITON_PTXAS_PATH"] = str(ptxas)


@functools.cache  # once a process, as Triton computes it: a later load does not walk Triton's files again
def warm_triton() -> None:
    """Have Triton's hash of its own sources (its cache key's first part, which a process computes at its first
    kernel launch: tenths of a second hashing its library) ready now, while a load reads the weights, rather
    than in the first step. The hash is kept in graphkiln's cache while the Triton package's files stay as they
    are (cache_dir.kept_while_unchanged), and `triton.runtime.cache.triton_key`, which Triton's launches look up
    by name at each use, returns it."""
    try:
        from triton.runtime import cache
    except ImportError:  # triton is optional
        return
    compute = getattr(cache, "triton_key", None)
    if compute is None:  # its internals move between versions: leave Triton to itself
        return
    key = kept_while_unchanged("triton-key", Path(cache.__file__).parents[1], compute)
    cache.triton_key = lambda: key


def graph_returns_tuple(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor's compiled form of `gm` returns its outputs as they are (not wrapped in a tuple)."""
    from torch._inductor.compile_fx import graph_returns_tuple as returns_tuple

    return returns_tuple(gm)


def to_empty(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`module.to_empty(device=device)`, each tensor allocated with its shape and strides, without the Python
    reference torch runs for `empty_like` of a meta tensor: it imports symbolic shapes and sympy (tenths of
    a second, which Inductor's import pays later anyway) before a load can start reading the weights."""
    return module._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))


def copy_tensors(dests: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool = False) -> None:
    """`dest.copy_(source)` for each pair (any devices and dtypes), in one call."""
    torch._foreach_copy_(dests, sources, non_blocking=non_blocking)


def mark_dynamic_dim(tensor: torch.Tensor, dim: int) -> None:
    """Trace `tensor`'s `dim` as a symbol from the first trace on."""
    import torch._dynamo

    torch._dynamo.mark_dynamic(tensor, dim)


def size_oblivious() -> contextlib.AbstractContextManager:
    """Trace without 0/1 specialization of dynamic sizes, so one graph serves every token count."""
    from torch.fx.experimental import _config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


def dynamo_counters():
    """Dynamo's and Inductor's process-wide event counters (graphs traced, FX graph cache hits/misses)."""
    from torch._dynamo.utils import counters

    return counters


def is_op_overload(target) -> bool:
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def standalone_compile(gm: torch.fx.GraphModule, inputs: list, dynamic_shapes: str, options: dict | None):
    """Inductor-compile one FX graph into a serializable artifact (binary save/load, no Dynamo)."""
    return torch._inductor.standalone_compile(gm, inputs, dynamic_shapes=dynamic_shapes, options=options)


def load_artifact(path: Path):
    """A callable from an Inductor artifact saved with `art.save(path=..., format="binary")`."""
    return torch._inductor.CompiledArtifact.load(path=str(path), format="binary")


def load_by_key_path(key: str, path: str, linemap=None, attrs=None, **kwargs):
    """depyf's patched `PyCodeCache.load_by_key_path`, forwarding keyword-only arguments (torch 2.13)."""
    from depyf.explain.global_variables import data
    from depyf.explain.utils import get_current_compiled_fn_name, write_code_to_file_template

    template = os.path.join(data["dump_src_dir"], get_current_compiled_fn_name() + ".kernel_%s.py")
    copy = write_code_to_file_template(Path(path).read_text(), template)
    return data["unpatched_load_by_key_path"](key, copy, linemap, attrs, **kwargs)


def require_depyf() -> ModuleType:
    """depyf's debugging module, or a ConfigError saying how to install it (call before any work)."""
    try:
        from depyf.explain import enable_debugging
    except ImportError as e:
        raise ConfigError(
            "CompileConfig.dump_dir (--dump-dir) needs depyf, which decompiles Dynamo's bytecode; install the "
            "dump extra: pip install 'graphkiln[dump]'"
        ) from e
    return enable_debugging


@contextlib.contextmanager
def depyf_debug(dump_dir: Path, log: Path) -> Iterator[None]:
    """depyf.prepare_debug(dump_dir) around the call that makes Dynamo trace.

    depyf warns at every use ("You are trying to debug `torch.compile`...") and prints its own
    troubles: its warnings and whatever is printed inside the context go to `log`; anyone else's
    warnings are shown as usual.
    """
    enable_debugging = require_depyf()
    original = enable_debugging.patched_load_by_key_path
    enable_debugging.patched_load_by_key_path = load_by_key_path
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                with enable_debugging.prepare_debug(str(dump_dir)):
                    yield
    finally:
        enable_debugging.patched_load_by_key_path = original
        depyf_dir = str(Path(enable_debugging.__file__).parents[1])  # depyf names its files, or itself, first
        for w in caught:
            if w.filename.startswith(depyf_dir) or str(w.message).startswith(depyf_dir):
                printed.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(printed.getvalue())


@contextlib.contextmanager
def inductor_output_code() -> Iterator[list[str]]:
    """Collect the output code of every graph Inductor compiles or loads inside the context."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    previous = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append
    try:
        yield codes
    finally:
        GraphLowering.save_output_code = previous


@contextlib.contextmanager
def private_inductor_cache(directory: Path) -> Iterator[None]:
    """Point Inductor's on-disk cache, and Triton's inside it, at `directory` for the duration (Inductor's
    in-memory caches are cleared). Triton's is set even where the user chose one: Inductor writes an
    artifact's Triton kernels there, keeping any kernel of the same name already present."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    triton = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(directory / "triton")
    try:
        with temporary_cache_dir(str(directory)):
            yield
    finally:
        if triton is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = triton


def forget_vec_isa_checks() -> None:
    """Make Inductor check the CPU's vector ISAs again, in the cache folder now set. It checks each by compiling
    a small library into its cache folder, and a process remembers the answers (`functools.cache` on the ISA
    classes' methods and on `valid_vec_isa_list`), not the folder. A CPU compile into a private cache after
    another compile or a load in the same process would leave those libraries out of it, and so out of the
    artifact's cpu-kernels/; a fresh process on a machine without a compiler would then find no ISA usable and
    look every kernel up under other keys (compiling them). The AVX-512 check also leaves its answer on the ISA
    objects, which Inductor keeps (`supported_vec_isa_list`): where the CPU has AVX-512 BF16 a second check would
    build with that flag added (twice, for its own probe), so under other keys than a fresh process's; that
    answer is forgotten too."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for isa in vars(cpu_vec_isa).values():
        if isinstance(isa, type) and issubclass(isa, cpu_vec_isa.VecISA):
            for member in vars(isa).values():
                if callable(getattr(member, "cache_clear", None)):
                    member.cache_clear()
    for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", ()):
        vars(isa).pop("_is_avx512_bf16_supported", None)  # back to the class's False


def artifact_cache(digest: str) -> Path:
    """The Inductor cache folder for the compiled code whose checked content has `digest`."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "graphkiln-artifacts" / digest


def install_cpu_kernels(shipped: Path, target: Path) -> None:
    """Copy compiled C++ kernels (`*.so`, laid out as in an Inductor cache) into the cache folder `target`.

    Inductor looks a CPU kernel up by the hash of its source and compile command before running
    the compiler, so kernels compiled on a machine of the same kind load without gcc. Each copy
    replaces what is there (atomically), so only the artifact's own checked files are loaded.
    """
    for library in shipped.rglob("*.so"):
        dest = target / library.relative_to(shipped)
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.{os.getpid()}")
        shutil.copyfile(library, partial)
        os.replace(partial, dest)


def _world_group_name() -> str:
    import torch.distributed as dist

    return dist.group.WORLD.group_name


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the default process group, as a functional collective."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", _world_group_name())


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` side by side along the last dim, rank order, as a functional collective."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # renamed in torch 2.13
    return gather(x, x.dim() - 1, _world_group_name())


@contextlib.contextmanager
def fake_process_group(size: int) -> Iterator[None]:
    """A default process group of `size` ranks (this process rank 0) whose collectives do nothing: compile-model
    traces and compiles one rank's graph with it. A process that already has a default group is refused."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError(
            "compile-model with tensor_parallel_size > 1 compiles in one process, but this process already has a "
            "torch.distributed process group; run compile-model outside torchrun"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def functional_all_reduce_ops() -> tuple:
    """(all_reduce, wait_tensor): the `_c10d_functional` overloads a post-grad graph calls for a functional
    all-reduce and for waiting on its result."""
    ops = torch.ops._c10d_functional
    return ops.all_reduce.default, ops.wait_tensor.default


def one_shot_all_reduce_copy():
    """`symm_mem::one_shot_all_reduce_copy(symm_buffer, local_input, reduce_op, group_name) -> Tensor`."""
    return torch.ops.symm_mem.one_shot_all_reduce_copy.default


def symmetric_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor in symmetric memory; the first symm_mem op on it meets the other ranks' buffers."""
    from torch.distributed import _symmetric_memory

    return _symmetric_memory.empty(shape, dtype=dtype, device=device)


SYMM_MEM_MULTICAST = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


def symm_mem_multicast_off() -> None:
    """Keep this process, and the ranks it starts, from creating NVLink multicast objects when symmetric memory
    meets its peers: a value other than "1" is replaced (with a warning)."""
    if os.environ.get(SYMM_MEM_MULTICAST, "1") != "1":
        warnings.warn(f"{SYMM_MEM_MULTICAST}={os.environ[SYMM_MEM_MULTICAST]!r} replaced by '1': graphkiln never "
                      "uses NVLink multicast", stacklevel=2)  # fmt: skip
    os.environ[SYMM_MEM_MULTICAST] = "1"


SYMM_MEM_OVERLAPPING = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def symm_mem_masked_devices() -> None:
    """Let symmetric memory meet ranks that each see their own GPU as cuda:0. The rendezvous refuses two ranks
    reporting the same device ordinal, which every spawned rank does (CUDA_VISIBLE_DEVICES masks the others);
    the runtime checks instead that the ranks' GPUs differ by UUID (`rank_gpus.check_distinct_gpus`)."""
    os.environ[SYMM_MEM_OVERLAPPING] = "1"
