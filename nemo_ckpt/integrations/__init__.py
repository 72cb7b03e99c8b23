"""Plug-ins for RL frameworks' own ledgers and barriers: ``nemo_rl`` for NeMo RL; and
``nemo_gym``, a NeMo Gym sandbox provider. Importing any of them imports none of the
framework."""
