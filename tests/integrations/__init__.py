"""Tests of `nemo_ckpt/integrations/`: NeMo RL's side, through its test double."""
