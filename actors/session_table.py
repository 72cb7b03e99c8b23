"""The sessions one holder keeps, each held encoded, as a shard stores it.

A holder's memory should be its sessions' bytes. So each live session is one small
slotted ``Held``: its rollout id, its attempt, and three ``bytes`` (``nemo_ckpt.session_record``):

- ``row``, its index entry ``[rollout_id, attempt, staging keys, turns, earlier keys]``
  (and ``true`` after them once the rollout finished), which a capture joins and the
  shard's index is made of;
- ``turns``, its turn records as one msgpack array (one shared constant until a turn);
- ``state``, the environment's state: the bytes object the call brought, not a copy
  (a copy would leave the original's memory as a hole between live sessions); once the
  rollout finished, its result (``nemo_ckpt.receipts``).

No Python object is kept per turn record, per staging key or per episode; a
``SessionRecord`` is decoded only when a caller needs one (a turn begins, a reader asks).
A capture joins rows, a shard is written from these bytes as they are, and a restore
installs rows, turns and states read from the shard: the snapshot and restore paths do
no per-session encoding.

Sessions are found by rollout id (a rollout has at most one live session). Capture keys
(``r`` for attempt 0, ``r-a2`` for attempt 2) of two different episodes can collide when
a rollout id itself ends in ``-a<digits>``; ``collision`` finds that without a second map.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgpack

from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.session_record import (
    NO_TURNS,
    SessionRecord,
    encode_row,
    record_of,
    record_parts,
    row_is_finished,
)

__all__ = ["Held", "SessionTable"]

_ATTEMPT_SUFFIX = re.compile(r"^(?P<rollout>.+)-a(?P<attempt>[0-9]+)$")


class Held:
    """One live session, encoded."""

    __slots__ = ("rollout_id", "attempt", "row", "turns", "state", "finished", "last_turn")

    def __init__(self, rollout_id: str, attempt: int, row: bytes, turns: bytes,
                 state: bytes, finished: bool = False, last_turn: str | None = None) -> None:
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.row = row
        self.turns = turns
        self.state = state
        self.finished = finished
        # The token of the session's last committed turn (None before one commits here):
        # the history ``SessionHolder.resolve_turn`` answers from, one token per live
        # session, gone with it.
        self.last_turn = last_turn

    @property
    def size(self) -> int:
        """Bytes of its turn records and state, as held."""
        return len(self.turns) + len(self.state)

    @property
    def capture_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def episode(self) -> EnvironmentEpisode:
        return EnvironmentEpisode(self.rollout_id, self.attempt)

    @classmethod
    def of(cls, record: SessionRecord, last_turn: str | None = None) -> Held:
        ep = record.episode
        row, turns, state = record_parts(record)
        return cls(ep.rollout_id, ep.attempt, row, turns,
                   state if record.result is not None else record.state,
                   finished=record.finished, last_turn=last_turn)

    def finish(self, result: bytes) -> Held:
        """This session with its rollout handed in as finished: the result takes the
        state's place."""
        row = msgpack.unpackb(self.row, raw=False, use_list=True)
        return Held(self.rollout_id, self.attempt,
                    msgpack.packb([*row[:5], True], use_bin_type=True), self.turns,
                    result if type(result) is bytes else bytes(result), finished=True,
                    last_turn=self.last_turn)

    @classmethod
    def fresh(cls, episode: EnvironmentEpisode, state: bytes) -> Held:
        """A session just opened: no turn, no staging key."""
        return cls(episode.rollout_id, episode.attempt,
                   encode_row(episode.rollout_id, episode.attempt, (), 0, ()),
                   NO_TURNS, state if type(state) is bytes else bytes(state))

    @classmethod
    def continued(cls, row: list[Any], turns: bytes, state: bytes) -> Held:
        """A captured session as a restore installs it: the next attempt, remembering
        the captured attempt's capture key; its turns and state unchanged. A finished
        one is installed as it was captured, at its attempt, with its result."""
        finished = row_is_finished(row)
        try:
            rollout_id, attempt, keys, n_turns, earlier = row[:5] if finished else row
            # join() refuses a non-string in C: no Python loop per key.
            "".join(keys)
            "".join(earlier)
        except (TypeError, ValueError):
            raise ValueError(f"a session row has the wrong shape: {row!r:.200}") from None
        if type(rollout_id) is not str or not rollout_id or type(attempt) is not int \
                or attempt < 0 or type(n_turns) is not int or n_turns < 0 \
                or type(keys) is not list or type(earlier) is not list:
            raise ValueError(f"a session row has the wrong shape: {row!r:.200}")
        if finished:
            return cls(rollout_id, attempt, msgpack.packb(row, use_bin_type=True), turns,
                       state, finished=True)
        captured = rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"
        return cls(rollout_id, attempt + 1,
                   msgpack.packb([rollout_id, attempt + 1, keys, n_turns, [*earlier, captured]],
                                 use_bin_type=True),
                   turns, state)

    def record(self, instance_id: str) -> SessionRecord:
        return record_of(instance_id, msgpack.unpackb(self.row, raw=False, use_list=True),
                         self.turns, self.state)


class SessionTable:
    """The live sessions of one instance, by rollout id."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self._by_rollout: dict[str, Held] = {}
        self.held_bytes = 0  # over every live session: their turn records and states
        self.finished = 0  # live sessions of finished rollouts, not acknowledged yet

    def __len__(self) -> int:
        return len(self._by_rollout)

    def __iter__(self) -> Iterator[Held]:
        return iter(self._by_rollout.values())

    def rollouts(self) -> list[str]:
        """The rollout ids of every live session."""
        return list(self._by_rollout)

    def of_rollout(self, rollout_id: str) -> Held | None:
        return self._by_rollout.get(rollout_id)

    def get(self, episode: EnvironmentEpisode) -> Held | None:
        """The live session of exactly ``episode``."""
        held = self._by_rollout.get(episode.rollout_id)
        return held if held is not None and held.attempt == episode.attempt else None

    def by_capture_key(self, capture_key: str) -> Held | None:
        held = self._by_rollout.get(capture_key)
        if held is not None and held.attempt == 0:
            return held
        match = _ATTEMPT_SUFFIX.match(capture_key)
        if match is not None:
            held = self._by_rollout.get(match["rollout"])
            if held is not None and held.attempt == int(match["attempt"]):
                return held
        return None

    def collision(self, episode: EnvironmentEpisode) -> Held | None:
        """A live session of another episode with ``episode``'s capture key."""
        held = self.by_capture_key(episode.capture_key)
        return held if held is not None and held.rollout_id != episode.rollout_id else None

    def put(self, held: Held) -> None:
        """Add a session, or replace its rollout's."""
        old = self._by_rollout.get(held.rollout_id)
        self.held_bytes += held.size - (old.size if old else 0)
        self.finished += held.finished - (old.finished if old else False)
        self._by_rollout[held.rollout_id] = held

    def drop(self, rollout_id: str) -> Held | None:
        held = self._by_rollout.pop(rollout_id, None)
        if held is not None:
            self.held_bytes -= held.size
            self.finished -= held.finished
        return held

    def sorted(self) -> list[Held]:
        """Every live session, by capture key."""
        return sorted(self._by_rollout.values(), key=lambda h: h.capture_key)
