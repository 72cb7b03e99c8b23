"""The session holder: one per node, holding the sessions of the rollouts run there.

``SessionHolder`` is a plain asyncio class with its clock, metrics and blocking-work
runner injected (``nemo_ckpt.transport.Runtime``), so its state machine runs without
Ray, in tests and in the simulation; ``actors.ray_transport.SessionHolderActor`` is the
same class as a Ray actor, pinned to its node.

States (``HolderState``) and the calls each accepts:

- RUNNING: session calls; ``pause`` (starts a snapshot); ``prepare_restore``;
  ``retire`` / ``forget``.
- PAUSED for snapshot X, under a lease: ``begin_turn`` and ``open_session`` wait at
  the closed turn gate; a turn already in flight may still commit or abort. Phases
  ``capture``, ``start_persist``, ``finish_persist``, ``renew_lease`` and ``resume``
  for X only. A call for another id is refused with ``StaleSnapshotError``; a repeated
  phase returns its first result. If the lease lapses, the holder resumes by itself
  and X can no longer commit (``LeaseExpiredError``).
- RESTORING for restore R, under a lease: the gate is closed;
  ``commit_restore`` / ``abort_restore`` / ``renew_lease`` for R only. A lapsed lease
  aborts the restore.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from nemo_ckpt.errors import (
    CaptureKeyCollisionError,
    HolderStateError,
    LeaseExpiredError,
    RestoreConflictError,
    RetiredAttemptError,
    SessionExistsError,
    SessionNotFoundError,
    StaleSnapshotError,
    StateTooLargeError,
    TurnInProgressError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.manifest import ShardEntry, shard_file_name
from nemo_ckpt.phases import (
    CaptureReport,
    HolderInfo,
    HolderState,
    PauseReport,
    PersistReport,
    RestorePrepared,
    encode_captured_session,
    join_captured,
)
from nemo_ckpt.sessions import SessionRecord
from nemo_ckpt.storage import read_shard, remove_files, write_shard
from nemo_ckpt.transport import Runtime

__all__ = ["SessionHolder", "Trimmer"]

log = logging.getLogger("nemo_ckpt.holder")

# How often the watchdog looks at the lease and at turns past their timeout.
_WATCH_PERIOD_S = 0.1


@dataclass
class _Snapshot:
    snapshot_id: str
    directory: Path | None = None  # where its shard goes, known from begin
    pause: PauseReport | None = None
    capture: dict[str, SessionRecord] | None = None
    capture_report: CaptureReport | None = None
    persist: asyncio.Task[PersistReport] | None = None


@dataclass
class _Restore:
    restore_id: str
    pending: list[SessionRecord] = field(default_factory=list)
    prepared: RestorePrepared | None = None


@dataclass
class _Turn:
    token: str
    started: float


class Trimmer(Protocol):
    """Gives freed heap memory back to the OS (``actors.heap.HeapTrimmer`` under Ray)."""

    def note(self, payload_bytes: int) -> None: ...

    def request(self) -> None: ...

    async def maybe_trim(self) -> bool: ...


class _NoTrimmer:
    def note(self, payload_bytes: int) -> None:
        del payload_bytes

    def request(self) -> None:
        return None

    async def maybe_trim(self) -> bool:
        return False


class SessionHolder:
    """Holds the sessions of one instance, and takes part in snapshots and restores."""

    def __init__(
        self,
        instance_id: str,
        node_id: str,
        max_state_bytes: int = 64 << 20,
        turn_timeout_s: float | None = None,
        runtime: Runtime | None = None,
        trimmer: Trimmer | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.node_id = node_id
        self._runtime = runtime or Runtime()
        self._clock = self._runtime.clock
        self._metrics = self._runtime.metrics
        self._max_state_bytes = max_state_bytes
        self._turn_timeout_s = turn_timeout_s
        self._sessions: dict[str, SessionRecord] = {}  # capture key -> session
        # capture key -> its capture report entry, encoded when the session changes, so
        # the capture (while every rollout waits) joins bytes instead of encoding.
        self._capture_rows: dict[str, bytes] = {}
        self._state_bytes = 0  # over self._sessions
        self._live_rollouts: dict[str, str] = {}  # rollout id -> capture key
        self._turns: dict[str, _Turn] = {}  # capture key -> turn in flight
        self._retired: set[str] = set()  # capture keys whose late turns are refused
        self._state = HolderState.RUNNING
        self._gate = asyncio.Event()
        self._gate.set()
        self._turns_done = asyncio.Condition()
        self._lease_deadline: float | None = None
        self._snapshot: _Snapshot | None = None
        self._restore: _Restore | None = None
        # Ids whose lease lapsed, or that resumed: their phases are answered, not redone.
        self._lapsed: set[str] = set()
        self._finished: set[str] = set()
        self._last_snapshot_id: str | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._injected_delays: dict[str, float] = {}
        # Gives the heap the session calls' freed buffers back to the OS (actors/heap.py):
        # they are most of a holder's growth beyond its sessions. Driven by the watchdog.
        self._heap = trimmer or _NoTrimmer()
        self._heap_state_seen = HolderState.RUNNING  # the state at the watchdog's last look

    # --- introspection -------------------------------------------------------------

    async def info(self) -> HolderInfo:
        """The holder's identity, state and load."""
        self._ensure_watchdog()
        op = self._snapshot.snapshot_id if self._snapshot else (
            self._restore.restore_id if self._restore else None)
        expires = None if self._lease_deadline is None else max(
            0.0, self._lease_deadline - self._clock.monotonic())
        return HolderInfo(
            instance_id=self.instance_id, node_id=self.node_id, state=self._state,
            operation_id=op, lease_expires_in_s=expires, sessions=len(self._sessions),
            turns_in_flight=len(self._turns), last_snapshot_id=self._last_snapshot_id,
        )

    async def sessions(self) -> list[SessionRecord]:
        """Every live session, sorted by capture key."""
        return [self._sessions[k] for k in sorted(self._sessions)]

    async def probe_storage(self, root: str) -> str:
        """Write a probe file under ``root`` and return its path (for check_startup)."""
        def write() -> str:
            directory = Path(root) / ".nemo_ckpt_probe"
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"{self.instance_id}-{uuid.uuid4().hex}"
            path.write_text(f"{self.instance_id} {self.node_id}\n")
            return str(path)

        return await self._runtime.run_blocking(write)

    async def inject_delay(self, phase: str, seconds: float) -> None:
        """Fault-injection seam for tests and drills: make ``phase`` take ``seconds``
        longer, so a fault can be aimed at it. Phases: pause, capture, persist,
        finish_persist, prepare_restore, commit_restore. 0 removes the delay."""
        known = {"pause", "capture", "persist", "finish_persist", "prepare_restore",
                 "commit_restore"}
        if phase not in known:
            raise ValueError(f"unknown phase {phase!r}; one of {sorted(known)}")
        self._injected_delays[phase] = seconds

    async def _injected_delay(self, phase: str) -> None:
        seconds = self._injected_delays.get(phase, 0.0)
        if seconds > 0:
            await asyncio.sleep(seconds)

    # --- session calls (from environment workers) ------------------------------------

    async def open_session(
        self, episode: EnvironmentEpisode, state: bytes = b""
    ) -> SessionRecord:
        """Open a session for ``episode`` with its initial state. Waits while paused."""
        self._check_episode(episode)
        self._check_size("initial state", episode, state)
        await self._wait_for_gate()
        key = episode.capture_key
        if key in self._retired:
            raise RetiredAttemptError(
                f"{self.instance_id}: attempt {key} was retired by RL; open the next "
                f"attempt instead, or forget this one first")
        if key in self._sessions:
            live = self._sessions[key].episode
            if live == episode:
                raise SessionExistsError(
                    f"{self.instance_id}: a session for {key} is already open")
            raise CaptureKeyCollisionError(
                f"{self.instance_id}: rollout {episode.rollout_id!r} attempt "
                f"{episode.attempt} has capture key {key!r}, which live session "
                f"{live.rollout_id!r} attempt {live.attempt} already uses; rename the "
                f"rollout (ids ending in '-a<digits>' collide with later attempts)")
        if episode.rollout_id in self._live_rollouts:
            other = self._live_rollouts[episode.rollout_id]
            raise SessionExistsError(
                f"{self.instance_id}: rollout {episode.rollout_id!r} already has a live "
                f"session ({other}); close or retire it before opening {key}")
        record = SessionRecord(self.instance_id, episode, (), bytes(state))
        self._heap.note(len(state))
        self._add(record)
        return record

    async def get_session(self, capture_key: str) -> SessionRecord:
        """The live session with ``capture_key``."""
        return self._session(capture_key)

    async def begin_turn(self, capture_key: str) -> tuple[str, SessionRecord]:
        """Start a turn: wait while paused, then return a turn token and the session."""
        self._ensure_watchdog()
        self._refuse_retired(capture_key)
        await self._wait_for_gate()
        record = self._session(capture_key)
        if capture_key in self._turns:
            raise TurnInProgressError(
                f"{self.instance_id}: session {capture_key} already has a turn in flight; "
                f"a session runs one turn at a time")
        token = self._runtime.token()
        self._turns[capture_key] = _Turn(token, self._clock.monotonic())
        return token, record

    async def commit_turn(
        self,
        capture_key: str,
        token: str,
        record: bytes,
        state: bytes,
        staging_keys: Iterable[str] = (),
    ) -> SessionRecord:
        """Commit a turn: append its record, replace the state, add its staging keys."""
        self._take_turn(capture_key, token)
        try:
            old = self._session(capture_key)
            self._check_size("turn record", old.episode, record)
            self._check_size("state", old.episode, state)
            new = SessionRecord(
                instance_id=old.instance_id,
                episode=old.episode,
                turns=(*old.turns, bytes(record)),
                state=bytes(state),
                staging_keys=old.staging_keys | frozenset(staging_keys),
                earlier_capture_keys=old.earlier_capture_keys,
            )
            self._heap.note(len(record) + len(state))
            self._put(new)
            return new
        finally:
            await self._notify_turn_done()

    async def abort_turn(self, capture_key: str, token: str) -> None:
        """Abort a turn: nothing it did is recorded."""
        self._take_turn(capture_key, token)
        await self._notify_turn_done()

    async def close_session(self, capture_key: str) -> SessionRecord:
        """Close a finished session and return its final record. Waits while paused."""
        await self._wait_for_gate()
        if capture_key in self._turns:
            raise TurnInProgressError(
                f"{self.instance_id}: session {capture_key} has a turn in flight; finish "
                f"the turn before closing the session")
        record = self._session(capture_key)
        self._drop(capture_key)
        return record

    # --- ledger operations (from RL, through the coordinator) ------------------------

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Drop these attempts' sessions and refuse their late turns. Returns keys dropped."""
        self._require_running("retire")
        return await self._drop_attempts(episodes, refuse_late_turns=True)

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Drop these attempts' sessions and their refusals. Returns keys dropped."""
        self._require_running("forget")
        return await self._drop_attempts(episodes, refuse_late_turns=False)

    async def _drop_attempts(self, episodes: list[EnvironmentEpisode],
                             refuse_late_turns: bool) -> list[str]:
        dropped = []
        for ep in episodes:
            key = ep.capture_key
            if refuse_late_turns:
                self._retired.add(key)
            else:
                self._retired.discard(key)
            if key in self._sessions and self._sessions[key].episode == ep:
                self._turns.pop(key, None)  # its in-flight turn can no longer commit
                self._drop(key)
                dropped.append(key)
        await self._notify_turn_done()
        return dropped

    # --- snapshot phases (from the coordinator) ---------------------------------------

    async def pause(self, snapshot_id: str, drain_timeout_s: float, lease_s: float
                    ) -> PauseReport:
        """Close the turn gate, drain turns in flight up to the deadline, take a lease."""
        self._ensure_watchdog()
        if self._snapshot and self._snapshot.snapshot_id == snapshot_id:
            if self._snapshot.pause is not None:
                return self._snapshot.pause
        elif snapshot_id in self._lapsed or snapshot_id in self._finished:
            raise self._gone(snapshot_id)
        else:
            self._require_running(f"pause for snapshot {snapshot_id}")
            self._snapshot = _Snapshot(snapshot_id)
            self._state = HolderState.PAUSED
            self._gate.clear()
            self._lease_deadline = self._clock.monotonic() + lease_s
        start = self._clock.monotonic()
        await self._injected_delay("pause")
        async with self._turns_done:
            try:
                await asyncio.wait_for(
                    self._turns_done.wait_for(lambda: not self._turns), drain_timeout_s)
            except asyncio.TimeoutError:
                pass
        snap = self._current_snapshot(snapshot_id)
        if snap.pause is None:
            snap.pause = PauseReport(self.instance_id, self._clock.monotonic() - start,
                                     len(self._turns))
            tags = {"instance": self.instance_id}
            self._metrics.observe("drain", snap.pause.drain_seconds, tags)
            self._metrics.set_gauge("sessions", float(len(self._sessions)), tags)
        return snap.pause

    async def begin(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                    directory: str) -> tuple[PauseReport, CaptureReport]:
        """``pause`` and ``capture`` in one call, the pause's hot path: one round trip.
        Idempotent like each of them.

        The write does not start here: a writer thread started before the reply leaves
        holds the GIL while the reply is serialized and delays it (~15 ms at 2,500
        sessions). ``start_persist`` (sent once every capture is in) or
        ``finish_persist`` starts it, into ``directory``."""
        pause = await self.pause(snapshot_id, drain_timeout_s, lease_s)
        capture = await self.capture(snapshot_id)
        snap = self._current_snapshot(snapshot_id)
        if snap.directory is None:
            snap.directory = Path(directory)
        return pause, capture

    async def renew_lease(self, operation_id: str, lease_s: float) -> float:
        """Extend the lease of the snapshot or restore in progress; returns seconds left."""
        if operation_id in self._lapsed:
            raise self._gone(operation_id)
        self._current_operation(operation_id)
        self._lease_deadline = self._clock.monotonic() + lease_s
        return lease_s

    async def capture(self, snapshot_id: str) -> CaptureReport:
        """Copy the idle sessions in memory; sessions mid-turn are reported restarting."""
        snap = self._current_snapshot(snapshot_id)
        if snap.capture_report is not None:
            return snap.capture_report
        await self._injected_delay("capture")
        snap = self._current_snapshot(snapshot_id)
        if snap.capture_report is not None:
            return snap.capture_report
        start = self._clock.monotonic()
        # Records are immutable: a shallow copy is a consistent, cheap capture.
        if self._turns:
            capture = {k: r for k, r in self._sessions.items() if k not in self._turns}
        else:
            capture = dict(self._sessions)
        mid_turn = [self._sessions[k] for k in self._turns if k in self._sessions]
        snap.capture = capture
        snap.capture_report = CaptureReport(
            instance_id=self.instance_id,
            captured_msgpack=join_captured([self._capture_rows[k] for k in capture]),
            captured_count=len(capture),
            restarting=tuple((r.episode.rollout_id, r.episode.attempt) for r in mid_turn),
            capture_seconds=self._clock.monotonic() - start,
            state_bytes=self._state_bytes - sum(len(r.state) for r in mid_turn),
        )
        return snap.capture_report

    async def start_persist(self, snapshot_id: str, directory: str | None = None) -> None:
        """Start writing the captured sessions' shard in the background, into
        ``directory`` or the one ``begin`` named. Repeating it is a no-op."""
        snap = self._current_snapshot(snapshot_id)
        if snap.capture is None:
            raise HolderStateError(
                f"{self.instance_id}: persist for snapshot {snapshot_id} before capture")
        if snap.directory is None:
            if directory is None:
                raise HolderStateError(
                    f"{self.instance_id}: persist for snapshot {snapshot_id} names no folder")
            snap.directory = Path(directory)
        if snap.persist is None:
            snap.persist = asyncio.ensure_future(
                self._persist(snapshot_id, snap.directory, list(snap.capture.values())))

    async def finish_persist(self, snapshot_id: str) -> PersistReport:
        """Wait for the shard to be durable, starting the write if ``start_persist`` has
        not (its message may come second). Refused once the lease has lapsed."""
        snap = self._current_snapshot(snapshot_id)
        if snap.persist is None:
            if snap.capture is None or snap.directory is None:
                raise HolderStateError(
                    f"{self.instance_id}: finish_persist for snapshot {snapshot_id}, which "
                    f"was never begun")
            await self.start_persist(snapshot_id)
        assert snap.persist is not None
        await self._injected_delay("finish_persist")
        report = await asyncio.shield(snap.persist)
        self._current_snapshot(snapshot_id)  # the lease may have lapsed while writing
        return report

    async def resume(self, snapshot_id: str) -> None:
        """Open the turn gate again. Repeating it, or after a lapsed lease, is a no-op."""
        if snapshot_id in self._lapsed or snapshot_id in self._finished:
            return
        self._current_snapshot(snapshot_id)
        self._finished.add(snapshot_id)
        self._last_snapshot_id = snapshot_id
        self._to_running()

    # --- restore phases (from the coordinator) ----------------------------------------

    async def prepare_restore(
        self, restore_id: str, directory: str, shards: list[ShardEntry], lease_s: float
    ) -> RestorePrepared:
        """Read and verify this instance's shards; nothing goes live until commit."""
        self._ensure_watchdog()
        if self._restore and self._restore.restore_id == restore_id \
                and self._restore.prepared is not None:
            return self._restore.prepared
        if restore_id in self._lapsed or restore_id in self._finished:
            raise self._gone(restore_id)
        self._require_running(f"restore {restore_id}")
        self._restore = _Restore(restore_id)
        self._state = HolderState.RESTORING
        self._gate.clear()
        self._lease_deadline = self._clock.monotonic() + lease_s
        try:
            await self._injected_delay("prepare_restore")
            records: list[SessionRecord] = []
            read = 0
            for entry in shards:
                if entry.instance_id != self.instance_id:
                    raise HolderStateError(
                        f"{self.instance_id}: asked to restore shard {entry.file} of "
                        f"{entry.instance_id}")
                records += await self._runtime.run_blocking(read_shard, Path(directory), entry)
                read += entry.bytes
            conflicts = sorted(r.episode.rollout_id for r in records
                               if r.episode.rollout_id in self._live_rollouts)
            if conflicts:
                raise RestoreConflictError(
                    f"{self.instance_id}: cannot restore rollouts {conflicts}: sessions of "
                    f"them are live here; retire or close them first, or restore into a "
                    f"fresh job")
            pending = [r.continued() for r in records]
            restore = self._current_restore(restore_id)
            restore.pending = pending
            restore.prepared = RestorePrepared(
                instance_id=self.instance_id,
                continued=tuple((r.episode.rollout_id, r.episode.attempt) for r in records),
                staging_keys=frozenset().union(*(r.staging_keys for r in records)),
                bytes_read=read,
                live_rollouts=tuple(sorted(self._live_rollouts)),
            )
            return restore.prepared
        except BaseException:
            if self._restore and self._restore.restore_id == restore_id:
                self._finished.add(restore_id)
                self._restore = None
                self._to_running()
            raise

    async def commit_restore(self, restore_id: str) -> int:
        """Make the restored sessions live and resume. Returns how many went live."""
        if restore_id in self._finished:
            return 0
        restore = self._current_restore(restore_id)
        if restore.prepared is None:
            raise HolderStateError(
                f"{self.instance_id}: commit of restore {restore_id} before it was prepared")
        await self._injected_delay("commit_restore")
        restore = self._current_restore(restore_id)
        for record in restore.pending:
            if record.episode.rollout_id in self._live_rollouts:
                raise RestoreConflictError(
                    f"{self.instance_id}: rollout {record.episode.rollout_id!r} went live "
                    f"during the restore")
        for record in restore.pending:
            self._add(record)
        self._finished.add(restore_id)
        self._restore = None
        self._to_running()
        return len(restore.pending)

    async def abort_restore(self, restore_id: str) -> None:
        """Drop what the restore prepared and resume. Idempotent."""
        if self._restore is None or self._restore.restore_id != restore_id:
            return
        self._finished.add(restore_id)
        self._restore = None
        self._to_running()

    # --- internals ------------------------------------------------------------------

    def _add(self, record: SessionRecord) -> None:
        self._put(record)
        self._live_rollouts[record.episode.rollout_id] = record.episode.capture_key

    def _put(self, record: SessionRecord) -> None:
        """Store a new or changed session, and its capture report entry."""
        key = record.episode.capture_key
        old = self._sessions.get(key)
        self._state_bytes += len(record.state) - (len(old.state) if old else 0)
        self._sessions[key] = record
        ep = record.episode
        self._capture_rows[key] = encode_captured_session(
            (ep.rollout_id, ep.attempt, sorted(record.staging_keys), len(record.turns)))

    def _drop(self, key: str) -> None:
        record = self._sessions.pop(key)
        del self._capture_rows[key]
        self._state_bytes -= len(record.state)
        self._live_rollouts.pop(record.episode.rollout_id, None)

    def _session(self, capture_key: str) -> SessionRecord:
        self._refuse_retired(capture_key)
        try:
            return self._sessions[capture_key]
        except KeyError:
            raise SessionNotFoundError(
                f"{self.instance_id}: no live session {capture_key!r}; open it first, or "
                f"connect to the instance that holds it") from None

    def _refuse_retired(self, capture_key: str) -> None:
        if capture_key in self._retired:
            raise RetiredAttemptError(
                f"{self.instance_id}: attempt {capture_key} was retired by RL; its late "
                f"turns are refused")

    def _take_turn(self, capture_key: str, token: str) -> None:
        turn = self._turns.get(capture_key)
        if turn is None or turn.token != token:
            self._refuse_retired(capture_key)
            raise TurnInProgressError(
                f"{self.instance_id}: no turn in flight for {capture_key} with that token; "
                f"it was aborted (turn timeout, retire or forget) or already finished")
        del self._turns[capture_key]

    async def _notify_turn_done(self) -> None:
        async with self._turns_done:
            self._turns_done.notify_all()

    def _check_episode(self, episode: object) -> None:
        if not isinstance(episode, EnvironmentEpisode):
            raise TypeError(f"expected an EnvironmentEpisode, got {type(episode).__name__}")

    def _check_size(self, what: str, episode: EnvironmentEpisode, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{what} of {episode.capture_key} must be bytes, not "
                            f"{type(data).__name__}; serialize it in the environment")
        if len(data) > self._max_state_bytes:
            raise StateTooLargeError(
                f"{self.instance_id}: {what} of {episode.capture_key} is {len(data)} bytes, "
                f"over the limit of {self._max_state_bytes}; keep large artefacts outside "
                f"the session or raise CheckpointConfig.max_state_bytes")

    async def _wait_for_gate(self) -> None:
        self._ensure_watchdog()
        await self._gate.wait()

    def _require_running(self, what: str) -> None:
        if self._state is not HolderState.RUNNING:
            op = self._snapshot.snapshot_id if self._snapshot else (
                self._restore.restore_id if self._restore else "?")
            raise HolderStateError(
                f"{self.instance_id} refuses {what}: it is {self._state.value} for {op}; "
                f"wait until that snapshot or restore finishes (its lease lapses in at "
                f"most {self._lease_left():.1f}s if its driver died)")

    def _lease_left(self) -> float:
        return 0.0 if self._lease_deadline is None else max(
            0.0, self._lease_deadline - self._clock.monotonic())

    def _gone(self, op_id: str) -> Exception:
        if op_id in self._lapsed:
            return LeaseExpiredError(
                f"{self.instance_id}: the lease of {op_id} lapsed, so the holder resumed "
                f"by itself and {op_id} cannot commit; retry the snapshot (renewals stopped: "
                f"was the driver or coordinator stalled or gone?)")
        return StaleSnapshotError(f"{self.instance_id}: {op_id} is already finished")

    def _current_operation(self, op_id: str) -> None:
        current = self._snapshot.snapshot_id if self._snapshot else (
            self._restore.restore_id if self._restore else None)
        if current != op_id:
            if op_id in self._lapsed or op_id in self._finished:
                raise self._gone(op_id)
            raise StaleSnapshotError(
                f"{self.instance_id}: call for {op_id}, but the holder is "
                f"{self._state.value}" + (f" for {current}" if current else ""))

    def _current_snapshot(self, snapshot_id: str) -> _Snapshot:
        self._current_operation(snapshot_id)
        assert self._snapshot is not None
        return self._snapshot

    def _current_restore(self, restore_id: str) -> _Restore:
        self._current_operation(restore_id)
        assert self._restore is not None
        return self._restore

    def _to_running(self) -> None:
        self._snapshot = None
        self._restore = None
        self._lease_deadline = None
        self._state = HolderState.RUNNING
        self._gate.set()

    async def _persist(self, snapshot_id: str, directory: Path,
                       records: list[SessionRecord]) -> PersistReport:
        start = self._clock.monotonic()
        await self._injected_delay("persist")
        shards: tuple[ShardEntry, ...] = ()
        if records:
            name = shard_file_name(snapshot_id, self.instance_id)
            entry = await self._runtime.run_blocking(
                write_shard, directory, name, self.instance_id, records)
            if self._snapshot is None or self._snapshot.snapshot_id != snapshot_id:
                # Aborted or lapsed while the thread wrote: the file must not outlive it.
                await self._runtime.run_blocking(remove_files, directory, [name])
                raise self._gone(snapshot_id)
            shards = (entry,)
        return PersistReport(
            instance_id=self.instance_id, shards=shards,
            persist_seconds=self._clock.monotonic() - start,
            bytes_written=sum(s.bytes for s in shards),
        )

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_PERIOD_S)
            now = self._clock.monotonic()
            if self._lease_deadline is not None and now > self._lease_deadline:
                op = self._snapshot.snapshot_id if self._snapshot else (
                    self._restore.restore_id if self._restore else None)
                log.warning("%s: lease of %s lapsed; resuming by itself",
                            self.instance_id, op)
                if op is not None:
                    self._lapsed.add(op)
                # Its shard stays: a coordinator may already hold its report and commit
                # it. Unreferenced shards are removed by the next commit in that folder.
                self._to_running()
            if self._turn_timeout_s is not None:
                stale = [k for k, t in self._turns.items()
                         if now - t.started > self._turn_timeout_s]
                for key in stale:
                    log.warning("%s: turn of %s exceeded %.1fs; aborting it",
                                self.instance_id, key, self._turn_timeout_s)
                    del self._turns[key]
                if stale:
                    await self._notify_turn_done()
            # Trim only while running (a pause is kept short), after a burst of session
            # calls or once a snapshot or restore has finished (their buffers are freed).
            if self._state is HolderState.RUNNING:
                if self._heap_state_seen is not HolderState.RUNNING:
                    self._heap.request()
                await self._heap.maybe_trim()
            self._heap_state_seen = self._state

