"""Tests of `nemo_ckpt/containers/`: sessions' containers on this machine's podman."""
