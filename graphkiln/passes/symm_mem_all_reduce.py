"""symm_mem_all_reduce: a small all-reduce becomes PyTorch's symmetric-memory one-shot all-reduce.

A post-grad pass, off by default (`CompileConfig(enabled_passes=("symm_mem_all_reduce",))`), for CUDA
artifacts of 2+ tensor-parallel ranks in float32 or bfloat16. In compiles specialized to a token count
(`CompileConfig.specialize_sizes`: the decode batch sizes) it rewrites every
`wait_tensor(_c10d_functional.all_reduce(x, "sum", group))` whose message is at most `max_bytes` into
`symm_mem.one_shot_all_reduce_copy(buffer, x, "sum", group)`, `buffer` an `empty` of x's shape. Inductor
makes that buffer a symmetric-memory buffer (`comm_lowering.py`: `_maybe_realize_symm_mem`, a persistent
`empty_strided_p2p` per compiled buffer), and the op is one kernel: it copies x into this rank's buffer,
waits for every rank at a barrier on the signal pads, reads and sums every peer's buffer over NVLink
(P2P loads, no multicast), and meets the others at a second barrier before the buffer is reused: no
NCCL kernel. The residual add and the RMSNorm after it stay the one Inductor kernel
they were after NCCL's all-reduce: PyTorch has no kernel that reduces, adds and normalizes in one
(vLLM and SGLang take FlashInfer's for that), so this is the all-reduce half of that fusion.

What PyTorch 2.11-2.13 offer and why the pass writes the op itself: Inductor lowers
`_c10d_functional.all_reduce` to `one_shot_all_reduce` on its own (`comm_lowering.py`,
`_should_lower_as_one_shot_all_reduce`) only under `config._collective.auto_select` (off by default),
for a group registered with the deprecated `enable_symm_mem_for_group`, for messages up to
`_collective.one_shot_all_reduce_threshold_bytes` (128 KiB), and only when Inductor allocates the
input itself (`can_realize_as_comm_buffer`). Here the input is the output of graphkiln::linear, a
custom op that allocates its own result, so that lowering never applies; the `_copy` variant takes
any input. A comm buffer needs a size known at compile time (`realize_as_comm_buffer` refuses a
symbolic one), so the dynamic compile keeps NCCL; and the kernel is built for float32 and bfloat16
only. `fx_passes/micro_pipeline_tp.py` fuses all-gather + matmul and matmul + reduce-scatter, never
an all-reduce. The runtime keeps NVLink multicast off for the ranks (`compat.symm_mem_multicast_off`).
A persistent buffer, and its rendezvous with the peers, last as long as the process: an artifact
compiled with this pass is loaded once per process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphkiln.compat import functional_all_reduce_ops, one_shot_all_reduce_copy
from graphkiln.errors import ConfigError

from .base import PostGradPass

NAME = "symm_mem_all_reduce"
DTYPES = (torch.float32, torch.bfloat16)  # the one-shot kernel's dispatch
DTYPE_NAMES = ("float32", "bfloat16")


@dataclass(frozen=True)
class SymmMemAllReduceConfig:
    """`max_bytes`: the largest message rewritten (Inductor's own one-shot threshold)."""

    max_bytes: int = 128 * 1024


def check_compile_config(device: str, dtype: str, tensor_parallel_size: int, specialize_sizes: tuple[int, ...]) -> None:
    """A ConfigError where the pass cannot apply: it would do nothing, or compile code that cannot run."""
    problems = []
    if device != "cuda":
        problems.append(f"device={device!r} (symmetric memory is CUDA's; on the CPU gloo all-reduces)")
    if tensor_parallel_size < 2:
        problems.append(f"tensor_parallel_size={tensor_parallel_size} (one rank traces no all-reduce)")
    if dtype not in DTYPE_NAMES:
        problems.append(f"dtype={dtype!r} (the one-shot kernel takes {' and '.join(DTYPE_NAMES)})")
    if not specialize_sizes:
        problems.append("no specialize_sizes (only compiles of a fixed token count can hold a symmetric buffer)")
    if problems:
        raise ConfigError(
            f"CompileConfig.enabled_passes names {NAME}, which cannot apply with " + "; ".join(problems)
            + ": compile for CUDA, 2+ ranks, float32 or bfloat16, with the decode batch sizes in specialize_sizes, "
            "or leave the pass out"
        )


def _static_bytes(value: torch.Tensor) -> int | None:
    """The bytes of a tensor of a shape known at compile time, else None."""
    if not all(isinstance(d, int) for d in value.shape):
        return None
    return value.numel() * value.element_size()


class SymmMemAllReduce(PostGradPass):
    name = NAME
    default_devices = ()

    def __init__(self, config: SymmMemAllReduceConfig = SymmMemAllReduceConfig()) -> None:
        self.config = config

    def _rewritable(self, node: torch.fx.Node, all_reduce, wait) -> bool:
        if node.op != "call_function" or node.target is not all_reduce or node.args[1] != "sum":
            return False
        value = node.args[0].meta["val"]
        size = _static_bytes(value)
        return (
            size is not None and 0 < size <= self.config.max_bytes and value.dtype in DTYPES
            and value.is_contiguous() and all(u.target is wait for u in node.users)
        )  # fmt: skip

    def __call__(self, graph: torch.fx.Graph) -> int:
        all_reduce, wait = functional_all_reduce_ops()
        copy_reduce = one_shot_all_reduce_copy()
        matches = 0
        for node in list(graph.nodes):
            if not self._rewritable(node, all_reduce, wait):
                continue
            x, _, group = node.args
            value = x.meta["val"]
            with graph.inserting_before(node), value.fake_mode:
                options = {"dtype": value.dtype, "device": value.device}
                buffer = graph.call_function(torch.ops.aten.empty.memory_format, (list(value.shape),), options)
                buffer.meta["val"] = torch.empty(value.shape, **options)
                reduced = graph.call_function(copy_reduce, (buffer, x, "sum", group))
                reduced.meta["val"] = copy_reduce(buffer.meta["val"], value, "sum", group)
            for waited in list(node.users):
                waited.replace_all_uses_with(reduced)
                graph.erase_node(waited)
            graph.erase_node(node)
            matches += 1
        return matches
