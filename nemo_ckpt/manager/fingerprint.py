"""The configuration fingerprint: what recovery depends on, recorded with each snapshot
and compared at a restore (pure)."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from nemo_ckpt.errors import FingerprintMismatchError

__all__ = ["Fingerprint", "changed_fields", "refuse_changes"]

# field -> a JSON value: instance ids, sandbox root, environment adapters, formats, and
# whatever the caller adds (its RL configuration's digest, say).
Fingerprint = Mapping[str, Any]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def changed_fields(saved: Fingerprint, now: Fingerprint) -> dict[str, tuple[Any, Any]]:
    """Every field whose value differs (absent on one side counts), with both values."""
    return {field: (saved.get(field), now.get(field))
            for field in sorted(set(saved) | set(now))
            if _canonical(saved.get(field)) != _canonical(now.get(field))}


def refuse_changes(path: str, saved: Fingerprint, now: Fingerprint,
                   allowed: Collection[str]) -> dict[str, tuple[Any, Any]]:
    """The allowed changes, or ``FingerprintMismatchError`` naming every other field."""
    changed = changed_fields(saved, now)
    refused = {f: v for f, v in changed.items() if f not in allowed}
    if refused:
        lines = "\n".join(f"  - {f}: saved {_short(a)}, now {_short(b)}"
                          for f, (a, b) in refused.items())
        error = FingerprintMismatchError(
            f"the rollout snapshot at {path} was taken under another configuration in "
            f"{len(refused)} field(s) recovery depends on; existing checkpoint state was not "
            f"modified:\n{lines}\nrestore with the former configuration, or allow these "
            f"fields (RolloutCheckpointConfig.allow_changed) if the change is safe")
        error.changed = refused
        raise error
    return {f: v for f, v in changed.items() if f in allowed}


def _short(value: Any) -> str:
    text = _canonical(value)
    return text if len(text) <= 120 else text[:117] + "..."
