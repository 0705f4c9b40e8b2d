"""Attention backends behind the graphkiln::attention op: plan a batch, then run inside the op."""
