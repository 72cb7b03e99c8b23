"""The holder's wing: one session holder per node, holding the sessions of its rollouts.

``actor`` routes every call to its parts; ``snapshot`` and ``restore`` are the rooms of
the two operations on this side (``shards`` their shard writes and reads,
``sandbox_restores`` a restore's sandboxes); ``sessions`` and ``turns`` serve the
environment workers; ``operations`` and ``states`` are an operation's lease, abort and
lifecycle; ``session_table``, ``turn_gate``, ``sandboxes``, ``heap`` and ``watchdog`` are
the state the parts share (``parts``).
"""
