"""Environments in containers: a session's container recorded at each turn's commit
(its filesystem changes against its image and, where CRIU works, its processes' memory)
and created again as the next attempt's (``nemo_ckpt.containers.sandbox``), on the
node's podman (``nemo_ckpt.containers.podman``)."""
