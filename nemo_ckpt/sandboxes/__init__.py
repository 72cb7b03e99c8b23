"""Sessions' sandbox directories: the directory backend (over ``nemo_ckpt.trees``)."""
