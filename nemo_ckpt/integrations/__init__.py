"""Plug-ins for RL frameworks' own ledgers and barriers: ``nemo_rl`` for NeMo RL; and
NeMo Gym's sandbox providers, ``nemo_gym`` (``local``) and ``nemo_gym_docker``. Importing
any of them imports none of the framework."""
