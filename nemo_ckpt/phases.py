"""What holders report to the coordinator, phase by phase: pure data, no Ray.

The call order of a snapshot's and a restore's phases is stated once, numbered, on
``nemo_ckpt.protocol.holder_api.HolderControl``; each report here names the call that returns it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = [
    "ChunkHashes",
    "TreesRef",
    "ShardRef",
    "HolderState",
    "HolderInfo",
    "PauseReport",
    "CaptureReport",
    "CapturedSession",
    "encode_captured_session",
    "join_captured",
    "PersistReport",
    "RestorePrepared",
    "instance_sort_key",
]


def instance_sort_key(instance_id: str) -> tuple[int, str]:
    """Orders ``holder-2`` before ``holder-10``; ids of another shape sort last."""
    head, _, tail = instance_id.rpartition("-")
    return (int(tail), head) if tail.isdigit() else (1 << 30, instance_id)


class HolderState(str, enum.Enum):
    """The states of a session holder. Each refuses the calls that do not fit it."""

    RUNNING = "running"      # turns flow; snapshots and restores may start
    PAUSED = "paused"        # for one snapshot id, under a lease; new turns wait
    RESTORING = "restoring"  # for one restore id, under a lease; new turns wait
    STOPPED = "stopped"      # a stop snapshot parked its sessions: no new session or turn
                             # runs until a restore commits


@dataclass(frozen=True)
class HolderInfo:
    """A holder as ``status`` shows it."""

    instance_id: str
    node_id: str
    state: HolderState
    operation_id: str | None  # the snapshot or restore id it is paused or restoring for
    lease_expires_in_s: float | None
    sessions: int
    turns_in_flight: int
    last_snapshot_id: str | None
    # What it was made with (``actors.coordinator.actor.holder_options``): a holder found
    # alive keeps them, whatever config the coordinator that finds it has.
    options: Mapping[str, Any] = field(default_factory=dict)
    # Why it writes no spans to ``CheckpointConfig.trace_file`` (None: it does, or none
    # is set); ``check_startup`` warns with it.
    trace_problem: str | None = None
    # When its node drains with a deadline, that deadline in seconds since the epoch, as
    # the cluster gives it (``RayEnvironmentCheckpoint.draining_holders``); else None.
    drain_deadline: float | None = None
    # Sandboxes a provider made for an earlier holder of its instance (a dead
    # incarnation's sessions), removed as this one started
    # (``nemo_ckpt.sandboxes.provided``).
    sandboxes_removed_at_start: int = 0


@dataclass(frozen=True)
class PauseReport:
    """The pause phase of one holder (``pause``, or ``begin``'s first half)."""

    instance_id: str
    drain_seconds: float
    # Still in flight at the drain deadline: they restart (a stop snapshot captures
    # them as of their last committed turn).
    turns_in_flight: int


# (rollout_id, attempt, staging_keys, turns) of one captured session.
CapturedSession = tuple[str, int, list[str], int]


def encode_captured_session(session: CapturedSession) -> bytes:
    """One session's part of ``captured_msgpack``: holders keep it ready per session, so
    that the capture, while paused, only joins bytes."""
    return msgpack.packb(session, use_bin_type=True)


def join_captured(encoded: list[bytes]) -> bytes:
    """``captured_msgpack`` from sessions encoded by ``encode_captured_session``."""
    # One join: ``header + b"".join(...)`` would hold the joined rows twice at once.
    return b"".join([msgpack.Packer().pack_array_header(len(encoded)), *encoded])


@dataclass(frozen=True)
class CaptureReport:
    """What one holder captured (``capture``, or ``begin``'s second half).

    ``captured_msgpack`` lists ``(rollout_id, attempt, staging_keys, turns)`` per
    captured session (what the manifest lists; the coordinator builds the manifest's
    rollouts from it), msgpack-encoded: it crosses holder -> coordinator -> driver at
    the yield, and one ``bytes`` ships in microseconds where tens of thousands of tuples
    took milliseconds to pickle at every hop. It is decoded only where it is used.
    ``restarting`` is ``(rollout_id, attempt)`` per session mid-turn at the deadline, or
    restart-only (``restart_only_count`` of them; ``nemo_ckpt.sandbox_backend``).
    """

    instance_id: str
    captured_msgpack: bytes
    captured_count: int
    restarting: tuple[tuple[str, int], ...]
    capture_seconds: float
    state_bytes: int  # of the captured sessions as held: turn records and states
    finished_count: int = 0  # of them, finished rollouts not acknowledged yet
    # Rollouts started over since the holder started because a replay of their recorded
    # steps returned something else (nemo_ckpt.adapters; SessionClient.replay_diverged).
    replay_restarts: int = 0
    restart_only_count: int = 0
    # Staging keys of captured sessions' turns whose commit failed recording their
    # sandbox (the worker got the error): rows RL wrote for turns that never committed.
    unrecorded_keys: tuple[str, ...] = ()

    def rows(self) -> list[list[Any]]:
        """The captured sessions as msgpack decodes them, ``[rollout_id, attempt,
        staging_keys, turns]`` each: no Python object per session beyond the decoder's."""
        rows: list[list[Any]] = msgpack.unpackb(self.captured_msgpack, raw=False,
                                                use_list=True)
        return rows

    def captured(self) -> list[CapturedSession]:
        """The captured sessions, decoded."""
        return [(row[0], row[1], row[2], row[3]) for row in self.rows()]


@dataclass(frozen=True)
class ChunkHashes:
    """A shard's bytes in chunks of ``bytes`` each (the last one may be shorter), and
    each chunk's hex digest in the shard's hash algorithm, in the file's order."""

    bytes: int
    hashes: tuple[str, ...]


@dataclass(frozen=True)
class TreesRef:
    """The file of a shard's sessions' directory trees, beside the shard, and what
    writing it stored: how many sessions own a sandbox, the blobs they reference, and
    how many of those (and their bytes) this snapshot wrote."""

    file: str
    bytes: int
    content_hash: str  # "<algorithm>:<hex digest>"
    sandboxes: int
    blobs: int
    new_blobs: int
    new_blob_bytes: int


@dataclass(frozen=True)
class ShardRef:
    """One shard file as the coordinator and a holder name it to each other: what the
    holder wrote (``finish_persist``) and what it reads back (``prepare_restore``,
    ``prefetch``). The wire's own type, not the manifest's ``ShardEntry``: the one
    conversion between them (``nemo_ckpt.shard_refs``) keeps a change of the format on
    disk from reaching the calls between processes. ``finished``: how many of its
    sessions are finished rollouts RL has not acknowledged (None: none)."""

    file: str
    bytes: int
    content_hash: str  # "<algorithm>:<hex digest>"
    instance_id: str
    sessions: int
    chunks: ChunkHashes | None = None
    trees: TreesRef | None = None
    finished: int | None = None


@dataclass(frozen=True)
class PersistReport:
    """What one holder wrote (``finish_writes``). The rollouts in it are the holder's
    capture."""

    instance_id: str
    shards: tuple[ShardRef, ...]
    persist_seconds: float
    bytes_written: int


@dataclass(frozen=True)
class RestorePrepared:
    """One holder's verified, not yet live, restore (``prepare_restore``).

    What each shard holds ships as msgpack bytes, ``[[rollout_id, captured attempt],
    ...]`` per shard, and the holder's live rollouts as one msgpack list: one ``bytes``
    each, however many sessions, decoded only where they are used."""

    instance_id: str
    staging_keys: frozenset[str] = field(default_factory=frozenset)
    bytes_read: int = 0
    read_seconds: float = 0.0  # its shards read, verified and decoded into sessions
    shard_sessions: tuple[tuple[str, bytes], ...] = ()
    live_rollouts: bytes = b"\x90"  # the rollouts live on the holder now, for conflicts
    # ``[[rollout_id, attempt, result], ...]``: sessions of finished rollouts, installed as
    # captured (not continued) and handed back to RL (``nemo_ckpt.receipts``).
    finished: bytes = b"\x90"

    def finished_results(self) -> list[tuple[str, int, bytes]]:
        """``(rollout_id, attempt, result)`` of every finished session it read."""
        return [(rid, att, result)
                for rid, att, result in msgpack.unpackb(self.finished, raw=False)]

    def sessions_by_shard(self) -> list[tuple[str, list[tuple[str, int]]]]:
        """``(shard file, [(rollout_id, captured attempt), ...])`` per shard read."""
        return [(file, [(rid, att) for rid, att in msgpack.unpackb(data, raw=False)])
                for file, data in self.shard_sessions]

    def continued(self) -> list[tuple[str, int]]:
        """``(rollout_id, captured attempt)`` of every session it will make live."""
        return [pair for _, pairs in self.sessions_by_shard() for pair in pairs]

    def live(self) -> list[str]:
        """The rollouts live on the holder when it prepared."""
        live: list[str] = msgpack.unpackb(self.live_rollouts, raw=False)
        return live
