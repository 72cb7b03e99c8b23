"""nemo-ckpt's benchmarks, each run from the repository root as ``python -m
benchmarks.<name>`` (benchmarks/README.md); what they share is in ``benchmarks.common``."""
