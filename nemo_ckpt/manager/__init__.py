"""The rollout checkpoint manager: periodic and trainer-anchored snapshots, retention, a
failure budget and a configuration fingerprint around the seed's call order
(``rollout_manager``), with what it removes under its root (``removals``), the snapshot
a restore takes and what it hands over (``restoring``, ``handover``), a stop's trainer
checkpoint (``stop_anchor``) and RL's own files in a snapshot (``rl_files``), over pure
parts: its configuration (``config``), what it records beside each snapshot
(``record``), which snapshots retention keeps (``retention``) and the fingerprint's
comparison (``fingerprint``)."""
