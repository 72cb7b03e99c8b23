"""Tests of `nemo_ckpt/storage/`: the on-disk format, claims, folders and buckets."""
