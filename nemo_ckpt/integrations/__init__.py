"""Plug-ins for RL frameworks' own ledgers and barriers: ``nemo_rl`` for NeMo RL. Each
is duck-typed, so importing it needs none of the framework."""
