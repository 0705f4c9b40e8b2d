"""The short plain-text table printed at the end of a run, and the decode plot (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from .results import ROWS, columns, decode_ms, errors, model_title, ratio_cells, row_cells, row_status, target_rows

SHORT = {"floor": "floor", "transformers_eager": "hf eager", "transformers_static": "hf static+compile",
         "graphkiln_eager": "gk eager", "graphkiln_compiled": "gk compiled+graphs"}
STATUS = {"skipped": " (skip)", "error": " (err)"}
COLORS = {"transformers_eager": "tab:blue", "transformers_static": "tab:orange", "graphkiln_eager": "tab:green",
          "graphkiln_compiled": "tab:red"}


def short_table(results: dict) -> str:
    """A compact plain-text table for the end of stdout."""
    meta = results.get("meta") or {}
    hw = results.get("hardware") or {}
    out = [f"== graphkiln bench: {meta.get('device_name')} | torch {meta.get('torch')} | transformers "
           f"{meta.get('transformers')} | copy {hw.get('copy_bandwidth_Bps', 0) / 1e12:.2f} TB/s | "
           f"{meta.get('elapsed_s', 0):.0f} s"]
    for name, mres in (results.get("models") or {}).items():
        rows = mres.get("rows") or {}
        batches, lens = columns(results, mres)
        head = ["", *(f"b{b}" for b in batches), *(f"p{n}" for n in lens), "cold s", "warm s", "poolMiB"]
        table = [head]
        for key, _ in ROWS:
            if key in rows:
                label = SHORT[key] + STATUS.get(row_status(key, rows[key]), "")
                table.append([label] + row_cells(key, rows[key], batches, lens, "*"))
        ratios = (mres.get("ratios") or {}).get("graphkiln_compiled")
        if ratios:
            for which, word in (("vs_floor", "gk/floor"), ("vs_best_transformers", "gk/best hf")):
                table.append([word] + ratio_cells(ratios[which], batches, lens) + [""])
        widths = [max(len(str(r[i])) for r in table) for i in range(len(head))]
        out.append(f"-- {name} (decode ms/token; prefill ms; start to first token s; * = first call, compiles)")
        out += ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                for r in table]
    targets = target_rows(results)
    if targets:
        out.append("-- targets (graphkiln compiled)")
        out += [f"{t[0]} {t[1]}: {t[2]} (goal {t[3]}) {t[4]}" for t in targets]
    n_err = sum(1 for _ in errors(results))
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
