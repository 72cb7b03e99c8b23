"""Tests of `nemo_ckpt/manager/`: `RolloutCheckpointManager`."""
