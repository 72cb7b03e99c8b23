"""Tests of `actors/ray_transport.py`, `actors/metrics.py` and `actors/drills.py`, and of
the whole system end to end on a real Ray cluster (faults, chaos, Ray as it behaves)."""
