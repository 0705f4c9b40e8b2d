"""Registers, spills and shared memory of graphkiln's Triton kernels at the tiles their rules pick, and how many
programs a multiprocessor holds and in how many waves a grid runs, compiled by Triton for a GPU target on any
machine: no GPU needed (a minute or so).

    python -m bench resources --out $OUT [--models 1b 8b] [--batches 1 64] [--max-context 8192] [--arch 90]
                              [--decode-variants 64x128x8x2,16x32x4x2] [--prefill-variants 16x64x4x2x4]
                              [--rows 1 8 32]

Per model: the row decode kernel at each batch, planned as the engine plans it for a block table of
`--max-context` tokens (its grid is that plan's, whatever the context), at the last batch also on an fp8 cache
and the block kernel on both caches, the prefill and rope kernels for one prompt of `--prefill-tokens`, and each
projection's products: the bf16 one-row GEMV and, on sm90 and later, its TMA-fed product at each of `--rows` above
one where graphkiln::linear sends it, the int4 one-row byte and dp4a GEMVs, and fp8 (per-channel, on sm90
and later by fp8_tma from 2 rows where N is at least TMA_MIN_N, and 128 x 128 block scales) and int8 (W8A8, W8A16 per
channel and per group) at each of `--rows` as fp8_linear and int8_linear dispatch them, with the kernels around it
(x's quantization or words, a split-K sum). `loop`: the instructions of a kernel's longest loop (`nvdisasm`);
`per_weight`: for the one-row GEMVs, those a thread issues per weight it takes (the loop over the weights a
thread takes a step), the work that bounds a one-row product where the bytes do not. Each
kernel is built through graphkiln's own wrappers on CPU tensors, their launches turned into Triton's warmup
against a stand-in driver that names the target, so the specializations are the ones a launch makes there
(PDL aside: it is decided per CUDA device, and is off here). `ptxas -v`, which Triton ships, counts
registers and spilled bytes; programs a multiprocessor holds are bounded by its registers, warps and shared
memory (Hopper's: 64K registers, 64 warps, 227 KiB); waves = programs / (that x `--sms`). Timings need the
GPU (bench attention, quantized, kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.util
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from .common import environment, log, write_json
from .models import projections, shape_of
from .report import text_table
from .resources_products import bf16_launch, int4_gemv_launch, int8_launches, product_launches

REGISTERS_PER_SM = 65536
WARPS_PER_SM = 64
SHARED_PER_SM = 227 * 1024
# launched around a product by its wrapper
HELPERS = ("_quantize_groups_kernel", "_x_words_kernel")
COLUMNS = ["model", "kernel", "what", "tiles", "grid", "warps", "shared", "registers", "spilled", "per_sm", "waves",
           "loop", "per_weight"]


class _TargetDriver:
    """What Triton's launch path asks of the active driver, for a target without a device."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty


@contextlib.contextmanager
def compiled_for(arch: int) -> Iterator[list]:
    """Within the block, graphkiln's kernel launches compile for sm_<arch> instead of running: each appends
    (kernel name, grid, compiled kernel) to the list yielded."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    import graphkiln.kernels as kernels

    built: list = []

    def build(kernel, grid, *args, **kwargs) -> None:
        built.append((kernel.fn.__name__, grid, kernel.warmup(*args, grid=grid, **kwargs)))

    modules = [m for name in os.listdir(os.path.dirname(kernels.__file__)) if name.endswith(".py")
               for m in [_module(name[:-3])] if hasattr(m, "launch")]
    previous = driver._active  # (reset_active() would look for a GPU)
    driver.set_active(_TargetDriver(GPUTarget("cuda", arch, 32)))
    saved = [(m, m.launch) for m in modules]
    for m in modules:
        m.launch = build
    try:
        yield built
    finally:
        for m, launch in saved:
            m.launch = launch
        driver.set_active(previous)


def _module(name: str):
    return importlib.import_module(f"graphkiln.kernels.{name}")


def ptxas_usage(kernel, arch: int) -> tuple[int, int]:
    """(registers a thread, bytes of local-memory stack, which is where registers spill) of a compiled kernel,
    from `ptxas -v`."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path  # the one Triton assembles this target with (not always bin/ptxas)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    stack = re.search(r"(\d+) bytes cumulative stack size", out)
    return registers, int(stack.group(1)) if stack else 0


