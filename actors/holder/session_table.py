"""The sessions one holder keeps, each held encoded, as a shard stores it.

A holder's memory should be its sessions' bytes. So each live session is one small
slotted ``Held``: its rollout id, its attempt, and its bytes (``nemo_ckpt.session_record``):

- ``row``, its index entry ``[rollout_id, attempt, staging keys, turns, earlier keys]``
  (and ``true`` after them once the rollout finished), which a capture joins and the
  shard's index is made of;
- its turn records as msgpack items in a few pieces, appended to by each turn and
  never decoded or re-encoded there (``Held.with_turn``);
- ``state``, the environment's state: the bytes object the call brought, not a copy
  (a copy would leave the original's memory as a hole between live sessions); once the
  rollout finished, its result (``nemo_ckpt.receipts``).

No Python object is kept per turn record, per staging key or per episode; a
``SessionRecord`` is decoded only when a reader asks for one (a turn carries a
``SessionHead``, which holds no turn records).
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
    array_header,
    bin_header,
    encode_row,
    record_of,
    row_is_finished,
    turn_items,
)

__all__ = ["Held", "SessionTable"]

_ATTEMPT_SUFFIX = re.compile(r"^(?P<rollout>.+)-a(?P<attempt>[0-9]+)$")


class Held:
    """One live session, encoded: its row, its turn records as msgpack items in a few
    pieces (``pieces``, oldest first: joined behind ``array_header(turn_count)`` they
    are the turns blob a shard stores), its state.

    A turn appends (``with_turn``): its record becomes one more piece, and the last
    pieces are joined while the one before is no longer than the newest (a binary
    counter: each byte is copied a few times in all, never once per turn), up to
    ``_PIECE_JOIN_MAX``, so a turn's cost does not grow with the rollout's length. Its
    staging keys are appended to the row's keys, as packed, in the order turns wrote
    them (a key two turns wrote is listed twice; readers take them as a set)."""

    __slots__ = ("rollout_id", "attempt", "row", "pieces", "turn_count", "turn_bytes",
                 "state", "finished", "last_turn", "_keys", "_key_count", "_earlier")

    def __init__(self, rollout_id: str, attempt: int, row: bytes,
                 pieces: tuple[bytes | memoryview, ...], turn_count: int,
                 state: bytes | memoryview,
                 finished: bool = False, last_turn: str | None = None) -> None:
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.row = row
        self.pieces = pieces
        self.turn_count = turn_count
        self.turn_bytes = sum(len(p) for p in pieces)
        self.state = state
        self.finished = finished
        # The token of the session's last committed turn (None before one commits here):
        # the history ``SessionHolder.resolve_turn`` answers from, one token per live
        # session, gone with it.
        self.last_turn = last_turn
        # The row's staging keys as packed items, their count, and its earlier capture
        # keys as a packed array: read from the row at the session's first turn here.
        self._keys: bytes | None = None
        self._key_count = 0
        self._earlier = b""

    @property
    def size(self) -> int:
        """Bytes of its turns blob and state, as a shard stores them."""
        return len(array_header(self.turn_count)) + self.turn_bytes + len(self.state)

    @property
    def capture_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def episode(self) -> EnvironmentEpisode:
        return EnvironmentEpisode(self.rollout_id, self.attempt)

    def turns_pieces(self) -> tuple[bytes | memoryview, ...]:
        """The turns blob as the pieces it is joined from."""
        return (array_header(self.turn_count), *self.pieces)

    def turns_blob(self) -> bytes:
        """The turns blob: the msgpack array of its turn records."""
        return b"".join(self.turns_pieces()) if self.pieces else NO_TURNS

    def read_turns(self, start: int, stop: int) -> list[bytes]:
        """Its turn records ``start`` to ``stop`` (decoded now: only these are built)."""
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(self.turn_bytes, 1))
        for piece in self.pieces:
            unpacker.feed(piece)
        for _ in range(start):
            unpacker.skip()
        return [unpacker.unpack() for _ in range(start, stop)]

    def with_turn(self, record: bytes, state: bytes, staging_keys: frozenset[str],
                  token: str) -> Held:
        """This session after one more turn: ``record`` appended, ``state`` in place of
        its state, ``staging_keys`` added; nothing earlier decoded or re-encoded."""
        if self._keys is None:
            row = msgpack.unpackb(self.row, raw=False, use_list=True)
            self._keys = b"".join(_PACK(k) for k in row[2])
            self._key_count = len(row[2])
            self._earlier = _PACK(row[4])
        keys = self._keys + b"".join(_PACK(k) for k in sorted(staging_keys))
        key_count = self._key_count + len(staging_keys)
        pieces = [*self.pieces, bin_header(len(record)) + record]
        while len(pieces) > 1 and len(pieces[-2]) <= len(pieces[-1]) \
                and len(pieces[-2]) + len(pieces[-1]) <= _PIECE_JOIN_MAX:
            pieces[-2:] = [b"".join(pieces[-2:])]
        turn_count = self.turn_count + 1
        row = b"".join((b"\x95", _PACK(self.rollout_id), _PACK(self.attempt),
                        array_header(key_count), keys, _PACK(turn_count), self._earlier))
        held = Held(self.rollout_id, self.attempt, row, tuple(pieces), turn_count,
                    state if type(state) is bytes else bytes(state), last_turn=token)
        held._keys, held._key_count, held._earlier = keys, key_count, self._earlier
        return held

    def finish(self, result: bytes) -> Held:
        """This session with its rollout handed in as finished: the result takes the
        state's place."""
        row = msgpack.unpackb(self.row, raw=False, use_list=True)
        return Held(self.rollout_id, self.attempt,
                    msgpack.packb([*row[:5], True], use_bin_type=True), self.pieces,
                    self.turn_count, result if type(result) is bytes else bytes(result),
                    finished=True, last_turn=self.last_turn)

    @classmethod
    def fresh(cls, episode: EnvironmentEpisode, state: bytes) -> Held:
        """A session just opened: no turn, no staging key."""
        return cls(episode.rollout_id, episode.attempt,
                   encode_row(episode.rollout_id, episode.attempt, (), 0, ()),
                   (), 0, state if type(state) is bytes else bytes(state))

    @classmethod
    def continued(cls, row: list[Any], turns: bytes | memoryview,
                  state: bytes | memoryview) -> Held:
        """A captured session as a restore installs it: the next attempt, remembering
        the captured attempt's capture key; its turns and state unchanged, as the read
        handed them on (views of the bytes read: ``state_bytes`` copies the state once
        a caller needs it, until a turn replaces it). A finished one is installed as it
        was captured, at its attempt, with its result."""
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
        items = turn_items(turns, n_turns)
        pieces = (items,) if len(items) else ()
        if finished:
            return cls(rollout_id, attempt, msgpack.packb(row, use_bin_type=True), pieces,
                       n_turns, state, finished=True)
        captured = rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"
        return cls(rollout_id, attempt + 1,
                   msgpack.packb([rollout_id, attempt + 1, keys, n_turns, [*earlier, captured]],
                                 use_bin_type=True),
                   pieces, n_turns, state)

    def state_bytes(self) -> bytes:
        """Its state (a finished session's result) as bytes, as it travels."""
        state = self.state
        return state if type(state) is bytes else bytes(state)

    def record(self, instance_id: str) -> SessionRecord:
        return record_of(instance_id, msgpack.unpackb(self.row, raw=False, use_list=True),
                         self.turns_blob(), self.state_bytes())


# The largest piece appending joins: past it a session's turns stay in pieces of about
# this size, so no turn copies more than this (benchmarks/turns.py).
_PIECE_JOIN_MAX = 1 << 20


def _PACK(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


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
