"""Tests of `nemo_ckpt/cli/`: the `nemo-ckpt` command line."""
