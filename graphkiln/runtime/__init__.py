"""runtime: KV cache, attention backends, runners, sampler, scheduler and engine. Never traces or compiles."""
