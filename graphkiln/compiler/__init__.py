"""compiler: Dynamo capture, the attention-split backend, per-piece Inductor compiles, artifacts."""
