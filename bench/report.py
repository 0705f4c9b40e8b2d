"""Turn a bench/gpu_bench.py result JSON into markdown, a short text table, ratios and a plot.

    python bench/report.py bench/results/2026-11-29-nvidia-h200.json   # markdown on stdout
    python bench/report.py --latest bench/results                     # the newest JSON there
    python bench/report.py --latest bench/results --write --plot      # also write .md and .png beside it

Used by gpu_bench.py after every row; imports nothing heavy (matplotlib only for `plot`, optional).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROWS = (  # JSON name, label; table order
    ("floor", "bandwidth floor"),
    ("transformers_eager", "transformers eager"),
    ("transformers_static", "transformers static cache + compile"),
    ("graphkiln_eager", "graphkiln eager (reference)"),
    ("graphkiln_compiled", "graphkiln compiled + CUDA graphs"),
)
LABELS = dict(ROWS)
COLORS = {"transformers_eager": "tab:blue", "transformers_static": "tab:orange", "graphkiln_eager": "tab:green",
          "graphkiln_compiled": "tab:red"}
TRANSFORMERS = ("transformers_eager", "transformers_static")
GRAPHKILN = ("graphkiln_eager", "graphkiln_compiled")
DESCRIPTIONS = {"1b": "Llama-3.2-1B-like", "8b": "Llama-3.1-8B-like"}
# From the issue. (model, what, how to read it, goal, unit)
TARGETS = (
    ("8b", "decode batch 1", ("decode", "1"), 4.35, "ms/token", "<= 1.15x floor"),
    ("1b", "decode batch 1", ("decode", "1"), 1.0, "ms/token", ""),
    ("1b", "decode batch 64", ("decode", "64"), 1.6, "ms/step", ""),
    ("1b", "prefill 128 tokens", ("prefill", "128"), 2.0, "ms", ""),
    ("1b", "warm start to first token", ("start", "warm_s"), 10.0, "s", ""),
    ("1b", "cold start (compile) to first token", ("start", "cold_s"), 60.0, "s", ""),
)


# ----------------------------------------------------------------------------- reading values


def decode_ms(row: dict | None, batch: str, plain: bool = False) -> float | None:
    cell = ((row or {}).get("decode") or {}).get(batch) or {}
    return cell.get("ms_per_token_plain" if plain else "ms_per_token")


def prefill_ms(row: dict | None, n: str) -> float | None:
    return (((row or {}).get("prefill") or {}).get(n) or {}).get("ms")


def start_s(row: dict | None, which: str) -> float | None:
    return ((row or {}).get("start") or {}).get(which)


def value(row: dict | None, kind: str, key: str) -> float | None:
    if kind == "decode":
        return decode_ms(row, key)
    if kind == "prefill":
        return prefill_ms(row, key)
    return start_s(row, key)


def columns(results: dict, mres: dict) -> tuple[list[str], list[str]]:
    settings = (results.get("meta") or {}).get("settings") or {}
    batches = [str(b) for b in settings.get("batches") or []]
    lens = [str(n) for n in settings.get("prefill_lens") or []]
    for row in mres.get("rows", {}).values():  # rows can hold more (a --static-batches beyond --batches)
        batches += [b for b in (row.get("decode") or {}) if b not in batches]
        lens += [n for n in (row.get("prefill") or {}) if n not in lens]
    return sorted(batches, key=int), sorted(lens, key=int)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def add_ratios(results: dict) -> None:
    """Each graphkiln figure over the floor and over the best transformers row, stored per model."""
    for mres in results.get("models", {}).values():
        rows = mres.get("rows", {})
        batches, lens = columns(results, mres)
        keys = [("decode", b) for b in batches] + [("prefill", n) for n in lens] + [("start", "cold_s"), ("start", "warm_s")]
        out: dict = {}
        for name in GRAPHKILN:
            if name not in rows:
                continue
            r: dict = {"vs_floor": {}, "vs_best_transformers": {}}
            for kind, key in keys:
                v = value(rows[name], kind, key)
                label = f"{kind}:{key}"
                floor = value(rows.get("floor"), kind, key) if kind != "start" else None
                tf = [value(rows.get(t), kind, key) for t in TRANSFORMERS]
                best = min((x for x in tf if x is not None), default=None)
                r["vs_floor"][label] = _ratio(v, floor)
                r["vs_best_transformers"][label] = _ratio(v, best)
            out[name] = r
        mres["ratios"] = out


# ----------------------------------------------------------------------------- formatting


def fmt(v: float | None, digits: int = 3) -> str:
    if v is None or not isinstance(v, (int, float)) or not math.isfinite(v):
        return "—"
    if abs(v) >= 1000:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


def fmt_ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _cell(row: dict | None, kind: str, key: str) -> str:
    """A value, or 'err' / 'skip' where the row recorded why it has none."""
    v = value(row, kind, key)
    if v is not None:
        return fmt(v)
    part = (row or {}).get(kind) or {}
    cell = part.get(key) if isinstance(part.get(key), dict) else None
    if kind == "start":
        cell = part.get("cold" if key == "cold_s" else "warm") or part
    err = (cell or {}).get("error") if isinstance(cell, dict) else None
    if err:
        return "skip" if str(err).startswith("skipped") else "err"
    return "—"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return lines


def model_title(name: str, mres: dict, dtype: str) -> str:
    b = mres.get("bytes") or {}
    desc = DESCRIPTIONS.get(name, "tiny smoke shapes")
    params = b.get("params")
    count = f"{params / 1e9:.3f} B" if params and params >= 1e8 else f"{(params or 0) / 1e6:.3f} M"
    size = f"{count} params, {b.get('weight_bytes_all', 0) / 2**30:.3g} GiB {dtype}" if params else ""
    return f"{name}: {desc} ({size})" if size else f"{name}: {desc}"


def to_markdown(results: dict) -> str:
    meta = results.get("meta") or {}
    settings = meta.get("settings") or {}
    hw = results.get("hardware") or {}
    lines = [f"# graphkiln benchmark: {meta.get('device_name', '?')}, {meta.get('date', '?')}", ""]
    dirty = " (uncommitted changes)" if meta.get("git_dirty") else ""
    lines.append(
        f"commit `{meta.get('git_commit', 'unknown')}`{dirty}; torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"transformers {meta.get('transformers')}, graphkiln {meta.get('graphkiln')}, Python {meta.get('python')}"
        + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "")
    )
    if hw:
        lines.append(
            f"measured here: copy {hw['copy_bandwidth_Bps'] / 1e12:.3f} TB/s (read + write, "
            f"{hw['copy_bytes'] / 2**30:.3g} GiB, median of 10), {settings.get('dtype_name', '')} matmul "
            f"{hw['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({hw['matmul_n']}³, median of 10)"
        )
    lines.append(
        f"decode: {settings.get('prompt_len')} random prompt tokens, {settings.get('new_tokens')} new tokens, EOS "
        f"ignored; ms/token = (total − time to first token) / (new − 1) per generate call, one token per sequence "
        f"per step. prefill: batch 1, graphkiln = time to first token (max_tokens=1), transformers = one forward. "
        f"graphkiln buckets: decode {settings.get('decode_buckets')}, prefill {settings.get('prefill_buckets')}."
    )
    lines.append("")
    for name, mres in (results.get("models") or {}).items():
        lines += _model_markdown(results, name, mres, settings)
    targets = target_rows(results)
    if targets:
        lines += ["## Targets (from the issue)", ""]
        lines += _table(["model", "what", "graphkiln compiled", "goal", "met"], targets)
        lines.append("")
    errors = list(_errors(results))
    if errors:
        lines += ["## Errors and skipped rows", ""] + [f"- {e}" for e in errors] + [""]
    lines += [
        "Floor = max(bytes / copy bandwidth, FLOPs / matmul rate) with bytes = weights read per step (an untied input "
        "embedding table is only gathered from) + KV read at the mean decode context; the issue's all-weights floor "
        "at batch 1 is in the JSON (`issue_floor_ms_per_token`). Start = from process start to the first generated "
        "token in a fresh process (cold: compile with empty Inductor/Triton caches; warm: load the artifact, CUDA graph "
        "capture included). † transformers static: its first generate call, which compiles (the first token comes "
        "before the compile: the decode step is what it compiles).",
        "",
    ]
    return "\n".join(lines)


def _model_markdown(results: dict, name: str, mres: dict, settings: dict) -> list[str]:
    rows = mres.get("rows") or {}
    batches, lens = columns(results, mres)
    lines = [f"## {model_title(name, mres, settings.get('dtype_name', ''))}", ""]
    header = ["row"] + [f"decode b={b} ms/tok" for b in batches] + [f"prefill {n} ms" for n in lens]
    header += ["start→1st tok cold s", "warm s", "graph pool MiB"]
    body = []
    for key, label in ROWS:
        if key not in rows:
            continue
        row = rows[key]
        r = [label] + [_cell(row, "decode", b) for b in batches] + [_cell(row, "prefill", n) for n in lens]
        if key == "transformers_static" and row.get("first_call_s") is not None:
            r += [fmt(row["first_call_s"]) + "†", "—"]
        elif key == "floor":
            r += ["—", "—"]
        else:
            r += [_cell(row, "start", "cold_s"), _cell(row, "start", "warm_s")]
        pool = row.get("graph_pool_bytes")
        r.append(fmt(pool / 2**20) if isinstance(pool, (int, float)) else "—")
        if row.get("error") and key != "floor":
            r[0] += " (skipped)" if str(row["error"]).startswith("skipped") else " (error)"
        body.append(r)
    lines += _table(header, body) + [""]
    ratios = mres.get("ratios") or {}
    if ratios:
        rh = ["graphkiln ÷"] + [f"b={b}" for b in batches] + [f"prefill {n}" for n in lens] + ["cold", "warm"]
        rb = []
        for key in GRAPHKILN:
            if key not in ratios:
                continue
            for which, word in (("vs_floor", "floor"), ("vs_best_transformers", "best transformers")):
                rr = ratios[key][which]
                vals = [rr.get(f"decode:{b}") for b in batches] + [rr.get(f"prefill:{n}") for n in lens]
                vals += [rr.get("start:cold_s"), rr.get("start:warm_s")]
                rb.append([f"{LABELS[key]} ÷ {word}"] + [fmt_ratio(v) for v in vals])
        lines += _table(rh, rb) + [""]
    plain = [[LABELS[k]] + [fmt(decode_ms(rows[k], b, plain=True)) for b in batches]
             for k, _ in ROWS if k in rows and k != "floor"]
    if plain:
        lines += ["decode, total time / new tokens (ms):", ""]
        lines += _table(["row"] + [f"b={b}" for b in batches], plain) + [""]
    extra = []
    comp = rows.get("graphkiln_compiled") or {}
    cold = (comp.get("start") or {}).get("cold") or {}
    warm = (comp.get("start") or {}).get("warm") or {}
    if cold.get("compile_s") is not None:
        detail = cold.get("compile_summary") or ", ".join(f"{k} {v:.1f} s" for k, v in (cold.get("compile_timings") or {}).items())
        extra.append(f"graphkiln compile_model {cold['compile_s']:.1f} s in the cold process: {detail}")
    if comp.get("graphs"):
        parts = [f"{kind} {comp[kind + '_graphs']} graphs, {comp[kind + '_pool_bytes'] / 2**20:.0f} MiB, "
                 f"{comp[kind + '_capture_s']:.1f} s" for kind in ("decode", "prefill") if comp.get(kind + "_graphs")]
        extra.append("graphkiln CUDA graphs in this process (graph pool column = their sum): " + "; ".join(parts))
    if warm.get("load_s") is not None:
        extra.append(
            f"graphkiln warm start: import {warm.get('import_s', 0):.1f} s, load {warm['load_s']:.1f} s "
            f"(capture {warm.get('capture_s') or 0:.1f} s of it, {warm.get('graphs', 0)} graphs), first token "
            f"{warm.get('generate_s', 0) * 1e3:.0f} ms"
        )
    for key in GRAPHKILN:
        check = (rows.get(key) or {}).get("check")
        if check:
            extra.append(
                f"{LABELS[key]} logits vs transformers: relative error {check['rel_err']:.2e}, argmax agreement "
                f"{check['argmax_agreement']:.3f}"
            )
    floor = rows.get("floor") or {}
    if floor.get("issue_floor_ms_per_token") is not None:
        extra.append(f"issue's floor (all weight bytes / copy bandwidth): {floor['issue_floor_ms_per_token']:.3f} ms/token")
    if extra:
        lines += [f"- {x}" for x in extra] + [""]
    return lines


def target_rows(results: dict) -> list[list[str]]:
    out = []
    models = results.get("models") or {}
    for model, what, (kind, key), goal, unit, note in TARGETS:
        if model not in models:
            continue
        rows = models[model].get("rows") or {}
        v = value(rows.get("graphkiln_compiled"), kind, key)
        goal_text = f"≤ {fmt(goal)} {unit}" + (f" ({note})" if note else "")
        if model == "8b" and kind == "decode":
            floor = value(rows.get("floor"), kind, key)
            if floor is not None:
                goal_text += f"; 1.15 × measured floor = {fmt(1.15 * floor)}"
        met = "—" if v is None else ("yes" if v <= goal else "no")
        out.append([model, what, "—" if v is None else f"{fmt(v)} {unit}", goal_text, met])
    return out


def _errors(results: dict):
    for e in results.get("errors") or []:
        yield f"{e.get('where')}: {e.get('error')}"
    for name, mres in (results.get("models") or {}).items():
        for key, row in (mres.get("rows") or {}).items():
            if row.get("error"):
                yield f"{name} / {LABELS.get(key, key)}: {row['error']}"
            for kind in ("decode", "prefill"):
                for k, cell in (row.get(kind) or {}).items():
                    if isinstance(cell, dict) and cell.get("error"):
                        yield f"{name} / {LABELS.get(key, key)} / {kind} {k}: {cell['error']}"
            for k in ("cold", "warm"):
                cell = (row.get("start") or {}).get(k)
                if isinstance(cell, dict) and cell.get("error"):
                    yield f"{name} / {LABELS.get(key, key)} / {k} start: {cell['error']}"
            if isinstance((row.get("start") or {}).get("error"), str):
                yield f"{name} / {LABELS.get(key, key)} / start: {row['start']['error']}"


def short_table(results: dict) -> str:
    """A compact plain-text table for the end of stdout."""
    meta = results.get("meta") or {}
    hw = results.get("hardware") or {}
    out = [f"== graphkiln bench: {meta.get('device_name')} | torch {meta.get('torch')} | transformers "
           f"{meta.get('transformers')} | copy {hw.get('copy_bandwidth_Bps', 0) / 1e12:.2f} TB/s | "
           f"{meta.get('elapsed_s', 0):.0f} s"]
    short = {"floor": "floor", "transformers_eager": "hf eager", "transformers_static": "hf static+compile",
             "graphkiln_eager": "gk eager", "graphkiln_compiled": "gk compiled+graphs"}
    for name, mres in (results.get("models") or {}).items():
        rows = mres.get("rows") or {}
        batches, lens = columns(results, mres)
        head = ["", *(f"b{b}" for b in batches), *(f"p{n}" for n in lens), "cold s", "warm s", "poolMiB"]
        table = [head]
        for key, _ in ROWS:
            if key not in rows:
                continue
            row = rows[key]
            r = [short[key]] + [_cell(row, "decode", b) for b in batches] + [_cell(row, "prefill", n) for n in lens]
            if key == "transformers_static":
                r += [fmt(row.get("first_call_s")) + ("*" if row.get("first_call_s") is not None else ""), "—"]
            elif key == "floor":
                r += ["—", "—"]
            else:
                r += [_cell(row, "start", "cold_s"), _cell(row, "start", "warm_s")]
            pool = row.get("graph_pool_bytes")
            r.append(fmt(pool / 2**20) if isinstance(pool, (int, float)) else "—")
            if row.get("error") and key != "floor":
                r[0] += " (skip)" if str(row["error"]).startswith("skipped") else " (err)"
            table.append(r)
        ratios = (mres.get("ratios") or {}).get("graphkiln_compiled")
        if ratios:
            for which, word in (("vs_floor", "gk/floor"), ("vs_best_transformers", "gk/best hf")):
                rr = ratios[which]
                r = [word] + [fmt_ratio(rr.get(f"decode:{b}")) for b in batches]
                r += [fmt_ratio(rr.get(f"prefill:{n}")) for n in lens]
                r += [fmt_ratio(rr.get("start:cold_s")), fmt_ratio(rr.get("start:warm_s")), ""]
                table.append(r)
        widths = [max(len(str(r[i])) for r in table) for i in range(len(head))]
        out.append(f"-- {name} (decode ms/token; prefill ms; start to first token s; * = first call, compiles)")
        out += ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                for r in table]
    targets = target_rows(results)
    if targets:
        out.append("-- targets (graphkiln compiled)")
        out += [f"{t[0]} {t[1]}: {t[2]} (goal {t[3]}) {t[4]}" for t in targets]
    n_err = sum(1 for _ in _errors(results))
    if n_err:
        out.append(f"-- {n_err} errors/skips: see the JSON and the markdown")
    return "\n".join(out)


def plot(results: dict, path: str | Path) -> bool:
    """Decode ms/token against batch size for every row, one panel per model. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    models = results.get("models") or {}
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (name, mres) in zip(axes[0], models.items()):
        rows = mres.get("rows") or {}
        batches, _ = columns(results, mres)
        for key, label in ROWS:
            pts = [(int(b), decode_ms(rows.get(key), b)) for b in batches]
            pts = [(x, y) for x, y in pts if y is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            style = dict(linestyle="--", color="black") if key == "floor" else dict(marker="o", color=COLORS[key])
            ax.plot(xs, ys, label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [int(b) for b in batches]
        if ticks:
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(b) for b in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("decode ms per token (per step)")
        ax.set_title(model_title(name, mres, ((results.get("meta") or {}).get("settings") or {}).get("dtype_name", "")),
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    meta = results.get("meta") or {}
    fig.suptitle(f"graphkiln vs transformers: {meta.get('device_name')}, {meta.get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def latest(folder: str | Path) -> Path:
    found = sorted(Path(folder).glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        raise FileNotFoundError(f"no result JSON in {folder}")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Markdown from a gpu_bench.py result JSON")
    p.add_argument("json", nargs="?", help="result JSON (or use --latest)")
    p.add_argument("--latest", metavar="DIR", help="use the newest JSON in DIR (e.g. bench/results)")
    p.add_argument("--write", action="store_true", help="write the .md beside the JSON")
    p.add_argument("--plot", action="store_true", help="write the .png beside the JSON (needs matplotlib)")
    p.add_argument("--short", action="store_true", help="print the short text table instead")
    a = p.parse_args(argv)
    if not a.json and not a.latest:
        p.error("give a JSON path or --latest DIR")
    path = Path(a.json) if a.json else latest(a.latest)
    results = json.loads(path.read_text())
    add_ratios(results)
    md = to_markdown(results)
    if a.write:
        path.with_suffix(".md").write_text(md)
    if a.plot and not plot(results, path.with_suffix(".png")):
        print("plot skipped: matplotlib is not installed", file=sys.stderr)
    print(short_table(results) if a.short else md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
