"""A session's record and its row codec: the rollout state an environment backend keeps
between turns, as it is captured, written to a shard and restored.

``SessionRecord`` is the pure data of one session. Turn records and environment state
are opaque bytes that the environment serializes itself; nemo-ckpt never unpickles
anything. Holders keep a session encoded (its row, its turns blob, its state) and
shards store it so; the functions below convert between the two.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from nemo_ckpt.interfaces import EnvironmentEpisode

__all__ = ["EnvironmentClass", "SessionRecord", "SessionHead", "check_staging_keys", "encode_row",
           "encode_turns", "body_head", "bin_header", "array_header", "turn_items",
           "record_parts", "record_of", "row_is_finished", "NO_TURNS"]


def check_staging_keys(staging_keys: Iterable[str], where: str) -> frozenset[str]:
    """``staging_keys`` as a frozenset, or TypeError: a collection of non-empty strings,
    not one string (whose letters would each become a key)."""
    if isinstance(staging_keys, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"staging keys of {where} must be a collection of strings, not one "
            f"{type(staging_keys).__name__} ({staging_keys!r}); pass [key]")
    try:
        keys = frozenset(staging_keys)
    except TypeError:
        raise TypeError(f"staging keys of {where} must be a collection of strings, not "
                        f"{type(staging_keys).__name__}") from None
    bad = [k for k in keys if not isinstance(k, str) or not k]
    if bad:
        raise TypeError(f"staging keys of {where} must be non-empty strings; got "
                        f"{sorted(map(repr, bad))[:5]}")
    return keys


class EnvironmentClass(str, enum.Enum):
    """How much of a session a snapshot can capture (the classes:
    ``nemo_ckpt.sandbox_backend``)."""

    CAPTURABLE = "capturable"
    RESTART_ONLY = "restart_only"
    STATELESS = "stateless"


# slots: a holder keeps one record per live session; without a __dict__ a record is one
# 64-byte object instead of an object plus a dict, which pickling (every reply) builds.
@dataclass(frozen=True, slots=True)
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
        directory: The sandbox directory the session owns on its node, if any (after a
            restore, the one the restore made for this attempt).
        container: The name of the container the session owns on its node, if any
            (after a restore, the one the restore created for this attempt).
        restart_only: Whether the session was opened restart-only (or made so: a
            container that needs its memory where CRIU does not work): snapshots never
            capture it.
        result: The finished rollout's result, once its worker handed it in
            (``SessionClient.finish``); None while the rollout runs.
    """

    instance_id: str
    episode: EnvironmentEpisode
    turns: tuple[bytes, ...] = ()
    state: bytes = b""
    staging_keys: frozenset[str] = frozenset()
    earlier_capture_keys: tuple[str, ...] = ()
    directory: str | None = None
    result: bytes | None = None
    container: str | None = None
    restart_only: bool = False

    @property
    def environment_class(self) -> EnvironmentClass:
        """What a snapshot captures of this session (``nemo_ckpt.sandbox_backend``)."""
        if self.restart_only:
            return EnvironmentClass.RESTART_ONLY
        if self.directory is not None or self.container is not None:
            return EnvironmentClass.CAPTURABLE
        return EnvironmentClass.STATELESS

    @property
    def finished(self) -> bool:
        """Whether the rollout was handed in as finished (it runs no more turns)."""
        return self.result is not None

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

    def head(self) -> SessionHead:
        """This session without its turn records (``SessionHead``)."""
        return SessionHead(self.instance_id, self.episode, len(self.turns), self.state,
                           self.directory, self.container, self.restart_only)

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


@dataclass(frozen=True, slots=True)
class SessionHead:
    """A session as a turn sees it: everything a turn needs, and its turn records'
    count instead of the records. What ``begin_turn`` and ``commit_turn`` carry, so a
    turn's cost does not grow with its rollout's length; a worker reads earlier turn
    records only when it asks (``SessionClient.read_turns``). ``SessionRecord``'s
    fields of the same names mean the same."""

    instance_id: str
    episode: EnvironmentEpisode
    turn_count: int
    state: bytes
    directory: str | None = None
    container: str | None = None
    restart_only: bool = False


# --- a session as holders keep it and shards store it (format 3) ---------------------------
#
# row:    msgpack [rollout_id, attempt, [staging keys], turns, [earlier keys]]
#         what a capture reports, and the shard's index entry: small, read without the
#         session's bytes; a finished session's row has a sixth element, true, and its
#         state slot holds the result (a finished rollout has no further state)
# turns:  msgpack [turn record, ...]: the turn records, kept encoded
# state:  the environment's state, the bytes object as it arrived
# A shard stores a session's body as the msgpack array [turns, state]: its turns blob,
# then the state as a bin object, so a holder writes and reads it without re-encoding.
# The staging keys are a set: a session opened here lists them sorted, and each turn
# appends its own (``actors.holder.session_table.Held.with_turn``), so a key two turns wrote
# appears twice; every reader takes them as a set (before issue 39 they were sorted).

