"""The code behind bench/gpu_bench.py (the entry script, its CLI and docs) and bench/report.py.

Modules import only the standard library at their top: torch, transformers and graphkiln are imported
where they are used, so the start-up children and report.py stay light.

    common     paths, the run clock and log, errors, the watchdog's exception, importing graphkiln
    settings   the --rows table and Settings (everything a run decides up front)
    bytecode   .pyc files for the installed packages before start-up times are taken
    timing     device clocks, random prompts, the prefill and decode loops every row shares
    models     the model shapes, their byte and FLOP counts, building the random transformers model
    floor      copy bandwidth, matmul rate and the floor they give
    child      fresh processes for the start-up times (both sides) and graphkiln's CUDA graph stats
    rows_transformers, rows_graphkiln   one function per row
    runner     the run: budget, watchdog, per-row error handling, the JSON and markdown
    results, markdown, summary   reading a result JSON; the markdown; the short table and the plot
"""
