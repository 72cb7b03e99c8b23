"""Tests of `nemo_ckpt/testing/`: the reference data plane."""
