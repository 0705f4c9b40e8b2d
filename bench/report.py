"""The one report writer: a main-run result JSON as markdown and a plot, the history table's rows
(bench/results/HISTORY.md), and the plain text tables the studies print.

    python -m bench report bench/results/2026-11-29-nvidia-h200-run10-1b.json   # markdown on stdout
    python -m bench report --latest bench/results --write --plot               # .md and .png beside it
    python -m bench report --history RUN.json ...                              # HISTORY.md rows

Standard library only (matplotlib for the plot, optional).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .common import device_slug, read_results
from .models import DESCRIPTIONS

ROWS = {  # JSON row name -> label, in table order
    "floor": "bandwidth floor",
    "transformers_eager": "transformers eager",
    "transformers_static": "transformers static cache + compile",
    "graphkiln_eager": "graphkiln eager (reference)",
    "graphkiln_compiled": "graphkiln compiled + CUDA graphs",
}
TRANSFORMERS = ("transformers_eager", "transformers_static")
GRAPHKILN = ("graphkiln_eager", "graphkiln_compiled")
TARGETS = (  # from the performance issue: model, what, (kind, key), goal, unit, note
    ("8b", "decode batch 1", ("decode", "1"), 4.35, "ms/token", "<= 1.15x floor"),
    ("1b", "decode batch 1", ("decode", "1"), 1.0, "ms/token", ""),
    ("1b", "decode batch 64", ("decode", "64"), 1.6, "ms/step", ""),
    ("1b", "prefill 128 tokens", ("prefill", "128"), 2.0, "ms", ""),
    ("8b", "prefill 128 tokens", ("prefill", "128"), 5.0, "ms", ""),
    ("1b", "warm start to first token", ("start", "warm_s"), 10.0, "s", ""),
    ("1b", "cold start (compile) to first token", ("start", "cold_s"), 60.0, "s", ""),
)
DEFINITIONS = (
    "Decode ms/token = (generate time − time to first token) / (new tokens − 1) for random prompts, EOS "
    "ignored; at batch B a step makes B tokens, so it is ms per step. Prefill: batch 1; graphkiln = time to "
    "first token with max_tokens=1, transformers = one forward. Floor = max(bytes / copy rate, FLOPs / matmul "
    "rate), both measured in the same run; bytes = weights read per step (an untied input embedding table is "
    "only gathered from) + KV read at the mean decode context; the issue's all-weights floor at batch 1 is in "
    "the JSON (`issue_floor_ms_per_token`). Start = from process start to the first token in a fresh process "
    "(cold: compile with empty Inductor/Triton caches; warm: load the artifact, CUDA graph capture included). "
    "† transformers static: its first generate call, which compiles."
)


# Reading a result.


def value(row: dict | None, kind: str, key: str) -> float | None:
    """decode ms/token at batch `key`, prefill ms at length `key`, start seconds (`key` cold_s or warm_s)."""
    part = (row or {}).get(kind) or {}
    if kind == "decode":
        return (part.get(key) or {}).get("ms_per_token")
    return (part.get(key) or {}).get("ms") if kind == "prefill" else part.get(key)


def columns(results: dict, mres: dict) -> tuple[list[str], list[str]]:
    settings = (results.get("meta") or {}).get("settings") or {}
    batches = [str(b) for b in settings.get("batches") or []]
    lens = [str(n) for n in settings.get("prefill_lens") or []]
    for row in mres.get("rows", {}).values():  # rows can hold more (a --static-batches beyond --batches)
        batches += [b for b in row.get("decode") or {} if b not in batches]
        lens += [n for n in row.get("prefill") or {} if n not in lens]
    return sorted(batches, key=int), sorted(lens, key=int)


def _keys(batches: list[str], lens: list[str]) -> list[tuple[str, str]]:
    starts = [("start", "cold_s"), ("start", "warm_s")]
    return [("decode", b) for b in batches] + [("prefill", n) for n in lens] + starts


def _ratio(a: float | None, b: float | None) -> float | None:
    ok = a is not None and b is not None and b > 0 and math.isfinite(a) and math.isfinite(b)
    return a / b if ok else None


def add_ratios(results: dict) -> None:
    """Each graphkiln figure over the floor and over the best transformers row, stored per model."""
    for mres in results.get("models", {}).values():
        rows = mres.get("rows", {})
        out = {}
        for name in (n for n in GRAPHKILN if n in rows):
            r: dict = {"vs_floor": {}, "vs_best_transformers": {}}
            for kind, key in _keys(*columns(results, mres)):
                v = value(rows[name], kind, key)
                floor = value(rows.get("floor"), kind, key) if kind != "start" else None
                best = min((x for x in (value(rows.get(t), kind, key) for t in TRANSFORMERS) if x is not None),
                           default=None)
                r["vs_floor"][f"{kind}:{key}"] = _ratio(v, floor)
                r["vs_best_transformers"][f"{kind}:{key}"] = _ratio(v, best)
            out[name] = r
        mres["ratios"] = out


def fmt(v, digits: int = 3) -> str:
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "—"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"


def _skip_or_err(error) -> str:
    return "skip" if str(error).startswith("skipped") else "err"


def _cell(row: dict, kind: str, key: str) -> str:
    """A value, or 'err' / 'skip' where the row recorded why it has none."""
    v = value(row, kind, key)
    if v is not None:
        return fmt(v)
    part = row.get(kind) or {}
    cell = (part.get("cold" if key == "cold_s" else "warm") or part) if kind == "start" else part.get(key)
    return _skip_or_err(cell["error"]) if isinstance(cell, dict) and cell.get("error") else "—"


def row_cells(key: str, row: dict, batches: list[str], lens: list[str], mark: str) -> list[str]:
    """Decode, prefill, start cold and warm (transformers static: its first call, marked), graph pool MiB."""
    cells = [_cell(row, "decode", b) for b in batches] + [_cell(row, "prefill", n) for n in lens]
    if key == "transformers_static" and row.get("first_call_s") is not None:
        cells += [fmt(row["first_call_s"]) + mark, "—"]
    elif key in ("floor", "transformers_static"):
        cells += ["—", "—"]
    else:
        cells += [_cell(row, "start", "cold_s"), _cell(row, "start", "warm_s")]
    pool = row.get("graph_pool_bytes")
    return cells + [fmt(pool / 2**20) if isinstance(pool, (int, float)) else "—"]


def label(key: str, row: dict) -> str:
    if not row.get("error") or key == "floor":
        return ROWS.get(key, key)
    return ROWS.get(key, key) + (" (skipped)" if _skip_or_err(row["error"]) == "skip" else " (error)")


def ratio_cells(ratios: dict, batches: list[str], lens: list[str]) -> list[str]:
    return ["—" if (r := ratios.get(f"{k}:{n}")) is None else f"{r:.2f}×" for k, n in _keys(batches, lens)]


def model_title(name: str, mres: dict, dtype: str) -> str:
    b = mres.get("bytes") or {}
    params = b.get("params") or 0
    count = f"{params / 1e9:.3f} B" if params >= 1e8 else f"{params / 1e6:.3f} M"
    size = f"{b.get('weight_bytes_all', 0) / 2**30:.3g} GiB {dtype}"
    return f"{name}: {DESCRIPTIONS.get(name, 'tiny smoke shapes')} ({count} params, {size})"


def target_rows(results: dict) -> list[list[str]]:
    out = []
    models = results.get("models") or {}
    for model, what, (kind, key), goal, unit, note in TARGETS:
        if model not in models:
            continue
        rows = models[model].get("rows") or {}
        v = value(rows.get("graphkiln_compiled"), kind, key)
        goal_text = f"≤ {fmt(goal)} {unit}" + (f" ({note})" if note else "")
        floor = value(rows.get("floor"), kind, key) if model == "8b" and kind == "decode" else None
        if floor is not None:
            goal_text += f"; 1.15 × measured floor = {fmt(1.15 * floor)}"
        out.append([model, what, "—" if v is None else f"{fmt(v)} {unit}", goal_text,
                    "—" if v is None else ("yes" if v <= goal else "no")])
    return out


def errors(results: dict):
    for e in results.get("errors") or []:
        yield f"{e.get('where')}: {e.get('error')}"
    for name, mres in (results.get("models") or {}).items():
        for key, row in (mres.get("rows") or {}).items():
            where = f"{name} / {ROWS.get(key, key)}"
            if row.get("error"):
                yield f"{where}: {row['error']}"
            for kind in ("decode", "prefill", "start"):
                for k, cell in (row.get(kind) or {}).items():
                    if isinstance(cell, dict) and cell.get("error"):
                        yield f"{where} / {kind} {k}: {cell['error']}"
            if isinstance((row.get("start") or {}).get("error"), str):
                yield f"{where} / start: {row['start']['error']}"


# Writing it.


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in body)]


def to_markdown(results: dict) -> str:
    meta, hw = results.get("meta") or {}, results.get("hardware") or {}
    settings = meta.get("settings") or {}
    dirty = " (uncommitted changes)" if meta.get("git_dirty") else ""
    lines = [f"# graphkiln benchmark: {meta.get('device_name', '?')}, {meta.get('date', '?')}", "",
             f"commit `{meta.get('git_commit', 'unknown')}`{dirty}; torch {meta.get('torch')}, "
             f"triton {meta.get('triton')}, transformers {meta.get('transformers')}, "
             f"graphkiln {meta.get('graphkiln')}, "
             f"Python {meta.get('python')}"
             + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "")]
    if hw:
        lines.append(f"measured here: copy {hw['copy_bandwidth_Bps'] / 1e12:.3f} TB/s (read + write, "
                     f"{hw['copy_bytes'] / 2**30:.3g} GiB, median of 10), {settings.get('dtype_name', '')} matmul "
                     f"{hw['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({hw['matmul_n']}³, median of 10)")
    lines += [f"decode: {settings.get('prompt_len')} prompt tokens, {settings.get('new_tokens')} new tokens; graphkiln "
              f"buckets: decode {settings.get('decode_buckets')}, prefill {settings.get('prefill_buckets')}."]
    if settings.get("quantization"):
        lines.append(f"graphkiln compiled with --quantization {settings['quantization']}: its row and the floor; "
                     "the other rows unquantized.")
    lines.append("")
    for name, mres in (results.get("models") or {}).items():
        lines += _model_markdown(results, name, mres, settings.get("dtype_name", ""))
    if targets := target_rows(results):
        lines += ["## Targets (from the issue)", ""]
        lines += markdown_table(["model", "what", "graphkiln compiled", "goal", "met"], targets) + [""]
    if errs := list(errors(results)):
        lines += ["## Errors and skipped rows", ""] + [f"- {e}" for e in errs] + [""]
    lines += [DEFINITIONS, ""]
    bytecode = meta.get("bytecode") or {}
    if bytecode.get("state", "present") != "present":
        lines += [f"Python bytecode of the installed packages was {bytecode['state']} before any timing "
                  f"({bytecode.get('seconds', 0):.0f} s), as `pip install` does; this machine's image ships none.", ""]
    return "\n".join(lines)


def _model_markdown(results: dict, name: str, mres: dict, dtype: str) -> list[str]:
    rows = mres.get("rows") or {}
    batches, lens = columns(results, mres)
    header = ["row", *(f"decode b={b} ms/tok" for b in batches), *(f"prefill {n} ms" for n in lens),
              "start→1st tok cold s", "warm s", "graph pool MiB"]
    body = [[label(k, rows[k])] + row_cells(k, rows[k], batches, lens, "†") for k in ROWS if k in rows]
    lines = [f"## {model_title(name, mres, dtype)}", ""] + markdown_table(header, body) + [""]
    ratios = mres.get("ratios") or {}
    if ratios:
        rb = [[f"{ROWS[k]} ÷ {word}"] + ratio_cells(ratios[k][which], batches, lens) for k in GRAPHKILN if k in ratios
              for which, word in (("vs_floor", "floor"), ("vs_best_transformers", "best transformers"))]
        lines += markdown_table(["graphkiln ÷", *(f"b={b}" for b in batches), *(f"prefill {n}" for n in lens), "cold",
                                 "warm"], rb) + [""]
    if startup := start_rows(rows):
        lines += ["start-up in a fresh process, seconds (to the first token):", ""]
        lines += markdown_table(["row", "import torch", "import API", "CUDA init", "compile", "load", "of it: weights",
                                 "import Inductor", "pieces", "rest", "first token", "total", "capture (background)"],
                                startup) + [""]  # fmt: skip
    return lines + [f"- {x}" for x in _notes(rows)] + [""]


def start_rows(rows: dict) -> list[list[str]]:
    """The phases of each start-up child: import torch (from process start), import of the API (graphkiln's or
    transformers'), CUDA init, compile (cold), load (graphkiln's split into weights, the Inductor import, pieces
    and the rest), first token, total; then graphkiln's graph capture, which runs in the background after load."""
    out = []
    for key, which in (("transformers_eager", None), ("graphkiln_compiled", "cold"), ("graphkiln_compiled", "warm")):
        start = (rows.get(key) or {}).get("start") or {}
        child = start.get(which) if which else start
        if not isinstance(child, dict) or "phases_s" not in child:
            continue
        p = child["phases_s"]
        out.append([f"{ROWS[key]}{' ' + which if which else ''}"] + [fmt(p.get(k)) for k in (
            "import_torch", "import_api", "cuda_init", "compile", "load", "weights", "inductor", "pieces", "load_rest",
            "first_token")]
                   + [fmt(child.get("start_to_first_token_s")), fmt(p.get("capture"))])
    return out


