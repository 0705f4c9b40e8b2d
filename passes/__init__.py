"""passes: FX and Inductor graph passes, the pass manager and its uuid, pass-debugging dumps."""
