"""Peak host memory of loading one tensor-parallel rank's weights, against loading the whole model.

A random Llama-shaped float32 checkpoint is written once; then for each case a fresh process
(`python -m bench tp-memory --child CASE`) imports graphkiln, resets its peak resident set, loads
the weights on the CPU (the whole model, or rank r of N through `load_model(..., shard=...)`) and
reports two peaks beside the bytes the rank holds: the resident set (VmHWM), which counts the
pages of the memory-mapped checkpoint the reads touched (page cache, shared by the ranks of one
machine), and the anonymous memory (RssAnon, sampled every millisecond): what the process
allocated. A rank that materialised whole tensors would peak above its share by the largest one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64)  # fmt: skip
PREFIX = "TP-MEMORY "


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here too")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a measuring child: "rank/size"
    p.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)


def _status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _write_checkpoint(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, max_position_embeddings=2048, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        names = {name: p.shape for name, p in LlamaForCausalLM(config).state_dict().items()}
    config.save_pretrained(folder)
    save_file({name: torch.randn(shape) * 0.02 for name, shape in names.items()}, str(folder / "model.safetensors"))


def _child(case: str, model: Path) -> None:
    from graphkiln.models import load_model
    from graphkiln.models.sharding import Shard

    from graphkiln.models.config import model_config_from_hf, read_hf_config

    cfg = model_config_from_hf(read_hf_config(model), model)  # transformers imported before the baseline
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    before, anon_before = _status_bytes("VmRSS"), _status_bytes("RssAnon")
    anon_peak = [anon_before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon_peak[0] = max(anon_peak[0], _status_bytes("RssAnon"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    rank, size = map(int, case.split("/"))
    net = load_model(model, cfg=cfg, shard=Shard(rank, size))
    done.set()
    sampler.join()
    held = sum(t.numel() * t.element_size() for t in {id(p): p for p in net.parameters()}.values())
    print(PREFIX + json.dumps({"case": case, "resident_peak": _status_bytes("VmHWM") - before,
                               "anonymous_peak": anon_peak[0] - anon_before, "held": held}))  # fmt: skip


def main(a) -> int:
    if a.child:
        _child(a.child, a.model)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        _write_checkpoint(model)
        for case in ["0/1", *(f"{r}/{a.ranks}" for r in range(a.ranks))]:
            out = subprocess.run([sys.executable, "-m", "bench", "tp-memory", "--child", case, "--model", str(model)],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            row = json.loads(next(line for line in out.splitlines() if line.startswith(PREFIX))[len(PREFIX):])
            rows.append(row)
            print(f"rank/size {case}: holds {row['held'] / 2**20:.0f} MiB; while loading, anonymous memory peaked "
                  f"{row['anonymous_peak'] / 2**20:.0f} MiB and the resident set {row['resident_peak'] / 2**20:.0f} "
                  "MiB above the start")  # fmt: skip
    result = {"shape": SHAPE, "dtype": "float32", "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return 0
