"""Sessions: the rollout state an environment backend keeps between turns.

``SessionRecord`` is the pure data of one session as it is captured, written to a
shard and restored. Turn records and environment state are opaque bytes that the
environment serializes itself; nemo-ckpt never unpickles anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.transport import Actor, Transport

__all__ = ["SessionRecord", "SessionClient", "Turn", "check_staging_keys", "encode_row",
           "encode_turns", "body_head", "bin_header", "record_parts", "record_of",
           "NO_TURNS"]


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
    """

    instance_id: str
    episode: EnvironmentEpisode
    turns: tuple[bytes, ...] = ()
    state: bytes = b""
    staging_keys: frozenset[str] = frozenset()
    earlier_capture_keys: tuple[str, ...] = ()
    directory: str | None = None

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


# --- a session as holders keep it and shards store it (format 3) ---------------------------
#
# row:    msgpack [rollout_id, attempt, [staging keys, sorted], turns, [earlier keys]]
#         what a capture reports, and the shard's index entry: small, read without the
#         session's bytes
# turns:  msgpack [turn record, ...]: the turn records, kept encoded
# state:  the environment's state, the bytes object as it arrived
# A shard stores a session's body as the msgpack array [turns, state]: its turns blob,
# then the state as a bin object, so a holder writes and reads it without re-encoding.

NO_TURNS = b"\x90"  # msgpack's empty array: the turns of a session just opened


def encode_row(rollout_id: str, attempt: int, staging_keys: Iterable[str], turns: int,
               earlier_capture_keys: Iterable[str]) -> bytes:
    """A session's row (see above)."""
    return _PACK([rollout_id, attempt, sorted(staging_keys), turns,
                  list(earlier_capture_keys)])


def encode_turns(turns: Iterable[bytes]) -> bytes:
    """A session's turns blob (see above)."""
    turns = list(turns)
    return _PACK(turns) if turns else NO_TURNS


def body_head(turns_blob: bytes, state_length: int) -> bytes:
    """What precedes the state in a session's body: the array header, the turns blob,
    the state's bin header."""
    return b"\x92" + turns_blob + bin_header(state_length)


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
                       record.earlier_capture_keys),
            encode_turns(record.turns), bytes(record.state))


def record_of(instance_id: str, row: Any, turns_blob: bytes, state: bytes) -> SessionRecord:
    """The ``SessionRecord`` of a decoded row, its turns blob and its state; ValueError on
    any other shape (a shard is verified by its hash before this runs, so this only
    catches a file some other tool wrote)."""
    try:
        rollout_id, attempt, keys, turns, earlier = row
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
    return SessionRecord(instance_id, EnvironmentEpisode(rollout_id, attempt),
                         tuple(turn_records), state, frozenset(keys), tuple(earlier))


def _PACK(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class Turn:
    """One turn in flight: read the session as it was, then ``complete`` it.

    The turn commits when its ``async with`` block exits cleanly after ``complete``;
    on an exception, or without ``complete``, it aborts and records nothing.
    """

    def __init__(self, session: SessionRecord) -> None:
        self.session = session
        self._result: tuple[bytes, bytes, frozenset[str]] | None = None

    @property
    def state(self) -> bytes:
        """The environment state after the session's last committed turn."""
        return self.session.state

    @property
    def turns(self) -> tuple[bytes, ...]:
        """The session's committed turn records, oldest first."""
        return self.session.turns

    @property
    def directory(self) -> Path | None:
        """The session's sandbox directory, if it owns one: change it only inside turns."""
        d = self.session.directory
        return None if d is None else Path(d)

    def complete(self, record: bytes, state: bytes, staging_keys: Iterable[str] = ()) -> None:
        """Set what the turn commits: its record, the new state, the staging rows it wrote.

        Write every staging row before the block exits: the row must exist in the data
        plane before the turn that references it commits. Raises TypeError at once for
        a record or state that is not bytes, or staging keys that are not strings.
        """
        where = self.session.episode.capture_key
        for what, data in (("turn record", record), ("state", state)):
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"{what} of {where} must be bytes, not "
                                f"{type(data).__name__}; serialize it in the environment")
        self._result = (record, state, check_staging_keys(staging_keys, where))


