"""Sessions: the rollout state an environment backend keeps between turns.

``SessionRecord`` is the pure data of one session as it is captured, written to a
shard and restored. Turn records and environment state are opaque bytes that the
environment serializes itself; nemo-ckpt never unpickles anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_ckpt.interfaces import EnvironmentEpisode

__all__ = ["SessionRecord"]


@dataclass(frozen=True)
class SessionRecord:
    """One session: an episode, the turns it has run and the environment's state.

    Attributes:
        instance_id: The session-holder instance that owns the rollout.
        episode: The attempt this session runs.
        turns: One opaque record per committed turn, oldest first, over all attempts.
        state: The environment's state after the last committed turn.
        staging_keys: Every token-capture staging row the session's turns wrote, over
            all its attempts.
        earlier_capture_keys: Capture keys of the attempts before this one, oldest first.
    """

    instance_id: str
    episode: EnvironmentEpisode
    turns: tuple[bytes, ...] = ()
    state: bytes = b""
    staging_keys: frozenset[str] = frozenset()
    earlier_capture_keys: tuple[str, ...] = ()

    def continued(self) -> SessionRecord:
        """This session as a restore installs it: the next attempt, keeping its turns,
        state and staging keys, and remembering this attempt's capture key."""
        return SessionRecord(
            instance_id=self.instance_id,
            episode=self.episode.next_attempt(),
            turns=self.turns,
            state=self.state,
            staging_keys=self.staging_keys,
            earlier_capture_keys=(*self.earlier_capture_keys, self.episode.capture_key),
        )

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-ready map of plain types."""
        return {
            "instance_id": self.instance_id,
            "rollout_id": self.episode.rollout_id,
            "attempt": self.episode.attempt,
            "turns": list(self.turns),
            "state": self.state,
            "staging_keys": sorted(self.staging_keys),
            "earlier_capture_keys": list(self.earlier_capture_keys),
        }

    @classmethod
    def from_wire(cls, data: Any) -> SessionRecord:
        """Rebuild a record from ``to_wire``'s map; raises ValueError on any other shape."""
        if not isinstance(data, dict):
            raise ValueError(f"a session record must be a map, not {type(data).__name__}")
        try:
            turns = data["turns"]
            state = data["state"]
            keys = data["staging_keys"]
            earlier = data["earlier_capture_keys"]
            instance_id = data["instance_id"]
            episode = EnvironmentEpisode(data["rollout_id"], data["attempt"])
        except KeyError as exc:
            raise ValueError(f"a session record lacks the field {exc.args[0]!r}") from None
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError("a session record's instance_id must be a non-empty string")
        if not isinstance(turns, list) or not all(isinstance(t, bytes) for t in turns):
            raise ValueError("a session record's turns must be a list of bytes")
        if not isinstance(state, bytes):
            raise ValueError("a session record's state must be bytes")
        for name, seq in (("staging_keys", keys), ("earlier_capture_keys", earlier)):
            if not isinstance(seq, list) or not all(isinstance(k, str) for k in seq):
                raise ValueError(f"a session record's {name} must be a list of strings")
        return cls(
            instance_id=instance_id,
            episode=episode,
            turns=tuple(turns),
            state=state,
            staging_keys=frozenset(keys),
            earlier_capture_keys=tuple(earlier),
        )
