"""Whether a compiled graph can load and run without importing Inductor or Dynamo: the route to a start
that pays only `import torch`. A study for issue-sized work, not a path graphkiln takes today.

A two-layer MLP that ends in a mutating custom op (as graphkiln's pieces end in attention) is
exported and compiled by AOTInductor into a package, then loaded in fresh processes through
torch's C++ loader (`torch._C._aoti.AOTIModelPackageLoader`) and run at three row counts (the row
dimension is dynamic). The op is registered in the loading process either as
`torch.library.custom_op` (what graphkiln's ops are) or through the lower-level
`torch.library.Library` define/impl. Each child reports `import torch`, the package load, the first
and a later run, whether the result matches the eager module, and whether Inductor, Dynamo or sympy
were imported.

    python -m bench aoti-load --smoke --out /tmp/aoti     # CPU (a C++ compiler builds the package)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time

from .common import Study, add_study_arguments, log
from .report import text_table

OP = "bench_aoti::scale_into"
REGISTRATIONS = {  # how a loading process registers the op, as code run after `import torch`
    "custom_op": f"""
        @torch.library.custom_op("{OP}", mutates_args=("out",))
        def scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
            out.copy_(x * 2)
    """,
    "library": """
        def scale_into(x, out):
            out.copy_(x * 2)

        lib = torch.library.Library("bench_aoti", "DEF")
        lib.define("scale_into(Tensor x, Tensor(a!) out) -> ()")
        lib.impl("scale_into", scale_into, "CompositeExplicitAutograd")
    """,
}
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
{registration}
package, io_path, device = sys.argv[1], sys.argv[2], sys.argv[3]
loader = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, -1)
t2 = time.perf_counter()
io = torch.load(io_path)
x = io["x"].to(device)
first = loader.run([x, torch.empty_like(x)])[0]
if device == "cuda":
    torch.cuda.synchronize()
t3 = time.perf_counter()
for rows in (3, 100):
    y = torch.randn(rows, x.shape[1], device=device)
    loader.run([y, torch.empty_like(y)])
if device == "cuda":
    torch.cuda.synchronize()
t4 = time.perf_counter()
print(json.dumps(dict(import_torch_s=t1 - t0, load_s=t2 - t1, first_run_s=t3 - t2, later_runs_s=t4 - t3,
                      matches=bool(torch.allclose(first.cpu(), io["ref"], atol=1e-4)),
                      inductor="torch._inductor" in sys.modules, dynamo="torch._dynamo" in sys.modules,
                      sympy="sympy" in sys.modules)))
"""


def build(folder, device: str) -> float:
    """Export and AOTInductor-compile the module into folder/model.pt2, with its input and eager output."""
    import torch

    namespace, name = OP.split("::")
    lib = torch.library.Library(namespace, "DEF")
    lib.define(f"{name}(Tensor x, Tensor(a!) out) -> ()")
    lib.impl(name, _scale_into, "CompositeExplicitAutograd")

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)

        def forward(self, x, out):
            torch.ops.bench_aoti.scale_into(self.down(torch.nn.functional.silu(self.up(x))), out)
            return out + x

    module = Mlp().to(device).eval()
    x = torch.randn(8, 256, device=device)
    rows = torch.export.Dim("rows", min=1, max=4096)
    t = time.perf_counter()
    program = torch.export.export(module, (x, torch.empty_like(x)), dynamic_shapes={"x": {0: rows}, "out": {0: rows}})
    torch._inductor.aoti_compile_and_package(program, package_path=str(folder / "model.pt2"))
    seconds = time.perf_counter() - t
    with torch.no_grad():
        torch.save({"x": x.cpu(), "ref": module(x, torch.empty_like(x)).cpu()}, folder / "io.pt")
    del lib  # the children register the op themselves
    return seconds


def _scale_into(x, out) -> None:
    out.copy_(x * 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_study_arguments(p)


def main(a: argparse.Namespace) -> int:
    study = Study.of("aoti-load", a)
    rows = []
    with study.scratch() as folder:
        compile_s = build(folder, study.device)
        log(f"AOTInductor package built in {compile_s:.1f} s")
        for name, registration in REGISTRATIONS.items():
            code = CHILD.format(registration=textwrap.dedent(registration))
            done = subprocess.run([sys.executable, "-c", code, str(folder / "model.pt2"), str(folder / "io.pt"),
                                   study.device], capture_output=True, text=True, timeout=600)
            if done.returncode:
                raise SystemExit(f"the {name} child failed:\n{done.stderr[-3000:]}")
            rows.append({"registration": name, **json.loads(done.stdout.strip().splitlines()[-1])})
    print(text_table(rows, list(rows[0])))
    log(f"wrote {study.save({'compile_s': compile_s, 'rows': rows})}")
    return 0
