"""Tests of `nemo_ckpt/catalog/`: snapshots as a collection, and the Python API over it."""