NO_TURNS = b"\x90"  # msgpack's empty array: the turns of a session just opened


def encode_row(rollout_id: str, attempt: int, staging_keys: Iterable[str], turns: int,
               earlier_capture_keys: Iterable[str], finished: bool = False) -> bytes:
    """A session's row (see above)."""
    row: list[Any] = [rollout_id, attempt, sorted(staging_keys), turns,
                      list(earlier_capture_keys)]
    if finished:
        row.append(True)
    return _PACK(row)


def row_is_finished(row: Any) -> bool:
    """Whether a decoded row is a finished session's (see above)."""
    return len(row) > 5 and row[5] is True


def encode_turns(turns: Iterable[bytes]) -> bytes:
    """A session's turns blob (see above)."""
    turns = list(turns)
    return _PACK(turns) if turns else NO_TURNS


def body_head(turns_blob: bytes | Sequence[bytes | memoryview], state_length: int) -> bytes:
    """What precedes the state in a session's body: the array header, the turns blob
    (or the pieces it is joined from), the state's bin header."""
    if isinstance(turns_blob, bytes):
        return b"\x92" + turns_blob + bin_header(state_length)
    return b"".join((b"\x92", *turns_blob, bin_header(state_length)))


def array_header(n: int) -> bytes:
    """msgpack's header of an array of ``n`` items (fixarray, array 16 or 32)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def turn_items(turns_blob: bytes | memoryview, count: int) -> memoryview:
    """A turns blob's items without its array header, uncopied; ValueError unless it
    starts with the header of an array of ``count`` items (its row's claim: the pieces
    a holder appends to are written back behind ``array_header(count)``)."""
    first = turns_blob[0] if turns_blob else -1
    skip = 1 if 0x90 <= first <= 0x9f else 3 if first == 0xdc else 5 if first == 0xdd \
        else 0
    if not skip or len(turns_blob) < skip:
        raise ValueError("a session's turns are not a msgpack array")
    held = first & 0x0f if skip == 1 else int.from_bytes(turns_blob[1:skip], "big")
    if held != count:
        raise ValueError(f"a session's row says {count} turns, its body holds {held}")
    return memoryview(turns_blob)[skip:]


def bin_header(n: int) -> bytes:
    """msgpack's header of a bin object of ``n`` bytes (bin 8, 16 or 32)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def record_parts(record: SessionRecord) -> tuple[bytes, bytes, bytes]:
    """``(row, turns blob, state)`` of ``record``."""
    ep = record.episode
    return (encode_row(ep.rollout_id, ep.attempt, record.staging_keys, len(record.turns),
                       record.earlier_capture_keys, record.finished),
            encode_turns(record.turns),
            bytes(record.result if record.result is not None else record.state))


def record_of(instance_id: str, row: Any, turns_blob: bytes | memoryview,
              state: bytes) -> SessionRecord:
    """The ``SessionRecord`` of a decoded row, its turns blob and its state; ValueError on
    any other shape (a shard is verified by its hash before this runs, so this only
    catches a file some other tool wrote)."""
    try:
        rollout_id, attempt, keys, turns, earlier = row[:5] if len(row) == 6 else row
        finished = row_is_finished(row)
        if len(row) == 6 and not finished:
            raise ValueError("a sixth row element other than true")
        turn_records = msgpack.unpackb(turns_blob, raw=False, use_list=True)
    except (TypeError, ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"a session row or its turns have the wrong shape ({exc})") from None
    if not isinstance(turn_records, list) or len(turn_records) != turns \
            or not all(isinstance(t, bytes) for t in turn_records):
        raise ValueError(f"session {rollout_id!r} says {turns} turns but holds other turn "
                         f"records")
    if not isinstance(state, bytes):
        raise ValueError(f"the state of session {rollout_id!r} is not bytes")
    for name, seq in (("staging keys", keys), ("earlier capture keys", earlier)):
        if not isinstance(seq, list) or not all(isinstance(k, str) for k in seq):
            raise ValueError(f"the {name} of session {rollout_id!r} are not a list of "
                             f"strings")
    if finished:
        return SessionRecord(instance_id, EnvironmentEpisode(rollout_id, attempt),
                             tuple(turn_records), b"", frozenset(keys), tuple(earlier),
                             result=state)
    return SessionRecord(instance_id, EnvironmentEpisode(rollout_id, attempt),
                         tuple(turn_records), state, frozenset(keys), tuple(earlier))


def _PACK(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)
