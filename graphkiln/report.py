"""Human-readable output of the CLI: compile progress on stderr, the compile summary, the manifest table."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

TOKENIZER_KINDS = {
    "snapshot": "snapshot in the artifact (loads without transformers)",
    "transformers": "transformers, from the model directory",
    None: "none (token-id prompts only)",
}
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]"


class ProgressDisplay:
    """Called as progress(stage, done, total): tqdm bars on a terminal, plain lines elsewhere.

    A stage starts at its first call and ends when `done` reaches `total` (or the next stage
    starts). Off a terminal (a log file, a pipe) a stage prints one line when it starts and one
    with its seconds when it ends, and never a carriage return, so logs read line by line.
    """

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty()
        self.stage: str | None = None
        self.done = self.total = 0
        self.started: float | None = None  # None once the stage has ended
        self.bar: tqdm | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if stage != self.stage:
            self._end()
            self._begin(stage, total)
        elif self.started is None:
            return  # a late update of a stage that already ended
        self.done, self.total = done, total
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)
        if done >= total:
            self._end()

    def _begin(self, stage: str, total: int) -> None:
        self.stage, self.started = stage, time.perf_counter()
        if self.terminal:
            self.bar = tqdm(total=total, desc=f"{stage:<12}", file=self.stream, bar_format=BAR_FORMAT)
        else:
            self._line(f"{stage} {_count(0, total)}...")

    def _end(self) -> None:
        if self.started is None:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            seconds = time.perf_counter() - self.started
            self._line(f"{self.stage}: {_count(self.done, self.total)}done in {seconds:.2f} s")
        self.started, self.bar = None, None

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Stop drawing; a stage left unfinished (an error follows on stderr) gets no end line."""
        if self.bar is not None:
            self.bar.close()
        self.started, self.bar = None, None


def _count(done: int, total: int) -> str:
    return f"{done}/{total} " if total > 1 else ""


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def compile_summary(manifest: dict, report, out: Path, wall_s: float) -> dict:
    compiled = manifest["compiled"]
    return {
        "artifact": str(out),
        "model": manifest["model"]["source"],
        "architecture": manifest["model"]["architecture"],
        "device": manifest["config"]["device"],
        "dtype": manifest["config"]["dtype"],
        "pieces": len(compiled["pieces"]),
        "unique_pieces": len(compiled["unique_pieces"]),
        "sizes_compiled": sorted({s for p in compiled["unique_pieces"].values() for s in p["sizes"]}),
        "counters": report.counters.as_dict(),
        "timings_s": {k: round(v, 3) for k, v in manifest["timings"].items()},
        "wall_s": round(wall_s, 3),
        "artifact_bytes": _dir_bytes(out),
        "dump_dir": manifest["config"].get("dump_dir"),
    }


