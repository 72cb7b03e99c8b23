"""The rollout checkpoint manager: periodic and trainer-anchored snapshots, retention, a
failure budget and a configuration fingerprint around the seed's call order
(``rollout_manager``), over pure parts: its configuration (``config``), what it records
beside each snapshot (``record``) and the fingerprint's comparison (``fingerprint``)."""
