"""The session holder: one per node, holding the sessions of the rollouts run there.

``SessionHolder`` is a plain asyncio class with its clock, metrics and blocking-work
runner injected (``nemo_ckpt.transport.Runtime``), so its state machine runs without
Ray, in tests and in the simulation; ``actors.ray_transport.SessionHolderActor`` is the
same class as a Ray actor, pinned to its node. It routes each call to its parts: the
session table (``actors.session_table``), the turn gate (``actors.turn_gate``), the
sandboxes (``actors.sandboxes``), the snapshot and restore lifecycles
(``actors.holder_states``) and the watchdog (``actors.watchdog``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import msgpack

from actors.holder_shards import ShardPrefetch, read_restore_shard, write_capture
from actors.holder_states import (
    Capture,
    Ended,
    HolderOperationTable,
    OperationState,
    RestoreLive,
    RestoreLoading,
    RestoreWork,
    SnapshotPaused,
    SnapshotReleased,
    SnapshotWork,
)
from actors.sandboxes import Recorded, Sandboxes
from actors.session_table import Held, SessionTable
from actors.turn_gate import TurnGate
from actors.watchdog import Check, Watchdog
from nemo_ckpt.checkpoint_folder import PROBE_DIR, folder_at
from nemo_ckpt.cleanup import remove_files
from nemo_ckpt.errors import (
    CaptureKeyCollisionError,
    HolderBusyError,
    HolderStateError,
    RestoreConflictError,
    RetiredAttemptError,
    RolloutFinishedError,
    SandboxError,
    SessionExistsError,
    SessionNotFoundError,
    StateTooLargeError,
    TurnAbortedError,
    TurnInProgressError,
)
from nemo_ckpt.folder import Folder
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.location import join_location
from nemo_ckpt.manifest import ShardEntry, sandbox_id_problem
from nemo_ckpt.operations import Outcome
from nemo_ckpt.phases import (
    CaptureReport,
    HolderInfo,
    HolderState,
    PauseReport,
    PersistReport,
    RestorePrepared,
    join_captured,
)
from nemo_ckpt.sandbox import SandboxLimits, TreeBudget
from nemo_ckpt.session_record import NO_TURNS, SessionRecord, check_staging_keys
from nemo_ckpt.transport import Runtime

__all__ = ["SessionHolder", "Trimmer"]

log = logging.getLogger("nemo_ckpt.holder")


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
    """Holds the sessions of one instance, and takes part in snapshots and restores.

    The order of the coordinator's calls is stated once, numbered, on
    ``nemo_ckpt.holder_api.HolderControl``.

    Each operation's state is a value of ``actors.holder_states``, entered only through
    ``_set_state``, which alone opens and closes the turn gate and, on entering
    ``Ended``, records the operation's one outcome (committed, aborted, lapsed) in a
    bounded history: a late or repeated call gets that outcome or a clear refusal, and
    a call for an operation its driver has moved past is refused without pausing anything.
    """

    def __init__(
        self,
        instance_id: str,
        node_id: str,
        max_state_bytes: int = 64 << 20,
        turn_timeout_s: float | None = None,
        max_retired_marks: int = 100_000,
        runtime: Runtime | None = None,
        trimmer: Trimmer | None = None,
        watch_period_s: float = 0.1,
        sandbox_root: str | None = None,
        blob_root: str | None = None,
        namespace: str = "nemo_ckpt",
        sandbox_limits: SandboxLimits | None = None,
        sandbox_restore_setid: bool = False,
        tree_budget: TreeBudget | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.node_id = node_id
        self._options: dict[str, Any] = {
            "max_state_bytes": max_state_bytes, "turn_timeout_s": turn_timeout_s,
            "max_retired_marks": max_retired_marks, "namespace": namespace,
            "sandbox_root": sandbox_root, "blob_root": blob_root,
            "sandbox_limits": sandbox_limits, "sandbox_restore_setid": sandbox_restore_setid,
            "tree_budget": tree_budget}
        self._runtime = runtime or Runtime()
        self._clock = self._runtime.clock
        self._metrics = self._runtime.metrics
        self._max_state_bytes = max_state_bytes
        self._turn_timeout_s = turn_timeout_s
        # The live sessions, each kept encoded (actors/session_table.py): a capture joins
        # their rows, a shard is written from them as they are.
        self._table = SessionTable(instance_id)
        self._gate = TurnGate(instance_id, max_retired_marks)
        # The sessions' sandbox directories, and the node cache of their files.
        self._sandboxes = Sandboxes(instance_id, sandbox_root, blob_root, namespace,
                                    sandbox_limits, sandbox_restore_setid, tree_budget)
        self._ops = HolderOperationTable(instance_id)
        # Shards read ahead of a restore the driver announced (``prefetch``).
        self._prefetch = ShardPrefetch(self._runtime)
        self._last_snapshot_id: str | None = None
        self._replay_restarts = 0  # SessionClient.replay_diverged, since the holder started
        self._injected_delays: dict[str, float] = {}
        # Gives the heap the session calls' freed buffers back to the OS (actors/heap.py):
        # they are most of a holder's growth beyond its sessions. Driven by the watchdog.
        self._heap = trimmer or _NoTrimmer()
        self._heap_state_seen = HolderState.RUNNING  # the state at the watchdog's last look
        self._watchdog = Watchdog(self._clock, watch_period_s, [
            Check("leases", self._lapse_leases),
            Check("turn timeouts", self._time_out_turns),
            Check("heap and cache", self._trim_when_running),
        ])

    # --- the one transition ------------------------------------------------------------

    def _set_state(self, op_id: str, new: OperationState) -> None:
        """Move operation ``op_id`` to ``new``: the only place that opens or closes the
        turn gate and that ends an operation (recording its outcome)."""
        old = self._ops.enter(op_id, new)
        if isinstance(new, Ended):
            if isinstance(old, SnapshotPaused | SnapshotReleased) \
                    and new.outcome is Outcome.COMMITTED:
                self._last_snapshot_id = op_id
            if isinstance(old, RestoreLoading):
                self._discard_restore(old.work)
            if isinstance(old, RestoreLive) and new.outcome is not Outcome.COMMITTED:
                self._undo(op_id, old)
            elif old is not None and new.outcome is not Outcome.COMMITTED:
                log.info("%s: %s %s", self.instance_id, op_id, new.outcome.value)
        self._gate.set_open(self._ops.current is None, self._clock.monotonic())
        if not self._gate.is_open:
            self._watchdog.ensure_running()  # the lease must be watched from now on

    def _discard_restore(self, work: RestoreWork) -> None:
        """A restore that will not go live: its staged directories go (in the background:
        nothing refers to them), their blobs may leave the cache."""
        self._sandboxes.forget_restore(work.sandboxes)
        if work.sandboxes or self._sandboxes.root is not None:
            self._background(self._sandboxes.discard_staging, work.id)

    def _undo(self, restore_id: str, live: RestoreLive) -> None:
        """Drop the sessions a committed restore made live (see ``RestoreLive``)."""
        for rollout_id in live.rollouts:
            self._table.drop(rollout_id)
            self._sandboxes.drop(rollout_id)
        if live.directories:
            self._sandboxes.doom(live.directories)
            self._background(self._sandboxes.remove_doomed)
        log.warning("%s: restore %s, live here but not used yet, was undone: its %d "
                    "sessions were dropped again", self.instance_id, restore_id,
                    len(live.rollouts))

    def _settle_restore(self) -> None:
        """A turn ran: the restore live here is in use, and no abort undoes it now."""
        live = self._ops.live_restore()
        if live is not None:
            self._set_state(live[0], Ended(Outcome.COMMITTED))

    def _background(self, fn: Any, *args: Any) -> None:
        task = asyncio.ensure_future(self._runtime.run_blocking(fn, *args))
        task.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _refusal(self, op_id: str) -> Exception:
        return self._ops.refusal(op_id, self._clock.monotonic())

    def _busy(self, what: str) -> HolderBusyError:
        return self._ops.busy(what, self._clock.monotonic())

    def _admit(self, op_id: str, what: str, restore: bool = False) -> None:
        """Let a new operation start, or refuse: one that already ended or that its
        driver has moved past (a late call), or while another one runs.

        A new restore supersedes the last one if it went live here but was never used
        (no turn since): its sessions go first. That is how the retry of a restore that
        failed elsewhere adopts this holder when the failed one's abort has not reached
        it yet (a slow link): all or nothing, whichever message comes first."""
        self._ops.refuse_ended(op_id, self._clock.monotonic())
        if self._ops.current is not None:
            raise self._busy(what)
        self._ops.history.note(op_id)
        live = self._ops.live_restore()
        if restore and live is not None:
            self._set_state(live[0], Ended(Outcome.ABORTED))

    def _current_snapshot(self, op_id: str) -> SnapshotWork:
        work = self._ops.snapshot(op_id)
        if work is None:
            raise self._refusal(op_id)
        return work

    def _current_restore(self, op_id: str) -> RestoreWork:
        state = self._ops.get(op_id)
        if not isinstance(state, RestoreLoading):
            raise self._refusal(op_id)
        return state.work

    # --- the watchdog's checks -----------------------------------------------------------

    async def _lapse_leases(self, now: float) -> None:
        """End every open operation whose lease ran out: nobody renews it any more. A
        shard already written stays (a coordinator may hold its report and commit it);
        one written later removes itself (``_persist``)."""
        for op_id in self._ops.lapsed(now):
            released = isinstance(self._ops.get(op_id), SnapshotReleased)
            log.warning("%s: lease of %s lapsed%s", self.instance_id, op_id,
                        " while its shard was written" if released
                        else "; resuming by itself")
            self._set_state(op_id, Ended(Outcome.LAPSED))

    async def _time_out_turns(self, now: float) -> None:
        if self._turn_timeout_s is not None and self._gate.time_out(now, self._turn_timeout_s):
            await self._gate.notify()

    async def _trim_when_running(self, now: float) -> None:
        """Trim only while running (a pause is kept short), after a burst of session
        calls or once a snapshot or restore has finished (their buffers are freed)."""
        del now
        value = self._state_value()
        if value is HolderState.RUNNING:
            if not self._ops.released():
                self._sandboxes.sweep()  # no capture may still need a cached blob
            if self._heap_state_seen is not HolderState.RUNNING:
                self._heap.request()
            await self._heap.maybe_trim()
        self._heap_state_seen = value

    def _state_value(self) -> HolderState:
        current = self._ops.current
        return HolderState.RUNNING if current is None else current.value

    # --- introspection -------------------------------------------------------------

    async def info(self) -> HolderInfo:
        """The holder's identity, state and load."""
        self._watchdog.ensure_running()
        op_id = self._ops.current_id()
        return HolderInfo(
            instance_id=self.instance_id, node_id=self.node_id, state=self._state_value(),
            operation_id=op_id,
            lease_expires_in_s=None if op_id is None else self._ops.lease_left(
                self._clock.monotonic()),
            sessions=len(self._table), turns_in_flight=len(self._gate),
            last_snapshot_id=self._last_snapshot_id, options=dict(self._options),
        )

    @property
    def current(self) -> tuple[HolderState, str | None]:
        """The state, and the operation it is for (None when running)."""
        return self._state_value(), self._ops.current_id()

    def bounds(self) -> dict[str, int]:
        """The sizes of what a holder remembers beyond its sessions (all bounded)."""
        live = self._ops.live_restore()
        return {"history": len(self._ops.history), "drivers": self._ops.history.drivers,
                "aborted_tokens": self._gate.aborted_tokens,
                "retire_marks": self._gate.retire_marks,
                "released": len(self._ops.released()),
                "undo": 0 if live is None else len(live[1].rollouts)}

    def turns_in_flight(self) -> list[tuple[str, str]]:
        """``(capture key, token)`` of every turn in flight (for checks and status)."""
        return self._gate.in_flight()

    async def sessions(self) -> list[SessionRecord]:
        """Every live session, sorted by capture key."""
        return [self._record(h) for h in self._table.sorted()]

    async def probe_storage(self, root: str) -> str:
        """Write a probe file under ``root`` (a folder or a bucket's prefix) and return
        where (for check_startup)."""
        def write() -> str:
            folder = folder_at(join_location(root, PROBE_DIR), probe=True)
            folder.prepare()
            name = f"{self.instance_id}-{uuid.uuid4().hex}"
            folder.write_bytes(name, f"{self.instance_id} {self.node_id}\n".encode())
            return folder.describe(name)

        return await self._runtime.run_blocking(write)

    async def probe_sandbox(self) -> None:
        """Check that this node can hold sandboxes' files under ``sandbox_root`` (for
        check_startup); raises ``SandboxError`` saying why not."""
        await self._runtime.run_blocking(self._sandboxes.probe)

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
        self, episode: EnvironmentEpisode, state: bytes = b"",
        directory: str | None = None,
    ) -> SessionRecord:
        """Open a session for ``episode`` with its initial state, and the sandbox
        ``directory`` it owns, if any (inside ``sandbox_root``; its tree is recorded
        now, as the session's start). Waits while paused."""
        await self.open_sessions([(episode, state, directory)])
        return self._record(self._held(episode))

    async def open_sessions(
        self, sessions: list[tuple[EnvironmentEpisode, bytes] |
                             tuple[EnvironmentEpisode, bytes, str | None]]
    ) -> int:
        """Open many sessions in one call (a worker starting a batch of rollouts, or a
        group of samples per prompt): each ``(episode, state)`` or ``(episode, state,
        directory)`` as ``open_session`` would, all or none. Returns how many were
        opened. Waits while paused.

        Repeated after its answer was lost (every session open as this call opens it,
        no turn begun since), it changes nothing and returns the same count at once."""
        opening: list[tuple[EnvironmentEpisode, bytes, Path | None]] = []
        for item in sessions:
            episode, state = item[0], item[1]
            where = item[2] if len(item) > 2 else None
            self._check_episode(episode)
            self._check_size("initial state", episode, state)
            if where is not None:  # its id names the directories its restores make
                problem = sandbox_id_problem(episode.rollout_id, episode.attempt)
                if problem is not None:
                    raise SandboxError(f"{self.instance_id}: cannot open a session with "
                                       f"directory {where}: {problem}; nothing was opened")
            opening.append((episode, state, None if where is None else
                            self._sandboxes.check_directory(where, episode.capture_key)))
        if opening and all(self._opened_as(*each) for each in opening):
            return len(opening)
        # Recorded before the gate: once it opens, the sessions go live with no await.
        recorded = await self._sandboxes.record_all(
            self._runtime.run_blocking,
            [(ep.capture_key, d) for ep, _, d in opening if d is not None])
        try:
            await self._wait_for_gate()
            rollouts: set[str] = set()
            for episode, _, _ in opening:
                if episode.rollout_id in rollouts:
                    raise SessionExistsError(
                        f"{self.instance_id}: rollout {episode.rollout_id!r} is listed twice "
                        f"in this call; nothing was opened")
                self._check_openable(episode)
                rollouts.add(episode.rollout_id)
        except BaseException:
            for rec in recorded.values():
                self._sandboxes.forget_unused(rec)
            raise
        for episode, state, directory in opening:
            self._table.put(Held.fresh(episode, state))
            if directory is not None:
                self._sandboxes.install(episode.rollout_id, directory,
                                        recorded[episode.capture_key])
        self._heap.note(sum(len(state) for _, state, _ in opening))
        return len(opening)

    async def replay_diverged(self, episode: EnvironmentEpisode, detail: str) -> int:
        """A continued rollout starts over because its replay diverged: warn, naming it,
        and count it for the next snapshot's metrics. Returns the count so far."""
        self._check_episode(episode)
        self._held(episode)  # only a live session's rollout restarts
        self._replay_restarts += 1
        log.warning("%s: rollout %s starts over: replaying its recorded steps diverged (%s)",
                    self.instance_id, episode.capture_key, detail[:500])
        return self._replay_restarts

    def _record(self, held: Held) -> SessionRecord:
        record = held.record(self.instance_id)
        box = self._sandboxes.get(held.rollout_id)
        if box is None:
            return record
        return dataclasses.replace(record, directory=str(box.directory))

    def _opened_as(self, episode: EnvironmentEpisode, state: bytes,
                   directory: Path | None) -> bool:
        """Whether ``episode``'s session is live exactly as an open with ``state`` and
        ``directory`` makes it, untouched since (no turn begun, not finished)."""
        held = self._table.get(episode)
        if held is None or held.finished or held.turns != NO_TURNS \
                or held.last_turn is not None or held.capture_key in self._gate \
                or held.state != bytes(state) or held.row != Held.fresh(episode, b"").row:
            return False  # not as opened (a restored one has earlier capture keys)
        box = self._sandboxes.get(episode.rollout_id)
        return (None if box is None else box.directory) == directory

    def _check_openable(self, episode: EnvironmentEpisode) -> None:
        self._refuse_retired(episode)
        key = episode.capture_key
        live = self._table.of_rollout(episode.rollout_id)
        if live is not None:
            if live.attempt == episode.attempt:
                raise SessionExistsError(
                    f"{self.instance_id}: a session for {key} is already open")
            raise SessionExistsError(
                f"{self.instance_id}: rollout {episode.rollout_id!r} already has a live "
                f"session ({live.capture_key}); close or retire it before opening {key}")
        other = self._table.collision(episode)
        if other is not None:
            raise CaptureKeyCollisionError(
                f"{self.instance_id}: rollout {episode.rollout_id!r} attempt "
                f"{episode.attempt} has capture key {key!r}, which live session "
                f"{other.rollout_id!r} attempt {other.attempt} already uses; rename the "
                f"rollout (ids ending in '-a<digits>' collide with later attempts)")

    async def get_session(self, episode: EnvironmentEpisode | str) -> SessionRecord:
        """The live session of ``episode`` (or with that capture key)."""
        return self._record(self._held(episode))

    async def begin_turn(self, episode: EnvironmentEpisode, token: str) -> SessionRecord:
        """Start a turn whose token the caller made: wait while paused, then return the
        session. A token its caller already aborted (it went away while this call
        travelled or waited at the gate) is refused, so no turn stays open for ever."""
        self._check_episode(episode)
        if not isinstance(token, str) or not token:
            raise TypeError("a turn token must be a non-empty string made by the caller")
        self._refuse_aborted(episode, token)
        await self._wait_for_gate()
        self._refuse_aborted(episode, token)
        held = self._held(episode)
        if held.finished:
            raise RolloutFinishedError(
                f"{self.instance_id}: {held.capture_key} was handed in as finished; it "
                f"runs no more turns (RL reads its result and acknowledges it)")
        record = self._record(held)
        self._gate.begin(episode.capture_key, token, self._clock.monotonic())
        self._settle_restore()
        return record

    async def commit_turn(
        self,
        episode: EnvironmentEpisode,
        token: str,
        record: bytes,
        state: bytes,
        staging_keys: Iterable[str] = (),
    ) -> SessionRecord:
        """Commit a turn: append its record, replace the state, add its staging keys,
        and record the session's directory as the turn left it (a thread re-reads the
        files that changed; the turn stays in flight until that is done, so a pause
        waits for it). Invalid arguments, or a directory that cannot be recorded, abort
        the turn and change nothing."""
        self._check_episode(episode)
        box = self._sandboxes.get(episode.rollout_id)
        recorded: Recorded | None = None
        if box is not None and self._turn_is(episode, token):
            try:
                self._check_size("turn record", episode, record)
                self._check_size("state", episode, state)
                recorded = (await self._sandboxes.record_all(
                    self._runtime.run_blocking, [(episode.capture_key, box.directory)],
                    box.recorded))[episode.capture_key]
            except BaseException:
                if self._turn_is(episode, token):
                    self._take_turn(episode, token)
                    await self._gate.notify()
                raise
        try:
            self._take_turn(episode, token)
        except BaseException:
            if recorded is not None:
                self._sandboxes.forget_unused(recorded)
            raise
        try:
            old = self._record(self._held(episode))
            self._check_size("turn record", episode, record)
            self._check_size("state", episode, state)
            keys = check_staging_keys(staging_keys, episode.capture_key)
            new = SessionRecord(
                instance_id=old.instance_id,
                episode=old.episode,
                turns=(*old.turns, bytes(record)),
                state=bytes(state),
                staging_keys=old.staging_keys | keys,
                earlier_capture_keys=old.earlier_capture_keys,
                directory=old.directory,
            )
            self._table.put(Held.of(new, last_turn=token))
            if recorded is not None and box is not None:
                self._sandboxes.install(episode.rollout_id, box.directory, recorded)
                recorded = None
            self._heap.note(len(record) + len(state))
            return new
        finally:
            if recorded is not None:
                self._sandboxes.forget_unused(recorded)
            await self._gate.notify()

    def _turn_is(self, episode: EnvironmentEpisode, token: str) -> bool:
        return self._gate.holds(episode.capture_key, token)

    async def abort_turn(self, episode: EnvironmentEpisode, token: str) -> None:
        """Abort a turn: nothing it did is recorded. A token not in flight (its begin
        still travelling, or already finished) is remembered and refused later."""
        self._check_episode(episode)
        if self._gate.abort(episode.capture_key, token):
            await self._gate.notify()

    async def resolve_turn(self, episode: EnvironmentEpisode, token: str
                           ) -> SessionRecord | None:
        """The outcome of the turn of ``token``, for a caller whose ``commit_turn`` got no
        answer: the session as that commit left it if the turn committed, else None,
        and then the turn can no longer commit (aborted here now if it is in flight,
        its token refused if its begin is still on its way). Read and decided with no
        await between, so no commit lands between the look and the abort.

        A session remembers the token of its last committed turn, and nothing older,
        until it leaves the holder: enough, as a session runs one turn at a time and
        ``SessionClient`` asks before it begins the session's next turn. Raises as any
        session call does when the session is not live here (retired, closed, or lost
        with a holder that died)."""
        self._check_episode(episode)
        if not isinstance(token, str) or not token:
            raise TypeError("a turn token must be a non-empty string made by the caller")
        held = self._table.get(episode)
        if held is not None and held.last_turn == token:
            return self._record(held)
        if self._gate.abort(episode.capture_key, token):
            await self._gate.notify()
        self._held(episode)  # the session is gone: say so rather than "not recorded"
        return None

    async def close_session(self, episode: EnvironmentEpisode | str) -> SessionRecord:
        """Close a finished session (of ``episode``, or with that capture key) and return
        its final record. Waits while paused."""
        await self._wait_for_gate()
        held = self._held(episode)
        if held.capture_key in self._gate:
            raise TurnInProgressError(
                f"{self.instance_id}: session {held.capture_key} has a turn in flight; "
                f"finish the turn before closing the session")
        record = self._record(held)
        self._table.drop(held.rollout_id)
        self._sandboxes.drop(held.rollout_id)
        return record

    async def finish_session(self, episode: EnvironmentEpisode, result: bytes
                             ) -> SessionRecord:
        """Hand in a finished rollout's ``result`` (``nemo_ckpt.receipts``): the session
        stays, finished, until RL acknowledges it (``retire``); it runs no more turns.
        Waits while paused, like a turn: a snapshot captures the session either as it
        was before, or finished. Repeating it with the same result changes nothing."""
        self._check_episode(episode)
        self._check_size("result", episode, result)
        await self._wait_for_gate()
        held = self._held(episode)
        if held.finished:
            if held.state != bytes(result):
                raise RolloutFinishedError(
                    f"{self.instance_id}: {held.capture_key} was already handed in as "
                    f"finished with another result; nothing changed")
            return self._record(held)
        if held.capture_key in self._gate:
            raise TurnInProgressError(
                f"{self.instance_id}: session {held.capture_key} has a turn in flight; "
                f"finish the turn before handing in the rollout")
        finished = held.finish(result)
        self._table.put(finished)
        self._sandboxes.drop(held.rollout_id)  # the worker owns the directory from now on
        return self._record(finished)

    # --- ledger operations (from RL, through the coordinator) ------------------------

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Refuse every attempt up to each of these of its rollout, and drop their live
        sessions (RL consumed the result). Returns the capture keys dropped."""
        self._require_running("retire")
        dropped = []
        for ep in episodes:
            self._check_episode(ep)
            mark = self._gate.retire(ep.rollout_id, ep.attempt)
            held = self._table.of_rollout(ep.rollout_id)
            if held is not None and held.attempt <= mark:
                self._gate.drop(held.capture_key)  # it can no longer commit
                self._table.drop(held.rollout_id)
                self._sandboxes.drop(held.rollout_id)
                dropped.append(held.capture_key)
        self._gate.bound_marks()
        await self._gate.notify()
        return dropped

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Drop these attempts' sessions, and the retire mark of their rollout when it
        reaches no further than them. Returns the capture keys dropped."""
        self._require_running("forget")
        dropped = []
        for ep in episodes:
            self._check_episode(ep)
            self._gate.forget(ep.rollout_id, ep.attempt)
            if self._table.get(ep) is not None:
                self._gate.drop(ep.capture_key)
                self._table.drop(ep.rollout_id)
                self._sandboxes.drop(ep.rollout_id)
                dropped.append(ep.capture_key)
        await self._gate.notify()
        return dropped

    # --- snapshot phases (from the coordinator) ---------------------------------------

    async def pause(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                    directory: str | None = None) -> PauseReport:
        """Close the turn gate, drain turns in flight up to the deadline, take a lease.
        Repeating it returns the first report."""
        state = self._ops.get(snapshot_id)
        if isinstance(state, SnapshotPaused):
            op = state.work
        else:
            self._admit(snapshot_id, f"pause for snapshot {snapshot_id}")
            op = SnapshotWork(snapshot_id, folder_at(directory or "."))
            self._set_state(snapshot_id,
                            SnapshotPaused(op, self._clock.monotonic() + lease_s))
        if op.pause is not None:
            return op.pause
        start = self._clock.monotonic()
        await self._injected_delay("pause")
        await self._gate.drain(drain_timeout_s)
        op = self._current_snapshot(snapshot_id)  # aborted or lapsed while draining?
        if op.pause is None:
            op.pause = PauseReport(self.instance_id, self._clock.monotonic() - start,
                                   len(self._gate))
            tags = {"instance": self.instance_id}
            self._metrics.observe("drain", op.pause.drain_seconds, tags)
            self._metrics.set_gauge("sessions", float(len(self._table)), tags)
        return op.pause

    async def begin(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                    directory: str) -> tuple[PauseReport, CaptureReport]:
        """``pause`` and ``capture`` in one call, the pause's hot path: one round trip.
        Idempotent like each of them.

        The write does not start here: a writer thread started before the reply leaves
        holds the GIL while the reply is serialized and delays it (~15 ms at 2,500
        sessions). ``start_persist`` (sent once every capture is in) or
        ``finish_persist`` starts it, into ``directory``."""
        pause = await self.pause(snapshot_id, drain_timeout_s, lease_s, directory)
        capture = await self.capture(snapshot_id)
        return pause, capture

    async def renew_lease(self, operation_id: str, lease_s: float) -> float:
        """Extend the lease of the snapshot or restore in progress (paused, restoring or
        released); returns seconds left. Refused, without changing anything, for any
        other operation."""
        state = self._ops.get(operation_id)
        if not isinstance(state, SnapshotPaused | SnapshotReleased | RestoreLoading):
            raise self._refusal(operation_id)
        state.lease_deadline = self._clock.monotonic() + lease_s
        return lease_s

    async def release(self, snapshot_id: str) -> None:
        """The driver's block exited: open the turn gate now, while the shard is still
        being written; the snapshot stays open here (under its lease) until its commit
        or abort. Repeating it, or for a snapshot not paused here, changes nothing."""
        state = self._ops.get(snapshot_id)
        if isinstance(state, SnapshotPaused):
            self._set_state(snapshot_id, SnapshotReleased(state.work, state.lease_deadline))

    async def capture(self, snapshot_id: str) -> CaptureReport:
        """Copy the idle sessions in memory; sessions mid-turn are reported restarting."""
        op = self._current_snapshot(snapshot_id)
        if op.capture is not None:
            return op.capture.report
        await self._injected_delay("capture")
        op = self._current_snapshot(snapshot_id)
        if op.capture is not None:
            return op.capture.report
        start = self._clock.monotonic()
        # Held sessions are immutable (a turn replaces its session's): a list of them is
        # a consistent, cheap capture, and their rows are the report.
        held = list(self._table)
        mid_turn = [h for h in held if h.capture_key in self._gate] if len(self._gate) else []
        if mid_turn:
            busy = set(map(id, mid_turn))
            held = [h for h in held if id(h) not in busy]
        sandboxes = self._sandboxes.capture(held) if len(self._sandboxes) else None
        report = CaptureReport(
            instance_id=self.instance_id,
            captured_msgpack=join_captured([h.row for h in held]),
            captured_count=len(held),
            restarting=tuple((h.rollout_id, h.attempt) for h in mid_turn),
            capture_seconds=self._clock.monotonic() - start,
            state_bytes=self._table.held_bytes - sum(h.size for h in mid_turn),
            finished_count=self._table.finished,  # a finished session is never mid-turn
            replay_restarts=self._replay_restarts,
        )
        op.capture = Capture(held, report, sandboxes)
        return report

    async def start_persist(self, snapshot_id: str, directory: str | None = None) -> None:
        """Start writing the captured sessions' shard in the background, into
        ``directory`` or the one ``begin`` named. Repeating it is a no-op."""
        op = self._current_snapshot(snapshot_id)
        if op.capture is None:
            raise HolderStateError(
                f"{self.instance_id}: persist for snapshot {snapshot_id} before capture")
        if directory is not None:
            op.directory = folder_at(directory)
        if op.persist is None:
            op.persist = asyncio.ensure_future(self._persist(op, op.directory, op.capture))
            # Its error reaches finish_persist; one of a snapshot that ended meanwhile
            # (aborted, lapsed) has no reader, and is not an error to report.
            op.persist.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def finish_persist(self, snapshot_id: str) -> PersistReport:
        """Wait for the shard to be durable, starting the write if ``start_persist`` has
        not (its message may come second). Refused once the snapshot ended here (its
        lease lapsed, or it was aborted)."""
        op = self._current_snapshot(snapshot_id)
        if op.persist is None:
            await self.start_persist(snapshot_id)
        assert op.persist is not None
        await self._injected_delay("finish_persist")
        report = await asyncio.shield(op.persist)
        self._current_snapshot(snapshot_id)  # it may have ended while writing
        return report

    async def resume(self, snapshot_id: str) -> None:
        """The snapshot committed: open the turn gate. Repeating it, or after the
        snapshot ended here otherwise (its lease lapsed), is a no-op."""
        if self._ops.snapshot(snapshot_id) is not None:
            self._set_state(snapshot_id, Ended(Outcome.COMMITTED))
            self._heap.request()

    async def abort(self, operation_id: str, keep_committed: bool = False) -> None:
        """End ``operation_id`` without a trace here, whatever it is and wherever it got:

        - the current snapshot or restore: the gate opens; a shard being written removes
          itself once written; a pending restore is dropped;
        - a restore committed here but aborted elsewhere (and not in use yet): the
          sessions it made live go again, so a restore is all or nothing; unless
          ``keep_committed``: the abort comes from a coordinator that never reached the
          restore's commit (one taken for dead that runs again, whose successor
          committed it), and must not undo what its successor committed;
        - one never seen (this abort overtook its first call): remembered, so that
          its late first call is refused instead of pausing the holder.
        """
        if keep_committed and isinstance(self._ops.get(operation_id), RestoreLive):
            log.warning("%s: an abort of %s from a coordinator that never committed it "
                        "leaves it live: it was committed here", self.instance_id,
                        operation_id)
            return
        self._set_state(operation_id, Ended(Outcome.ABORTED))

    # --- restore phases (from the coordinator) ----------------------------------------

    async def prefetch(self, where: str, shards: list[ShardEntry]) -> int:
        """Start reading and verifying ``shards`` of snapshot folder ``where`` for a restore
        to come, replacing any earlier prefetch; returns how many reads started. Nothing
        is installed: a restore of exactly these shard entries takes the reads, and a
        restore of anything else drops them."""
        if any(entry.instance_id != self.instance_id for entry in shards):
            raise HolderStateError(f"{self.instance_id}: asked to prefetch shards of "
                                   f"another instance")
        return self._prefetch.start(folder_at(where), where, shards)

    async def prepare_restore(
        self, restore_id: str, where: str, shards: list[ShardEntry], lease_s: float,
        blob_store: str | None = None,
    ) -> RestorePrepared:
        """Read and verify this instance's shards, and materialize their sessions'
        directories (from ``blob_store``) in a staging folder; nothing goes live until
        commit. Repeating it waits for and returns the first call's result."""
        state = self._ops.get(restore_id)
        if isinstance(state, RestoreLoading):
            return await asyncio.shield(state.work.prepared)
        self._admit(restore_id, f"restore {restore_id}", restore=True)
        op = RestoreWork(restore_id)
        self._set_state(restore_id, RestoreLoading(op, self._clock.monotonic() + lease_s))
        try:
            await self._injected_delay("prepare_restore")
            directory = folder_at(where)
            pending: list[Held] = []
            finished: list[list[object]] = []
            shard_sessions = []
            keys: set[str] = set()
            started = self._clock.monotonic()
            ahead = [self._prefetch.take(where, entry) for entry in shards]
            self._prefetch.discard()  # read ahead for another snapshot: never used
            for entry, read in zip(shards, ahead, strict=True):
                shard = await read_restore_shard(
                    self._runtime, self._sandboxes, self.instance_id, restore_id,
                    directory, entry, blob_store,
                    lambda: self._current_restore(restore_id), read)
                op.sandboxes += shard.sandboxes
                self._current_restore(restore_id)  # ended while materializing?
                pending += shard.held
                finished += shard.finished
                keys |= shard.staging_keys
                shard_sessions.append((entry.file, shard.sessions_msgpack))
            loaded = self._clock.monotonic()
            conflicts = sorted(h.rollout_id for h in pending
                               if self._table.of_rollout(h.rollout_id) is not None)
            if conflicts:
                raise RestoreConflictError(
                    f"{self.instance_id}: cannot restore rollouts {conflicts[:10]}"
                    f"{' ...' if len(conflicts) > 10 else ''}: sessions of them are live "
                    f"here; retire or close them first, or restore into a fresh job")
            op = self._current_restore(restore_id)
            op.pending = pending
            prepared = RestorePrepared(
                instance_id=self.instance_id,
                staging_keys=frozenset(keys),
                bytes_read=sum(entry.bytes for entry in shards),
                read_seconds=loaded - started,
                shard_sessions=tuple(shard_sessions),
                live_rollouts=msgpack.packb(self._table.rollouts(), use_bin_type=True),
                finished=msgpack.packb(finished, use_bin_type=True),
            )
            op.prepared.set_result(prepared)
            return prepared
        except BaseException as exc:
            if not op.prepared.done():
                op.prepared.set_exception(exc)
                op.prepared.exception()  # retrieved here; a repeat call re-raises it
            if self._restore_open(op):
                self._set_state(restore_id, Ended(Outcome.ABORTED))
            raise

    async def commit_restore(self, restore_id: str) -> int:
        """Make the restored sessions live and resume. Returns how many went live."""
        state = self._ops.get(restore_id)
        if not isinstance(state, RestoreLoading):
            if self._ops.outcome(restore_id) is Outcome.COMMITTED:
                return 0
            raise self._refusal(restore_id)
        op = state.work
        if not op.prepared.done() or op.prepared.exception() is not None:
            raise HolderStateError(
                f"{self.instance_id}: commit of restore {restore_id} before it was prepared")
        await self._injected_delay("commit_restore")
        op = self._current_restore(restore_id)
        for held in op.pending:
            if self._table.of_rollout(held.rollout_id) is not None:
                raise RestoreConflictError(
                    f"{self.instance_id}: rollout {held.rollout_id!r} went live during the "
                    f"restore")
        if op.sandboxes:
            await self._runtime.run_blocking(self._sandboxes.commit_restore, op.sandboxes)
            if not self._restore_open(op):  # aborted or lapsed while they moved
                self._sandboxes.doom(b.target for b in op.sandboxes)
                self._background(self._sandboxes.remove_doomed)
                raise self._refusal(restore_id)
        for held in op.pending:
            self._table.put(held)
        for box in op.sandboxes:
            self._sandboxes.install(box.rollout_id, box.target, box.recorded)
        self._set_state(restore_id, RestoreLive(tuple(h.rollout_id for h in op.pending),
                                                tuple(b.target for b in op.sandboxes)))
        self._heap.request()
        return len(op.pending)

    # --- internals ------------------------------------------------------------------

    def _held(self, episode: EnvironmentEpisode | str) -> Held:
        """The live session of ``episode`` (or with that capture key), or a refusal."""
        if isinstance(episode, str):
            held = self._table.by_capture_key(episode)
            key = episode
        else:
            self._check_episode(episode)
            self._refuse_retired(episode)
            held = self._table.get(episode)
            key = episode.capture_key
        if held is None:
            raise SessionNotFoundError(
                f"{self.instance_id}: no live session {key!r}; open it first, or connect "
                f"to the instance that holds it")
        return held

    def _refuse_retired(self, episode: EnvironmentEpisode) -> None:
        mark = self._gate.retired_up_to(episode.rollout_id)
        if mark is not None and episode.attempt <= mark:
            raise RetiredAttemptError(
                f"{self.instance_id}: attempt {episode.capture_key} was retired by RL "
                f"(every attempt up to {mark} of {episode.rollout_id!r} is); open the next "
                f"attempt instead, or forget this one first")

    def _refuse_aborted(self, episode: EnvironmentEpisode, token: str) -> None:
        if self._gate.consume_aborted(token):
            raise TurnAbortedError(
                f"{self.instance_id}: the turn of {episode.capture_key} was aborted by its "
                f"caller before it began here; nothing was recorded")

    def _take_turn(self, episode: EnvironmentEpisode, token: str) -> None:
        if not self._gate.take(episode.capture_key, token):
            self._refuse_retired(episode)
            raise TurnInProgressError(
                f"{self.instance_id}: no turn in flight for {episode.capture_key} with "
                f"that token; it was aborted (turn timeout, retire or forget) or already "
                f"finished")

    def _restore_open(self, work: RestoreWork) -> bool:
        """Whether ``work``'s restore is still preparing (not aborted or lapsed)."""
        state = self._ops.get(work.id)
        return isinstance(state, RestoreLoading) and state.work is work

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
        self._watchdog.ensure_running()
        await self._gate.wait_open()

    def _require_running(self, what: str) -> None:
        if self._ops.current is not None:
            raise self._busy(what)

    async def _persist(self, op: SnapshotWork, directory: Folder,
                       capture: Capture) -> PersistReport:
        start = self._clock.monotonic()
        await self._injected_delay("persist")
        shards: tuple[ShardEntry, ...] = ()
        if capture.held:
            entry, names = await write_capture(self._runtime, self._sandboxes,
                                               self.instance_id, op.id, directory, capture)
            if self._ops.snapshot(op.id) is not op \
                    and self._ops.outcome(op.id) is not Outcome.COMMITTED:
                # Aborted or lapsed while the thread wrote: the files must not outlive it.
                await self._runtime.run_blocking(remove_files, directory, names)
                raise self._refusal(op.id)
            shards = (entry,)
        return PersistReport(
            instance_id=self.instance_id, shards=shards,
            persist_seconds=self._clock.monotonic() - start,
            bytes_written=sum(s.bytes + (s.trees.bytes + s.trees.new_blob_bytes
                                         if s.trees else 0) for s in shards),
        )

