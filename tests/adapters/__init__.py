"""Tests of `nemo_ckpt/adapters/`: the text-environment adapter on SkyRL-gym."""