class SessionClient:
    """What an environment worker uses to open, run and close sessions on its holder.

    ``await SessionClient.connect()`` finds the holder on the worker's own node;
    ``connect(instance_id=...)`` finds a named instance (after a restore onto fewer
    nodes, a node may host several). A rollout continued after a restore goes back to
    the instance that captured it (``RestoredEnvironmentRollouts.continued_attempts``).

    Usage::

        client = await SessionClient.connect()
        await client.open(episode, state=initial_state)
        async with client.turn(episode) as turn:
            new_state, record, rows = run_tool_call(turn.state)
            turn.complete(record, new_state, rows)     # commits when the block exits
        final = await client.close(episode)
    """

    def __init__(self, holder: Actor, transport: Transport) -> None:
        # None once a call found it dead or unreachable: the next call looks its
        # instance's name up again (check_startup may have made a successor).
        self._holder: Actor | None = holder
        self._transport = transport
        self.instance_id = holder.name
        # An async actor may run calls out of order, so a session's next turn waits for
        # the abort of its last one.
        self._aborting: dict[str, asyncio.Future[Any]] = {}

    @classmethod
    async def connect(
        cls, instance_id: str | None = None, namespace: str = "nemo_ckpt",
        transport: Transport | None = None,
    ) -> SessionClient:
        """Find the holder of ``instance_id``, or the first holder on this node.

        ``transport`` defaults to Ray's, for ``namespace``."""
        from nemo_ckpt.errors import SessionNotFoundError
        from nemo_ckpt.phases import instance_sort_key

        if transport is None:
            from actors.ray_transport import RayTransport
            from nemo_ckpt.config import CheckpointConfig

            transport = RayTransport(CheckpointConfig(namespace=namespace))
        namespace = transport.namespace
        if instance_id is not None:
            handle = transport.holder(instance_id)
            if handle is None:
                raise SessionNotFoundError(
                    f"no session holder {instance_id!r} in namespace {namespace!r}; it was "
                    f"never created or its node died; RayEnvironmentCheckpoint."
                    f"ensure_holders() creates holders")
            return cls(handle, transport)
        node = transport.local_node()
        handles = transport.holders()
        infos = {}
        for inst, handle in handles.items():
            with contextlib.suppress(Exception):
                infos[inst] = await transport.call(handle, "info")
        here = sorted((i for i, info in infos.items() if info.node_id == node),
                      key=instance_sort_key)
        if not here:
            raise SessionNotFoundError(
                f"no session holder on node {node} in namespace {namespace!r}; call "
                f"RayEnvironmentCheckpoint.check_startup() or ensure_holders() before "
                f"starting environment workers")
        return cls(handles[here[0]], transport)

    def _call(self, method: str, *args: Any) -> Awaitable[Any]:
        """Send ``method`` to the instance's holder now; its result's awaitable."""
        if self._holder is None:
            self._holder = self._transport.holder(self.instance_id)
            if self._holder is None:
                raise BackendUnavailableError(
                    f"holder {self.instance_id} is not running (its process or node died); "
                    f"retry once RayEnvironmentCheckpoint.check_startup() or "
                    f"ensure_holders() has started its successor")
        return self._result(self._holder, self._transport.call(self._holder, method, *args))

    async def _result(self, holder: Actor, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except BackendUnavailableError:
            if self._holder is holder:
                self._holder = None
            raise

    async def open(self, episode: EnvironmentEpisode, state: bytes = b"",
                   directory: str | os.PathLike[str] | None = None) -> SessionRecord:
        """Open a session for ``episode`` with its initial state and, optionally, the
        sandbox directory it owns (inside ``CheckpointConfig.sandbox_root``, on this
        node). Its tree is recorded now and at every turn commit; a restore gives the
        continued attempt its copy (``SessionRecord.directory``)."""
        return await self._call("open_session", episode, state,
                                None if directory is None else os.fspath(directory))

    async def open_many(self, sessions: Iterable[tuple[EnvironmentEpisode, bytes]]) -> int:
        """Open many sessions in one call: ``(episode, initial state)`` each, all or none
        (a batch of rollouts, a group of samples per prompt). Returns how many."""
        return int(await self._call("open_sessions", list(sessions)))

    async def get(self, episode: EnvironmentEpisode) -> SessionRecord:
        """The live session of ``episode``."""
        return await self._call("get_session", episode.capture_key)

    @contextlib.asynccontextmanager
    async def turn(self, episode: EnvironmentEpisode) -> AsyncIterator[Turn]:
        """Run one turn of ``episode``'s session. Waits while the holder is paused.

        The caller owns the turn: its token is made here, so a turn whose caller goes
        away (an exception, a cancellation, even while waiting at a closed gate) is
        aborted with it, and never stays open on the holder. A dead worker's turn ends
        at ``CheckpointConfig.turn_timeout_s``."""
        pending = self._aborting.get(episode.capture_key)
        if pending is not None:
            await asyncio.wait([pending])
        token = self._transport.runtime.token()
        try:
            session = await self._call("begin_turn", episode, token)
        except BaseException:
            self._abort(episode, token)  # its begin may still be on its way
            raise
        turn = Turn(session)
        try:
            yield turn
        except BaseException:
            self._abort(episode, token)
            raise
        if turn._result is None:
            self._abort(episode, token)
            raise ValueError(
                f"turn of {episode.capture_key} exited without turn.complete(record, "
                f"state, staging_keys); nothing was recorded")
        record, state, keys = turn._result
        try:
            turn.session = await self._call("commit_turn", episode, token, record, state,
                                            keys)
        except BaseException:
            self._abort(episode, token)  # a no-op if the commit landed
            raise

    def _abort(self, episode: EnvironmentEpisode, token: str) -> None:
        """Abort a turn without waiting: sent even from a cancelled task. Its outcome
        only orders the session's next turn; a failed abort leaves the turn to
        ``turn_timeout_s`` and the next begin reports what is wrong."""
        key = episode.capture_key
        try:
            sent = self._call("abort_turn", episode, token)
        except asyncio.CancelledError:
            return  # this process is going away; its turns end at turn_timeout_s
        except Exception:  # no holder to abort at: its turns died with it
            return
        done = asyncio.ensure_future(sent)
        self._aborting[key] = done

        def forget(f: asyncio.Future[Any]) -> None:
            if not f.cancelled():
                f.exception()
            if self._aborting.get(key) is f:
                del self._aborting[key]
        done.add_done_callback(forget)

    async def close(self, episode: EnvironmentEpisode) -> SessionRecord:
        """Close ``episode``'s finished session and return its final record."""
        return await self._call("close_session", episode.capture_key)

    async def sessions(self) -> list[SessionRecord]:
        """Every live session of this instance."""
        return await self._call("sessions")
