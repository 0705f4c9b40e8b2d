"""Human-readable output of the CLI: a stderr progress bar, the compile summary, the manifest table."""

from __future__ import annotations

import sys
from pathlib import Path

TOKENIZER_KINDS = {
    "snapshot": "snapshot in the artifact (loads without transformers)",
    "transformers": "transformers, from the model directory",
    None: "none (token-id prompts only)",
}


class ProgressBar:
    """Called as progress(stage, done, total); redraws one stderr line per stage."""

    def __init__(self, enabled: bool = True, width: int = 30) -> None:
        self.enabled = enabled
        self.width = width
        self.stage: str | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if stage != self.stage and self.stage is not None:
            sys.stderr.write("\n")
        self.stage = stage
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{stage:<14} [{bar}] {done}/{total}")
        sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line so whatever follows on stderr starts a line of its own."""
        if self.enabled and self.stage is not None:
            sys.stderr.write("\n")
            self.stage = None


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
    rows = [
        ("artifact", s["artifact"]),
        ("model", f"{s['model']} ({s['architecture']}, {s['dtype']}, {s['device']})"),
        ("pieces", f"{s['pieces']} ({s['unique_pieces']} unique) + {s['counters']['attention_pieces']} attention"),
        ("sizes compiled", ", ".join(map(str, s["sizes_compiled"])) or "dynamic only"),
        ("Inductor compiles", str(s["counters"]["inductor_compiles"])),
        *((f"time {k}", f"{v:.2f} s") for k, v in s["timings_s"].items()),
        ("artifact size", f"{s['artifact_bytes'] / 2**20:.1f} MiB"),
        ("dumps", s["dump_dir"] or "none (use --dump-dir)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_manifest(m: dict, root: Path) -> str:
    env, model, cfg, engine, compiled = m["environment"], m["model"], m["config"], m["engine"], m["compiled"]
    lines = [
        f"artifact      {root}",
        f"format        {m['format_version']}",
        f"built with    graphkiln {env['graphkiln']}, torch {env['torch']}, triton {env['triton']}, python {env['python']}",
        f"device        {env['device']['type']} {env['device']['name']} ({env['device']['capability']})",
        f"model         {model['source']} ({model['architecture']}), config sha256 {model['config_sha256'][:12]}",
        "weights       " + ", ".join(f"{w['file']} ({w['size'] / 2**20:.1f} MiB)" for w in model["weights"]),
        f"tokenizer     {TOKENIZER_KINDS[model.get('tokenizer')]}",
        f"dtype         {cfg['dtype']}",
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
