"""The session holder: one per node, holding the sessions of the rollouts run there.

``SessionHolder`` is a plain asyncio class with its clock, metrics and blocking-work
runner injected (``nemo_ckpt.transport.Runtime``), so its state machine runs without
Ray, in tests and in the simulation; ``actors.ray_transport.SessionHolderActor`` is the
same class as a Ray actor, pinned to its node. It keeps its construction, introspection,
probes and watchdog, and routes every other call to its parts, which share one
``actors.holder_parts.HolderParts`` (the session table, the turn gate, the sandboxes, the
operation table and ``set_state``, the one transition):

- ``actors.holder_sessions.Sessions``: sessions from workers, and the ledger's
  ``retire`` and ``forget``;
- ``actors.holder_turns.Turns``: their turns, begun, committed, aborted and resolved;
- ``actors.holder_operations.HolderOperations``: an operation admitted, its lease
  renewed and lapsed, and aborted: the one place one ends without committing; a
  restore's undo (``actors.holder_restores.RestoreUndo``) lives beside its phases;
- ``actors.holder_snapshots.SnapshotPhases``: a snapshot's phases;
- ``actors.holder_restores.RestorePhases``: a restore's phases.

The order of the coordinator's calls is stated once, numbered, on
``nemo_ckpt.protocol.holder_api.HolderControl``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from typing import Any

from actors.holder_operations import HolderOperations
from actors.holder_parts import HolderParts, NoTrimmer, Trimmer
from actors.holder_restores import RestorePhases, RestoreUndo
from actors.holder_sandboxes import Sandboxes
from actors.holder_sessions import Sessions
from actors.holder_snapshots import SnapshotPhases
from actors.holder_states import HolderOperationTable
from actors.holder_turns import Turns
from actors.session_table import SessionTable
from actors.turn_gate import TurnGate
from actors.watchdog import Check, Watchdog
from nemo_ckpt import tracing
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.phases import (
    CaptureReport,
    HolderInfo,
    HolderState,
    PauseReport,
    PersistReport,
    RestorePrepared,
    ShardRef,
)
from nemo_ckpt.protocol.holder_api import OpeningSessions
from nemo_ckpt.sandboxes.backend import ContainerRef
from nemo_ckpt.sandboxes.limits import SandboxLimits, TreeBudget
from nemo_ckpt.session_record import SessionHead, SessionRecord
from nemo_ckpt.storage.checkpoint_folder import PROBE_DIR, folder_at
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.transport import Runtime

__all__ = ["SessionHolder", "Trimmer"]

log = logging.getLogger("nemo_ckpt.holder")


class SessionHolder:
    """Holds the sessions of one instance, and takes part in snapshots and restores.

    Each operation's state is a value of ``actors.holder_states``, entered only through
    ``HolderParts.set_state``, which alone opens and closes the turn gate and, on
    entering ``Ended``, records the operation's one outcome (committed, aborted, lapsed)
    in a bounded history: a late or repeated call gets that outcome or a clear refusal,
    and a call for an operation its driver has moved past is refused without pausing
    anything.
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
        container_env: dict[str, str] | None = None,
        trace_file: str | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.node_id = node_id
        self._options: dict[str, Any] = {
            "max_state_bytes": max_state_bytes, "turn_timeout_s": turn_timeout_s,
            "max_retired_marks": max_retired_marks, "namespace": namespace,
            "sandbox_root": sandbox_root, "blob_root": blob_root,
            "sandbox_limits": sandbox_limits, "sandbox_restore_setid": sandbox_restore_setid,
            "tree_budget": tree_budget, "container_env": container_env,
            "trace_file": trace_file}
        self._trace_problem = tracing.write_spans_or_say_why(trace_file)
        if self._trace_problem is not None:
            log.warning("%s writes no spans: %s", instance_id, self._trace_problem)
        runtime = runtime or Runtime()
        self._clock = runtime.clock
        self._turn_timeout_s = turn_timeout_s
        self._heap_state_seen = HolderState.RUNNING  # the state at the watchdog's last look
        self._watchdog = Watchdog(self._clock, watch_period_s, [
            Check("leases", lambda now: self._operations.lapse(now)),
            Check("turn timeouts", self._time_out_turns),
            Check("heap and cache", self._trim_when_running),
            Check("sessions gauge", self._publish_sessions),
        ])
        self._sessions_published: int | None = None  # what the gauge says now
        self._parts = HolderParts(
            instance_id=instance_id, runtime=runtime,
            table=SessionTable(instance_id), gate=TurnGate(instance_id, max_retired_marks),
            sandboxes=Sandboxes(instance_id, sandbox_root, blob_root, namespace,
                                sandbox_limits, sandbox_restore_setid, tree_budget,
                                container_env),
            ops=HolderOperationTable(instance_id), heap=trimmer or NoTrimmer(),
            watchdog=self._watchdog)
        self._sessions = Sessions(self._parts, max_state_bytes)
        self._turns = Turns(self._parts, self._sessions)
        self._operations = HolderOperations(self._parts, RestoreUndo(self._parts))
        self._snapshots = SnapshotPhases(self._parts, self._operations)
        self._restores = RestorePhases(self._parts, self._operations)

    # --- the watchdog's checks -----------------------------------------------------------

    async def _time_out_turns(self, now: float) -> None:
        gate = self._parts.gate
        if self._turn_timeout_s is not None and gate.time_out(now, self._turn_timeout_s):
            await gate.notify()

    async def _trim_when_running(self, now: float) -> None:
        """Trim only while running (a pause is kept short), after a burst of session
        calls or once a snapshot or restore has finished (their buffers are freed)."""
        del now
        value = self._state_value()
        if value is HolderState.STOPPED:  # parked: nothing runs, trimmed as running
            value = HolderState.RUNNING
        if value is HolderState.RUNNING:
            if not self._parts.ops.released():
                self._parts.sandboxes.sweep()  # no capture may still need a cached blob
            if self._heap_state_seen is not HolderState.RUNNING:
                self._parts.heap.request()
            await self._parts.heap.maybe_trim()
        self._heap_state_seen = value

    async def _publish_sessions(self, now: float) -> None:
        """Set the sessions gauge (``nemo_ckpt_holder_sessions``) when the count has
        changed: exported from the holder's start and kept current, not only at a
        pause."""
        del now
        count = len(self._parts.table)
        if count != self._sessions_published:
            self._parts.runtime.metrics.set_gauge("sessions", float(count),
                                                  {"instance": self.instance_id})
            self._sessions_published = count

    def _state_value(self) -> HolderState:
        current = self._parts.ops.current
        if current is None:
            return HolderState.RUNNING if self._parts.parked_by is None \
                else HolderState.STOPPED
        return current.value

    # --- introspection -------------------------------------------------------------

    async def info(self) -> HolderInfo:
        """The holder's identity, state and load."""
        self._watchdog.ensure_running()
        ops = self._parts.ops
        op_id = ops.current_id()
        return HolderInfo(
            instance_id=self.instance_id, node_id=self.node_id, state=self._state_value(),
            operation_id=op_id,
            lease_expires_in_s=None if op_id is None else ops.lease_left(
                self._clock.monotonic()),
            sessions=len(self._parts.table), turns_in_flight=len(self._parts.gate),
            last_snapshot_id=self._parts.last_snapshot_id, options=dict(self._options),
            trace_problem=self._trace_problem,
        )

    @property
    def current(self) -> tuple[HolderState, str | None]:
        """The state, and the operation it is for (None when running)."""
        return self._state_value(), self._parts.ops.current_id()

    def bounds(self) -> dict[str, int]:
        """The sizes of what a holder remembers beyond its sessions (all bounded)."""
        ops, gate = self._parts.ops, self._parts.gate
        live = ops.live_restore()
        return {"history": len(ops.history), "drivers": ops.history.drivers,
                "aborted_tokens": gate.aborted_tokens,
                "retire_marks": gate.retire_marks,
                "released": len(ops.released()),
                "undo": 0 if live is None else len(live[1].rollouts)}

    def turns_in_flight(self) -> list[tuple[str, str]]:
        """``(capture key, token)`` of every turn in flight (for checks and status)."""
        return self._parts.gate.in_flight()

    async def sessions(self) -> list[SessionRecord]:
        """Every live session, sorted by capture key."""
        return [self._parts.record(h) for h in self._parts.table.sorted()]

    async def probe_storage(self, root: str) -> str:
        """Write a probe file under ``root`` (a folder or a bucket's prefix) and return
        where (for check_startup)."""
        def write() -> str:
            folder = folder_at(join_location(root, PROBE_DIR), probe=True)
            folder.prepare()
            name = f"{self.instance_id}-{uuid.uuid4().hex}"
            folder.write_bytes(name, f"{self.instance_id} {self.node_id}\n".encode())
            return folder.describe(name)

        return await self._parts.runtime.run_blocking(write)

    async def probe_sandbox(self) -> None:
        """Check that this node can hold sandboxes' files under ``sandbox_root`` (for
        check_startup); raises ``SandboxError`` saying why not."""
        await self._parts.runtime.run_blocking(self._parts.sandboxes.probe)

    async def probe_containers(self) -> tuple[list[str], list[str]]:
        """(problems, warnings) of this node's container runtime, when sessions may own
        containers (``CheckpointConfig.containers``; check_startup)."""
        return await self._parts.runtime.run_blocking(
            self._parts.sandboxes.check_containers)

    # --- session calls (from environment workers): ``Sessions``, ``Turns`` -----------

    async def open_session(self, episode: EnvironmentEpisode, state: bytes = b"",
                           directory: str | ContainerRef | None = None,
                           restart_only: bool = False) -> SessionRecord:
        """Open a session, with its sandbox if any (``Sessions.open_session``)."""
        return await self._sessions.open_session(episode, state, directory, restart_only)

    async def open_sessions(self, sessions: OpeningSessions) -> int:
        """Open many sessions, all or none (``Sessions.open_sessions``)."""
        return await self._sessions.open_sessions(sessions)

    async def replay_diverged(self, episode: EnvironmentEpisode, detail: str) -> int:
        """Count a rollout that starts over (``Sessions.replay_diverged``)."""
        return await self._sessions.replay_diverged(episode, detail)

    async def get_session(self, episode: EnvironmentEpisode | str) -> SessionRecord:
        """The live session of ``episode`` (or with that capture key)."""
        return await self._sessions.get_session(episode)

    async def read_turns(self, episode: EnvironmentEpisode | str, start: int = 0,
                         stop: int | None = None) -> list[bytes]:
        """Some of a live session's turn records (``Sessions.read_turns``)."""
        return await self._sessions.read_turns(episode, start, stop)

    async def begin_turn(self, episode: EnvironmentEpisode, token: str) -> SessionHead:
        """Start a turn whose token the caller made (``Turns.begin_turn``)."""
        return await self._turns.begin_turn(episode, token)

    async def commit_turn(self, episode: EnvironmentEpisode, token: str, record: bytes,
                          state: bytes, staging_keys: Iterable[str] = ()) -> SessionHead:
        """Commit a turn (``Turns.commit_turn``)."""
        return await self._turns.commit_turn(episode, token, record, state, staging_keys)

    async def abort_turn(self, episode: EnvironmentEpisode, token: str) -> None:
        """Abort a turn: nothing it did is recorded (``Turns.abort_turn``)."""
        await self._turns.abort_turn(episode, token)

    async def resolve_turn(self, episode: EnvironmentEpisode, token: str
                           ) -> SessionHead | None:
        """The outcome of a turn whose commit got no answer (``Turns.resolve_turn``)."""
        return await self._turns.resolve_turn(episode, token)

    async def close_session(self, episode: EnvironmentEpisode | str) -> SessionRecord:
        """Close a session and return its final record (``Sessions.close_session``)."""
        return await self._sessions.close_session(episode)

    async def finish_session(self, episode: EnvironmentEpisode, result: bytes
                             ) -> SessionRecord:
        """Hand in a finished rollout's result (``Sessions.finish_session``)."""
        return await self._sessions.finish_session(episode, result)

    # --- ledger operations (from RL, through the coordinator): ``Sessions`` -----------

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Retire these attempts; the capture keys dropped (``Sessions.retire``)."""
        return await self._sessions.retire(episodes)

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Forget these attempts; the capture keys dropped (``Sessions.forget``)."""
        return await self._sessions.forget(episodes)

    # --- snapshot phases (from the coordinator): ``SnapshotPhases`` ---------------------

    async def pause(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                    directory: str | None = None) -> PauseReport:
        """Close the gate, drain, take a lease (``SnapshotPhases.pause``)."""
        return await self._snapshots.pause(snapshot_id, drain_timeout_s, lease_s, directory)

    async def begin(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                    directory: str, trace: str = "", stop: bool = False
                    ) -> tuple[PauseReport, CaptureReport]:
        """``pause`` and ``capture`` in one call (``SnapshotPhases.begin``)."""
        return await self._snapshots.begin(snapshot_id, drain_timeout_s, lease_s, directory,
                                           trace, stop)

    async def renew_lease(self, operation_id: str, lease_s: float) -> float:
        """Extend the current operation's lease (``HolderOperations.renew_lease``)."""
        return await self._operations.renew_lease(operation_id, lease_s)

    async def release(self, snapshot_id: str) -> None:
        """Open the gate while the shard is written (``SnapshotPhases.release``)."""
        await self._snapshots.release(snapshot_id)

    async def capture(self, snapshot_id: str) -> CaptureReport:
        """Copy the idle sessions in memory (``SnapshotPhases.capture``)."""
        return await self._snapshots.capture(snapshot_id)

    async def start_persist(self, snapshot_id: str, directory: str | None = None) -> None:
        """Start writing the shard (``SnapshotPhases.start_persist``)."""
        await self._snapshots.start_persist(snapshot_id, directory)

    async def finish_persist(self, snapshot_id: str) -> PersistReport:
        """Wait for the shard to be durable (``SnapshotPhases.finish_persist``)."""
        return await self._snapshots.finish_persist(snapshot_id)

    async def resume(self, snapshot_id: str, stop: bool = False) -> None:
        """The snapshot committed: it ends here, and with ``stop`` the sessions are
        parked (``SnapshotPhases.resume``)."""
        await self._snapshots.resume(snapshot_id, stop)

    async def abort(self, operation_id: str, keep_committed: bool = False) -> None:
        """End any operation without a trace here (``HolderOperations.abort``)."""
        await self._operations.abort(operation_id, keep_committed)

    # --- restore phases (from the coordinator): ``RestorePhases`` -----------------------

    async def prefetch(self, where: str, shards: list[ShardRef]) -> int:
        """Start reading shards for a restore to come (``RestorePhases.prefetch``)."""
        return await self._restores.prefetch(where, shards)

    async def prepare_restore(
        self, restore_id: str, where: str, shards: list[ShardRef], lease_s: float,
        blob_store: str | None = None, trace: str = "",
    ) -> RestorePrepared:
        """Read and verify the shards, nothing live (``RestorePhases.prepare_restore``)."""
        return await self._restores.prepare_restore(restore_id, where, shards, lease_s,
                                                    blob_store, trace)

    async def commit_restore(self, restore_id: str) -> int:
        """Make the restored sessions live (``RestorePhases.commit_restore``)."""
        return await self._restores.commit_restore(restore_id)