def _notes(rows: dict) -> list[str]:
    out = []
    comp = rows.get("graphkiln_compiled") or {}
    cold = (comp.get("start") or {}).get("cold") or {}
    if cold.get("compile_summary"):
        out.append(f"graphkiln compile_model in the cold process: {cold['compile_summary']}")
    graphs = (comp.get("stats") or {}).get("graphs") or {}
    if graphs:
        out.append("graphkiln CUDA graphs (LLM.stats(); graph pool column = their sum): " + "; ".join(
            f"{kind} {g['graphs']} graphs of sizes {g['sizes']}, {g['pool_bytes'] / 2**20:.0f} MiB, captured in "
            f"{g['capture_s']:.1f} s" for kind, g in graphs.items()))
    if (without := (comp.get("stats") or {}).get("steps_without_graph")):
        out.append(f"graphkiln steps run without a graph: {without}")
    for key in GRAPHKILN:
        if check := (rows.get(key) or {}).get("check"):
            out.append(f"{ROWS[key]} logits vs transformers: relative error {check['rel_err']:.2e}, argmax agreement "
                       f"{check['argmax_agreement']:.3f}")
    if (floor := (rows.get("floor") or {}).get("issue_floor_ms_per_token")) is not None:
        out.append(f"issue's floor (all weight bytes / copy rate): {floor:.3f} ms/token")
    return out


