"""Tests of `nemo_ckpt/sandboxes/`: sandbox trees, blobs and the sessions that own directories."""
