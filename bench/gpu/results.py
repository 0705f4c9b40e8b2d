"""Reading a gpu_bench result JSON: row order and labels, values, columns, ratios, formatted cells, targets, errors.

Shared by the markdown (markdown.py), the short table and the plot (summary.py). Standard library only.
"""

from __future__ import annotations

import math

ROWS = (  # JSON name, label; table order
    ("floor", "bandwidth floor"),
    ("transformers_eager", "transformers eager"),
    ("transformers_static", "transformers static cache + compile"),
    ("graphkiln_eager", "graphkiln eager (reference)"),
    ("graphkiln_compiled", "graphkiln compiled + CUDA graphs"),
)
LABELS = dict(ROWS)
TRANSFORMERS = ("transformers_eager", "transformers_static")
GRAPHKILN = ("graphkiln_eager", "graphkiln_compiled")
DESCRIPTIONS = {"1b": "Llama-3.2-1B-like", "8b": "Llama-3.1-8B-like"}
# From the issue. (model, what, how to read it, goal, unit)
TARGETS = (
    ("8b", "decode batch 1", ("decode", "1"), 4.35, "ms/token", "<= 1.15x floor"),
    ("1b", "decode batch 1", ("decode", "1"), 1.0, "ms/token", ""),
    ("1b", "decode batch 64", ("decode", "64"), 1.6, "ms/step", ""),
    ("1b", "prefill 128 tokens", ("prefill", "128"), 2.0, "ms", ""),
    ("8b", "prefill 128 tokens", ("prefill", "128"), 5.0, "ms", ""),
    ("1b", "warm start to first token", ("start", "warm_s"), 10.0, "s", ""),
    ("1b", "cold start (compile) to first token", ("start", "cold_s"), 60.0, "s", ""),
)


def decode_ms(row: dict | None, batch: str, plain: bool = False) -> float | None:
    cell = ((row or {}).get("decode") or {}).get(batch) or {}
    return cell.get("ms_per_token_plain" if plain else "ms_per_token")


def value(row: dict | None, kind: str, key: str) -> float | None:
    """decode ms/token at batch `key`, prefill ms at length `key`, or start seconds (`key` cold_s or warm_s)."""
    if kind == "decode":
        return decode_ms(row, key)
    part = (row or {}).get(kind) or {}
    return (part.get(key) or {}).get("ms") if kind == "prefill" else part.get(key)


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


def row_cells(key: str, row: dict, batches: list[str], lens: list[str], first_call_mark: str) -> list[str]:
    """A table row after its label: decode, prefill, start to first token cold and warm (transformers static:
    its first call, which compiles, marked), graph pool MiB."""
    r = [_cell(row, "decode", b) for b in batches] + [_cell(row, "prefill", n) for n in lens]
    first = row.get("first_call_s")
    if key == "transformers_static" and first is not None:
        r += [fmt(first) + first_call_mark, "—"]
    elif key in ("floor", "transformers_static"):
        r += ["—", "—"]
    else:
        r += [_cell(row, "start", "cold_s"), _cell(row, "start", "warm_s")]
    pool = row.get("graph_pool_bytes")
    r.append(fmt(pool / 2**20) if isinstance(pool, (int, float)) else "—")
    return r


def row_status(key: str, row: dict) -> str | None:
    """'skipped' or 'error' where a row (not the floor) recorded why it has no values."""
    if row.get("error") and key != "floor":
        return "skipped" if str(row["error"]).startswith("skipped") else "error"
    return None


def ratio_cells(ratios: dict, batches: list[str], lens: list[str]) -> list[str]:
    """One of a row's ratio sets (vs_floor or vs_best_transformers), in the columns of row_cells but the pool."""
    keys = [f"decode:{b}" for b in batches] + [f"prefill:{n}" for n in lens] + ["start:cold_s", "start:warm_s"]
    return [fmt_ratio(ratios.get(k)) for k in keys]


def model_title(name: str, mres: dict, dtype: str) -> str:
    b = mres.get("bytes") or {}
    desc = DESCRIPTIONS.get(name, "tiny smoke shapes")
    params = b.get("params")
    count = f"{params / 1e9:.3f} B" if params and params >= 1e8 else f"{(params or 0) / 1e6:.3f} M"
    size = f"{count} params, {b.get('weight_bytes_all', 0) / 2**30:.3g} GiB {dtype}" if params else ""
    return f"{name}: {desc} ({size})" if size else f"{name}: {desc}"


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


def errors(results: dict):
    for e in results.get("errors") or []:
        yield f"{e.get('where')}: {e.get('error')}"
    for name, mres in (results.get("models") or {}).items():
        for key, row in (mres.get("rows") or {}).items():
            where = f"{name} / {LABELS.get(key, key)}"
            if row.get("error"):
                yield f"{where}: {row['error']}"
            for kind in ("decode", "prefill"):
                for k, cell in (row.get(kind) or {}).items():
                    if isinstance(cell, dict) and cell.get("error"):
                        yield f"{where} / {kind} {k}: {cell['error']}"
            for k in ("cold", "warm"):
                cell = (row.get("start") or {}).get(k)
                if isinstance(cell, dict) and cell.get("error"):
                    yield f"{where} / {k} start: {cell['error']}"
            if isinstance((row.get("start") or {}).get("error"), str):
                yield f"{where} / start: {row['start']['error']}"
