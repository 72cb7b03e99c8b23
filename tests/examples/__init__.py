"""Tests of `examples/` and `cluster.yaml`: the demos and examples as a user runs them."""
