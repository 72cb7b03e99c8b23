"""Tests of the top-level modules of `nemo_ckpt/`: the contract, the cut, receipts, the
session client, options, tracing."""