def loop_instructions(kernel) -> int | None:
    """Instructions of the compiled kernel's longest loop (a backward branch and what it jumps over), from
    `nvdisasm`, which Triton ships; None without a loop (the one-instruction loop after the exit aside)."""
    import triton

    nvdisasm = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm"))[0]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    addresses, labels, branches = [], {}, []
    for line in text.splitlines():
        if label := re.match(r"\s*(\.L_x_\d+):", line):
            labels[label.group(1)] = len(addresses)
        elif instruction := re.search(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", line):
            if target := re.search(r"BRA\s+`\((\.L_x_\d+)\)", instruction.group(2)):
                branches.append((target.group(1), len(addresses)))
            addresses.append(instruction.group(1))
    spans = [end - labels[name] + 1 for name, end in branches if labels.get(name, end) < end]  # not the self-loop
    return max(spans, default=None)  # after the exit


def occupancy(registers: int, warps: int, shared: int) -> int:
    """Programs a Hopper multiprocessor holds at once: registers (allocated per warp, 8 a thread at a time),
    warps and shared memory."""
    by_registers = REGISTERS_PER_SM // (-(-registers // 8) * 8 * 32 * warps)
    by_shared = SHARED_PER_SM // shared if shared else 32
    return max(0, min(by_registers, WARPS_PER_SM // warps, by_shared, 32))


def decode_launches(model: str, batch: int, max_context: int, variant: tuple[int, int, int, int] | None = None,
                    fp8: bool = False, blocks: bool = False, rope: bool = False,
                    head_dim: int | None = None) -> tuple[str, str]:
    """The decode kernel's launch for `batch` sequences, planned for a table of `max_context` tokens, or at
    `variant` (splits, block_n, warps, stages); on an fp8 cache with its row scales if `fp8`; the block kernel
    (by tensor-descriptor copies) if `blocks`; rotating q and k itself if `rope`; at `head_dim` in place of the
    model's. Its (label, tiles)."""
    import torch

    from graphkiln.kernels.block_decode_attention import block_paged_decode
    from graphkiln.kernels.decode_attention import paged_decode
    from graphkiln.runtime.attention.block_decode import block_decode_tiles, lane_bytes
    from graphkiln.runtime.attention.triton_backend import DecodeTiles, decode_tiles, padded_head_dim

    s = shape_of(model)
    hq, hkv, d, block = s["num_attention_heads"], s["num_key_value_heads"], head_dim or s["head_dim"], 16
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    blocks_count = batch * (max_context // block)
    q = torch.zeros(batch, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(batch, hkv, d, dtype=torch.bfloat16)
    cache = torch.zeros(blocks_count, block, hkv, d, dtype=cache_dtype)
    scales = (torch.ones(blocks_count, block, hkv), torch.ones(blocks_count, block, hkv)) if fp8 else None
    args = (q, k, k.clone(), cache, cache.clone(), torch.full((batch,), 200, dtype=torch.int32),
            torch.arange(blocks_count, dtype=torch.int32).view(batch, -1), torch.zeros(batch, dtype=torch.int64),
            torch.empty_like(q), d ** -0.5, torch.zeros(batch * hkv, dtype=torch.int32))
    label = (f"{'block ' if blocks else ''}decode b={batch}{' fp8 cache' if fp8 else ''}{' rope' if rope else ''}"
             f"{' variant' if variant else ''}")
    if blocks:
        plan = block_decode_tiles(batch, hkv, max_context, block, padded_head_dim(d), lane_bytes(cache_dtype), 132)
        block_paged_decode(*args, num_splits=plan.num_splits, heads=plan.heads, num_warps=plan.num_warps,
                           num_stages=plan.num_stages, scales=scales)
        return label, f"splits={plan.num_splits} heads={plan.heads} stages={plan.num_stages}"
    tiles = (DecodeTiles(*variant) if variant
             else decode_tiles(batch, hkv, max_context, padded_head_dim(d), cache_dtype.itemsize, 132))
    positions = (torch.zeros(max_context, 2 * d), torch.zeros(batch, dtype=torch.int64)) if rope else None
    paged_decode(*args, **asdict(tiles), scales=scales, rope=positions)
    return label, f"splits={tiles.num_splits} block_n={tiles.block_n} stages={tiles.num_stages}"


def prefill_launches(model: str, tokens: int, variant: tuple[int, ...] | None = None) -> tuple[str, str]:
    """The prefill kernel's launch for one prompt of `tokens` tokens at the planned tiles, or at `variant`
    (block_m, block_n, warps, stages[, heads]); its (label, tiles)."""
    import torch

    from graphkiln.kernels.prefill_attention import paged_prefill
    from graphkiln.runtime.attention.triton_backend import (
        PrefillTiles,
        graph_programs,
        prefill_tiles,
        prefill_work,
        work_table,
    )

    s = shape_of(model)
    hq, hkv, d, block = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], 16
    tiles = PrefillTiles(*variant) if variant else prefill_tiles(tokens, d, 2)
    items = prefill_work((tokens,), (tokens,), tiles.block_m)
    q = torch.zeros(tokens, hq, d, dtype=torch.bfloat16)
    cache = torch.zeros(-(-tokens // block), block, hkv, d, dtype=torch.bfloat16)
    paged_prefill(q, cache, cache.clone(), torch.tensor([0, tokens], dtype=torch.int32),
                  torch.tensor([tokens], dtype=torch.int32), torch.arange(cache.shape[0], dtype=torch.int32)[None],
                  torch.tensor(work_table(items), dtype=torch.int32), torch.empty_like(q), d ** -0.5,
                  graph_programs(tokens, len(items), tiles.block_m, hq // tiles.heads, 132), **asdict(tiles))
    return (f"prefill {tokens}{' variant' if variant else ''}",
            f"block_m={tiles.block_m} block_n={tiles.block_n} stages={tiles.num_stages} heads={tiles.heads}")


def rope_launch(model: str, tokens: int) -> tuple[str, str]:
    """The rope kernel's launch on a qkv product's query and key heads for `tokens` tokens; its (label, tiles)."""
    import torch

    from graphkiln.kernels.rope import rope

    s = shape_of(model)
    heads, d = s["num_attention_heads"] + s["num_key_value_heads"], s["head_dim"]
    qkv = torch.zeros(tokens, (heads + s["num_key_value_heads"]) * d, dtype=torch.bfloat16)
    rope(qkv[:, : heads * d].view(tokens, heads, d), torch.zeros(tokens, 2 * d), torch.arange(tokens))
    return f"rope {tokens}", f"heads={heads} head_dim={d}"


def rows_of(model: str, built: list, launch: tuple, arch: int, sms: int) -> list[dict]:
    """One row per kernel one call launched (`built`, emptied after), all under the call's label (launch: label,
    tiles[, weights a thread takes a loop step]); the tiles, and the main loop's instructions per weight where
    given, on the call's main kernel (the first built but its helpers: a quantization before, a split-K sum
    after)."""
    what, tiles, per_thread = (*launch, None)[:3]
    main = next((b[0] for b in built if b[0] not in HELPERS), built[0][0])
    rows = []
    for name, grid, kernel in built:
        registers, spilled = ptxas_usage(kernel, arch)
        warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
        per_sm = occupancy(registers, warps, shared)
        loop = loop_instructions(kernel)
        per_weight = round(loop / per_thread, 2) if loop and per_thread and name == main else None
        rows.append(dict(model=model, kernel=name.strip("_"), what=what, tiles=tiles if name == main else "",
                         grid="x".join(str(g) for g in grid), warps=warps, shared=shared, registers=registers,
                         spilled=spilled, per_sm=per_sm,
                         waves=-(-math.prod(grid) // (per_sm * sms)) if per_sm else None, loop=loop,
                         per_weight=per_weight))
    built.clear()
    return rows


def parse_variants(text: str) -> list[tuple[int, ...]]:
    """'AxBxCxD,...' (decode: splits, block_n, warps, stages; prefill: block_m, block_n, warps, stages[, heads[,
    registers a thread]]) as tuples."""
    return [tuple(int(v) for v in item.lower().split("x")) for item in filter(None, text.split(","))]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="results folder (default $OUT, else the current folder)")
    p.add_argument("--models", nargs="+", default=["1b", "8b"], help="model shapes (default 1b 8b)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="decode batches (default 1 8 64)")
    p.add_argument("--max-context", type=int, default=8192,
                   help="tokens the block table holds, which the decode plan is sized by (default 8192: bench's models)")
    p.add_argument("--decode-variants", default="",
                   help="SPLITSxBLOCK_NxWARPSxSTAGES,...: the decode kernel at the first batch with these tiles too")
    p.add_argument("--prefill-variants", default="",
                   help="BLOCK_MxBLOCK_NxWARPSxSTAGES[xHEADS[xREGISTERS]],...: the prefill kernel with these tiles too")
    p.add_argument("--prefill-tokens", type=int, default=2048,
                   help="the prompt the prefill kernel's row is planned for (default 2048: a chunk's budget)")
    p.add_argument("--rows", type=int, nargs="+", default=[1],
                   help="rows of x for the fp8 and int8 products of each projection (default 1: decode at batch 1)")
    p.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90: H100/H200)")
    p.add_argument("--sms", type=int, default=132, help="multiprocessors of the device (default 132)")
    p.add_argument("--commit", help="git commit to record where the tree has no .git")


def main(a: argparse.Namespace) -> int:
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("bench resources: needs Triton (pip install triton); no GPU needed")
    rows: list[dict] = []
    with compiled_for(a.arch) as built:
        for model in a.models:
            for batch in a.batches:
                rows += rows_of(model, built, decode_launches(model, batch, a.max_context), a.arch, a.sms)
            last = a.batches[-1]
            for fp8, blocks in ((True, False), (False, True), (True, True)):
                rows += rows_of(model, built, decode_launches(model, last, a.max_context, fp8=fp8, blocks=blocks),
                                a.arch, a.sms)
            for variant in parse_variants(a.decode_variants):
                rows += rows_of(model, built, decode_launches(model, a.batches[0], a.max_context, variant), a.arch,
                                a.sms)
            rows += rows_of(model, built, prefill_launches(model, a.prefill_tokens), a.arch, a.sms)
            rows += rows_of(model, built, rope_launch(model, a.prefill_tokens), a.arch, a.sms)
            for variant in parse_variants(a.prefill_variants):
                rows += rows_of(model, built, prefill_launches(model, a.prefill_tokens, variant), a.arch, a.sms)
            for name, (n, k) in projections(model).items():
                for m in sorted({1, *a.rows}):
                    if (bf16 := bf16_launch(name, n, k, m, a.arch)) is not None:
                        rows += rows_of(model, built, bf16, a.arch, a.sms)
                for dp4a in (False, True):
                    rows += rows_of(model, built, int4_gemv_launch(name, n, k, dp4a), a.arch, a.sms)
                for m in a.rows:
                    for block_scales in (False, True):
                        rows += rows_of(model, built, product_launches(name, n, k, m, block_scales, a.arch), a.arch,
                                        a.sms)
                    for scheme in ("w8a8", "w8a16", "w8a16-groups"):
                        rows += rows_of(model, built, int8_launches(name, n, k, m, scheme), a.arch, a.sms)
            log(f"{model}: {len(rows)} kernels compiled")
    print(text_table(rows, COLUMNS))
    out = Path(a.out or os.environ.get("OUT") or ".") / "resources.json"
    meta = {**environment("cpu", a.commit), "arch": a.arch, "sms": a.sms, "max_context": a.max_context}
    log(f"wrote {write_json(out, {'meta': meta, 'kernels': rows})}")
    return 0