def text_table(rows: list[list], columns: list[str] | None = None) -> str:
    """Rows of cells (or of dicts, with `columns`) as text columns: numbers right-aligned; text left-aligned
    in the first column and in columns of dicts that hold text."""
    left = {0}
    if columns:
        left = {i for i, c in enumerate(columns) if any(isinstance(r.get(c), str) for r in rows)}
        rows = [columns] + [[r.get(c) for c in columns] for r in rows]
    cells = [[c if isinstance(c, str) else fmt(c, 4) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def plot(results: dict, path: Path) -> bool:
    """Decode ms/token against batch size for every row, one panel per model. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models, meta = results.get("models") or {}, results.get("meta") or {}
    if not models:
        return False
    colors = {"transformers_eager": "tab:blue", "transformers_static": "tab:orange", "graphkiln_eager": "tab:green",
              "graphkiln_compiled": "tab:red"}
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (name, mres) in zip(axes[0], models.items()):
        rows = mres.get("rows") or {}
        batches, _ = columns(results, mres)
        for key, text in ROWS.items():
            pts = [(int(b), v) for b in batches if (v := value(rows.get(key), "decode", b)) is not None]
            if pts:
                style = dict(linestyle="--", color="black") if key == "floor" else dict(marker="o", color=colors[key])
                ax.plot(*zip(*pts), label=text, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([int(b) for b in batches], batches)
        ax.minorticks_off()
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("decode ms per token (per step)")
        ax.set_title(model_title(name, mres, (meta.get("settings") or {}).get("dtype_name", "")), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"graphkiln vs transformers: {meta.get('device_name')}, {meta.get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


HISTORY_HEADER = ["date", "commit", "device", "model", "decode b=1", "b=8", "b=32", "b=64", "prefill 128", "1024",
                  "4096", "start warm s", "cold s", "÷ floor b=1", "run"]


def history_rows(path: Path) -> list[list[str]]:
    """One HISTORY.md row per model of a result JSON: graphkiln compiled's figures (ms; start in s)."""
    results = read_results(path)
    meta = results.get("meta") or {}
    add_ratios(results)
    run = Path(path).stem.removeprefix(f"{meta.get('date')}-{device_slug(meta)}-")  # "run10-1b"
    out = []
    for name, mres in (results.get("models") or {}).items():
        row = (mres.get("rows") or {}).get("graphkiln_compiled")
        ratio = ((mres.get("ratios") or {}).get("graphkiln_compiled") or {}).get("vs_floor", {}).get("decode:1")
        commit = str(meta.get("git_commit", "unknown"))[:8]
        out.append([meta.get("date", "?"), commit, meta.get("device_name", "?"), name,
                    *(fmt(value(row, "decode", b)) for b in ("1", "8", "32", "64")),
                    *(fmt(value(row, "prefill", n)) for n in ("128", "1024", "4096")),
                    fmt(value(row, "start", "warm_s")), fmt(value(row, "start", "cold_s")),
                    "—" if ratio is None else f"{ratio:.2f}×", run])
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("json", nargs="*", type=Path, help="result JSON(s) of `python -m bench run`")
    p.add_argument("--latest", metavar="DIR", type=Path, help="the newest main-run JSON in DIR (e.g. bench/results)")
    p.add_argument("--write", action="store_true", help="write the .md beside the JSON")
    p.add_argument("--plot", action="store_true", help="write the .png beside the JSON (needs matplotlib)")
    p.add_argument("--history", action="store_true", help="print HISTORY.md rows for the JSONs given")


def main(a: argparse.Namespace) -> int:
    paths = list(a.json)
    if a.latest:
        found = sorted((p for p in a.latest.glob("*.json") if "models" in read_results(p)),
                       key=lambda p: (p.stat().st_mtime, p.name))
        if not found:
            raise SystemExit(f"no main-run result JSON in {a.latest}")
        paths.append(found[-1])
    if not paths:
        raise SystemExit("give a result JSON or --latest DIR")
    if a.history:
        print("\n".join(markdown_table(HISTORY_HEADER, [r for p in paths for r in history_rows(p)])))
        return 0
    for path in paths:
        results = read_results(path)
        add_ratios(results)
        md = to_markdown(results)
        if a.write:
            path.with_suffix(".md").write_text(md)
        if a.plot and not plot(results, path.with_suffix(".png")):
            print("plot skipped: matplotlib is not installed", file=sys.stderr)
        print(md)
    return 0
