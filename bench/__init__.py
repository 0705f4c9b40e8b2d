"""graphkiln's benchmark harness, run as `python -m bench COMMAND` from the repository (bench/README.md).

    run        the main side-by-side run: graphkiln, transformers, the bandwidth floor (run.py)
    report     a run's JSON as markdown and plot; HISTORY.md rows (report.py)
    kernels    the kernels of one decode replay and of a short prefill, by name (kernels.py)
    products   one-row and 128-row weight products: cuBLAS, the GEMV, Inductor (products.py)
    tiles      GEMV tilings tried inside the real decode graph (tiles.py)
    attention  the Triton attention kernels against SDPA and the copy rate (attention.py)
    passes     each optional graph pass on and off (passes.py)
    bf16-ties  where bfloat16 greedy tokens differ, eager vs compiled (CPU) (bf16_ties.py)

Shared: common.py (clock, log, environment, JSON, study settings), measure.py (the one timing
helper, copy and matmul rates), models.py (shapes, random models, engine helpers), startup.py
(fresh-process start-up times). Results: bench/results/ (HISTORY.md for earlier runs).
The benchmark reads engines through their public API only (`LLM.stats()`, `Engine.cuda_graph`,
`Engine.recapture`).
"""
