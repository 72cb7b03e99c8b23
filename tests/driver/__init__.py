"""Tests of `nemo_ckpt/driver/`: `RayEnvironmentCheckpoint` and its parts, in-process."""
