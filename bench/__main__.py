"""`python -m bench COMMAND ...`: one subcommand per module; heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

COMMANDS = {  # command -> (module, one line of help)
    "run": ("run", "graphkiln vs transformers vs the bandwidth floor (the main run)"),
    "report": ("report", "markdown, plot or HISTORY.md rows from a run's JSON"),
    "kernels": ("kernels", "the kernels of one decode graph replay (and of a short prefill) by name"),
    "products": ("products", "weight products at 1 and 128 rows: cuBLAS, the Triton GEMV, Inductor"),
    "quantized": ("quantized", "fp8 and int4 weight products vs bf16 and each format's bytes floor, tile sweeps"),
    "tiles": ("tiles", "GEMV tilings tried inside the real decode graph"),
    "attention": ("attention", "Triton attention kernels vs SDPA and the copy rate"),
    "resources": ("resources", "registers, spills, shared memory and waves of our Triton kernels, compiled without a GPU"),
    "serving": ("serving", "decode and long prefill at serving shapes, per attention backend, vs the floor"),
    "passes": ("passes", "each optional graph pass on and off"),
    "bf16-ties": ("bf16_ties", "where bfloat16 greedy tokens differ between eager and compiled (CPU)"),
    "serve": ("serve", "graphkiln serve over HTTP at concurrency 1/16/64 against the offline engine"),
    "steps": ("steps", "each engine step beside the background preparation, with every thread's stack in slow ones"),
    "startup": ("startup", "start-up breakdown in fresh processes: import, weights, pieces, capture, first token"),
    "weights": ("weights", "safetensors weights from the page cache to the device: graphkiln's reader vs safe_open"),
    "tp-share": ("tp_share", "whether tensor-parallel ranks compiled on their own produce the same code"),
    "tp-memory": ("tp_memory", "peak host memory of loading one tensor-parallel rank against the whole model"),
    "tp-all-reduce": ("tp_all_reduce", "the all-reduce alone on 2 GPUs: symm_mem one-shot vs NCCL by message size"),
    "aoti-load": ("aoti_load", "whether an AOTInductor package loads and runs without importing Inductor or Dynamo"),
    "tp-decode": ("tp_decode", "decode and prefill at TP 1 and TP 2, with NCCL's all-reduces and symm_mem_all_reduce"),
    "tp-parity": ("tp_parity", "each family's model at TP 2 against TP 1: logits and greedy tokens over 64 prompts"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_startup"]:  # a start-up child of `run`: nothing imported before it starts timing
        from .startup import child_main

        child_main(json.loads(argv[1]))
        return 0
    if argv[:1] == ["_weights"]:  # a read beside the Inductor import in a fresh process (bench/weights.py)
        from .weights import child_main as weights_child

        weights_child(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="graphkiln's benchmark harness (bench/README.md)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.set_defaults(module=module)
        if argv[:1] == [name]:  # import only the command asked for
            importlib.import_module(f"bench.{module}").add_arguments(p)
    a = parser.parse_args(argv)
    return importlib.import_module(f"bench.{a.module}").main(a) or 0


if __name__ == "__main__":
    sys.exit(main())
