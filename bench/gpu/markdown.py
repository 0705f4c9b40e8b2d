"""The markdown report of a gpu_bench result JSON (written beside it, and printed by bench/report.py)."""

from __future__ import annotations

from .results import GRAPHKILN, LABELS, ROWS, columns, decode_ms, errors, fmt, model_title, ratio_cells, row_cells, \
    row_status, target_rows


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return lines


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
    errs = list(errors(results))
    if errs:
        lines += ["## Errors and skipped rows", ""] + [f"- {e}" for e in errs] + [""]
    lines += [
        "Floor = max(bytes / copy bandwidth, FLOPs / matmul rate) with bytes = weights read per step (an untied input "
        "embedding table is only gathered from) + KV read at the mean decode context; the issue's all-weights floor "
        "at batch 1 is in the JSON (`issue_floor_ms_per_token`). Start = from process start to the first generated "
        "token in a fresh process (cold: compile with empty Inductor/Triton caches; warm: load the artifact, CUDA graph "
        "capture included). † transformers static: its first generate call, which compiles (the first token comes "
        "before the compile: the decode step is what it compiles).",
        "",
    ]
    bytecode = (results.get("meta") or {}).get("bytecode") or {}
    if bytecode.get("state", "present") != "present":
        lines += [f"Python bytecode of the installed packages was {bytecode['state']} before any timing "
                  f"({bytecode.get('seconds', 0):.0f} s), as `pip install` does; this machine's image ships none.", ""]
    return "\n".join(lines)


def _model_markdown(results: dict, name: str, mres: dict, settings: dict) -> list[str]:
    """One model: its rows, graphkiln's ratios, decode as total / new tokens, and notes."""
    rows = mres.get("rows") or {}
    batches, lens = columns(results, mres)
    lines = [f"## {model_title(name, mres, settings.get('dtype_name', ''))}", ""]
    header = ["row"] + [f"decode b={b} ms/tok" for b in batches] + [f"prefill {n} ms" for n in lens]
    header += ["start→1st tok cold s", "warm s", "graph pool MiB"]
    body = []
    for key, label in ROWS:
        if key in rows:
            status = row_status(key, rows[key])
            body.append([label + (f" ({status})" if status else "")] + row_cells(key, rows[key], batches, lens, "†"))
    lines += _table(header, body) + [""]
    ratios = mres.get("ratios") or {}
    if ratios:
        rh = ["graphkiln ÷"] + [f"b={b}" for b in batches] + [f"prefill {n}" for n in lens] + ["cold", "warm"]
        rb = [[f"{LABELS[key]} ÷ {word}"] + ratio_cells(ratios[key][which], batches, lens)
              for key in GRAPHKILN if key in ratios
              for which, word in (("vs_floor", "floor"), ("vs_best_transformers", "best transformers"))]
        lines += _table(rh, rb) + [""]
    plain = [[LABELS[k]] + [fmt(decode_ms(rows[k], b, plain=True)) for b in batches]
             for k, _ in ROWS if k in rows and k != "floor"]
    if plain:
        lines += ["decode, total time / new tokens (ms):", ""]
        lines += _table(["row"] + [f"b={b}" for b in batches], plain) + [""]
    notes = _notes(rows)
    if notes:
        lines += [f"- {x}" for x in notes] + [""]
    return lines


def _notes(rows: dict) -> list[str]:
    """graphkiln's compile, CUDA graphs, warm start and logit checks; the issue's floor."""
    out = []
    comp = rows.get("graphkiln_compiled") or {}
    cold = (comp.get("start") or {}).get("cold") or {}
    warm = (comp.get("start") or {}).get("warm") or {}
    if cold.get("compile_s") is not None:
        detail = cold.get("compile_summary") or ", ".join(f"{k} {v:.1f} s" for k, v in (cold.get("compile_timings") or {}).items())
        out.append(f"graphkiln compile_model {cold['compile_s']:.1f} s in the cold process: {detail}")
    if comp.get("graphs"):
        parts = [f"{kind} {comp[kind + '_graphs']} graphs, {comp[kind + '_pool_bytes'] / 2**20:.0f} MiB, "
                 f"{comp[kind + '_capture_s']:.1f} s" for kind in ("decode", "prefill") if comp.get(kind + "_graphs")]
        out.append("graphkiln CUDA graphs in this process (graph pool column = their sum): " + "; ".join(parts))
    if warm.get("load_s") is not None:
        out.append(
            f"graphkiln warm start: import {warm.get('import_s', 0):.1f} s, load {warm['load_s']:.1f} s "
            f"(capture {warm.get('capture_s') or 0:.1f} s of it, {warm.get('graphs', 0)} graphs), first token "
            f"{warm.get('generate_s', 0) * 1e3:.0f} ms"
        )
    for key in GRAPHKILN:
        check = (rows.get(key) or {}).get("check")
        if check:
            out.append(
                f"{LABELS[key]} logits vs transformers: relative error {check['rel_err']:.2e}, argmax agreement "
                f"{check['argmax_agreement']:.3f}"
            )
    floor = rows.get("floor") or {}
    if floor.get("issue_floor_ms_per_token") is not None:
        out.append(f"issue's floor (all weight bytes / copy bandwidth): {floor['issue_floor_ms_per_token']:.3f} ms/token")
    return out