def format_compile_summary(s: dict) -> str:
    """The summary table: stage times in the order the stages ran (the trace-to-Inductor "total" is left to
    --json), then the wall time of the whole command."""
    rows = [
        ("artifact", s["artifact"]),
        ("model", f"{s['model']} ({s['architecture']}, {s['dtype']}, {s['device']})"),
        ("pieces", f"{s['pieces']} ({s['unique_pieces']} unique) + {s['counters']['attention_pieces']} attention"),
        ("sizes compiled", ", ".join(map(str, s["sizes_compiled"])) or "dynamic only"),
        ("Inductor compiles", str(s["counters"]["inductor_compiles"])),
        *((f"time {k}", f"{v:.2f} s") for k, v in s["timings_s"].items() if k != "total"),
        ("wall time", f"{s['wall_s']:.2f} s"),
        ("artifact size", f"{s['artifact_bytes'] / 2**20:.1f} MiB"),
        ("dumps", s["dump_dir"] or "none (use --dump-dir)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _layer_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _quantization_lines(quant: dict | None) -> list[str]:
    """The scheme, then each linear layer's format, decoder layers with the same format on one line."""
    if not quant:
        return ["quantization  none"]
    stored = f", weights in {quant['file']}" if quant.get("file") else ""
    lines = [f"quantization  {quant['description']}{stored}"]
    groups: dict[tuple[str, str], list[int]] = {}
    for name, scheme in quant["layers"].items():
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            groups.setdefault((".".join(parts[3:]), scheme), []).append(int(parts[2]))
        else:
            lines.append(f"  {name:<36} {scheme}")
    for (name, scheme), layers in groups.items():
        lines.append(f"  {'layers ' + _layer_ranges(layers) + ' ' + name:<36} {scheme}")
    return lines


def format_manifest(m: dict, root: Path) -> str:
    env, model, cfg, engine, compiled = m["environment"], m["model"], m["config"], m["engine"], m["compiled"]
    lines = [
        f"artifact      {root}",
        f"format        {m['format_version']}",
        f"built with    graphkiln {env['graphkiln']}, torch {env['torch']}, triton {env['triton']}, python {env['python']}",
        f"device        {env['device']['type']} {env['device']['name']} ({env['device']['capability']})",
        f"model         {model.get('source')} ({model['architecture']}), config sha256 {model['config_sha256'][:12]}",
        "weights       " + ", ".join(f"{w['file']} ({w['size'] / 2**20:.1f} MiB)" for w in model["weights"]),
        f"tokenizer     {TOKENIZER_KINDS[model.get('tokenizer')]}",
        f"dtype         {cfg['dtype']}",
        *_quantization_lines(model.get("quantization")),
        f"tensor parallel {cfg.get('tensor_parallel_size', 1)} rank(s), one set of pieces for all",
        f"specialized   {cfg['specialize_sizes'] or 'none (dynamic only)'}",
        f"decode graphs {engine['decode_batch_sizes']} (default; load can change it)",
        f"prefill graphs {engine['prefill_token_buckets']} (default; load can change it)",
        "",
        f"{'submodule':<12} {'kind':<10} {'piece key':<18} sizes",
    ]
    for name, attn in compiled["submodules"]:
        if attn:
            lines.append(f"{name:<12} {'attention':<10} {'-':<18} eager")
        else:
            key = compiled["pieces"][name]
            sizes = compiled["unique_pieces"][key]["sizes"]
            lines.append(f"{name:<12} {'piece':<10} {key:<18} dynamic" + (f" + {sizes}" if sizes else ""))
    return "\n".join(lines)


def format_checkpoint(found: dict) -> str:
    """`graphkiln inspect MODEL_DIR`: the model, its weight files and quantization as graphkiln reads them."""
    cfg = found["config"]
    files = found["weight_files"]
    lines = [
        f"checkpoint    {found['checkpoint']} (a model directory: compile-model makes an artifact of it)",
        f"model         {cfg['architecture']}: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_heads']} heads of {cfg['head_dim']}, {cfg['num_kv_heads']} KV heads, MLP {cfg['intermediate_size']}, "
        f"vocabulary {cfg['vocab_size']}",
        f"weights       {len(files)} file(s), {sum(files.values()) / 2**30:.2f} GiB",
        *_quantization_lines(found["quantization"]),
    ]
    return "\n".join(lines)


def format_load_stats(load) -> str:
    """`generate --verbose`: LLM.stats().load as one line per stage, seconds."""
    lines = ["load breakdown (s):"]
    if load.import_s is not None:
        lines.append(f"  import      {load.import_s:7.3f}")
    for stage, seconds in load.stages.items():
        extra = f"  {load.weight_bytes / 1e9:.3f} GB at {load.weights_gb_per_s:.2f} GB/s" if stage == "weights" else ""
        lines.append(f"  {stage:<11} {seconds:7.3f}{extra}")
    lines.append(f"  load total  {load.load_s:7.3f}")
    for name, value in (("first token", load.first_token_s), ("graphs ready", load.prepare_s)):
        lines.append(f"  {name:<11} {value:7.3f} after load started" if value is not None else f"  {name}: not yet")
    return "\n".join(lines)
