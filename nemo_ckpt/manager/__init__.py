"""The rollout checkpoint manager: periodic and trainer-anchored snapshots, retention, a
failure budget and a configuration fingerprint around the seed's call order
(``rollout_manager``), with what it removes under its root (``removals``), over pure
parts: its configuration (``config``), what it records beside each snapshot
(``record``), which snapshots retention keeps (``retention``) and the fingerprint's
comparison (``fingerprint``)."""
