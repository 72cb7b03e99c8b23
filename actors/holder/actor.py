"""The session holder: one per node, holding the sessions of the rollouts run there.

``SessionHolder`` is a plain asyncio class with its clock, metrics and blocking-work
runner injected (``nemo_ckpt.transport.Runtime``), so its state machine runs without
Ray, in tests and in the simulation; ``actors.ray_transport.SessionHolderActor`` is the
same class as a Ray actor, pinned to its node. It keeps its construction, introspection,
probes and watchdog, and routes every other call to the part that serves its Protocol
(``nemo_ckpt.protocol.calls.serves`` makes one method per call, from the Protocols of
``nemo_ckpt.protocol.holder_api``: nothing is forwarded by hand). The parts share one
``actors.holder.parts.HolderParts`` (the session table, the turn gate, the sandboxes, the
operation table and ``set_state``, the one transition):

- ``actors.holder.sessions.Sessions``: sessions from workers (``HolderSessionCalls``),
  and the ledger's ``retire`` and ``forget`` (``HolderLedgerCalls``);
- ``actors.holder.turns.Turns``: their turns, begun, committed, aborted and resolved
  (``HolderTurnCalls``);
- ``actors.holder.operations.HolderOperations``: an operation admitted, its lease
  renewed and lapsed, and aborted: the one place one ends without committing
  (``HolderOperationCalls``); a restore's undo (``actors.holder.restore.RestoreUndo``)
  lives beside its steps;
- ``actors.holder.snapshot.SnapshotPhases``: the snapshot's room (``HolderSnapshotCalls``);
- ``actors.holder.restore.RestorePhases``: the restore's room (``HolderRestoreCalls``).

The order of the coordinator's calls is stated once, numbered, on
``nemo_ckpt.protocol.holder_api.HolderControl``.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from actors.holder.operations import HolderOperations
from actors.holder.parts import HolderParts, NoTrimmer, Trimmer
from actors.holder.restore import RestorePhases, RestoreUndo
from actors.holder.sandboxes import Sandboxes
from actors.holder.session_table import SessionTable
from actors.holder.sessions import Sessions
from actors.holder.snapshot import SnapshotPhases
from actors.holder.states import HolderOperationTable
from actors.holder.turn_gate import TurnGate
from actors.holder.turns import Turns
from actors.holder.watchdog import Check, Watchdog
from nemo_ckpt import tracing
from nemo_ckpt.phases import HolderInfo, HolderState
from nemo_ckpt.protocol.calls import serves
from nemo_ckpt.protocol.holder_api import (
    HolderLedgerCalls,
    HolderOperationCalls,
    HolderProbeCalls,
    HolderRestoreCalls,
    HolderSessionCalls,
    HolderSnapshotCalls,
    HolderTurnCalls,
)
from nemo_ckpt.storage.checkpoint_folder import PROBE_DIR, folder_at
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.transport import Runtime
from nemo_ckpt.trees.limits import SandboxLimits, TreeBudget

__all__ = ["SessionHolder", "Trimmer"]

log = logging.getLogger("nemo_ckpt.holder")


@serves({
    HolderProbeCalls: None,  # the holder's own
    HolderSessionCalls: ("_sessions", Sessions),
    HolderLedgerCalls: ("_ledger", Sessions),
    HolderTurnCalls: ("_turns", Turns),
    HolderOperationCalls: ("_operations", HolderOperations),
    HolderSnapshotCalls: ("_snapshots", SnapshotPhases),
    HolderRestoreCalls: ("_restores", RestorePhases),
})
class SessionHolder:
    """Holds the sessions of one instance, and takes part in snapshots and restores.

    Each operation's state is a value of ``actors.holder.states``, entered only through
    ``HolderParts.set_state``, which alone opens and closes the turn gate and, on
    entering ``Ended``, records the operation's one outcome (committed, aborted, lapsed)
    in a bounded history: a late or repeated call gets that outcome or a clear refusal,
    and a call for an operation its driver has moved past is refused without pausing
    anything.
    """

    if TYPE_CHECKING:
        # The routed methods are made as the class is (``serves``), so mypy does not
        # see them; ``serves`` checks each against its Protocol, and each part is
        # typed by the Protocol it serves (``__init__``).
        def __getattr__(self, name: str) -> Any: ...

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
        retired: dict[str, int] | None = None,
    ) -> None:
        # ``retired``: RL's retire marks so far (rollout id -> highest attempt retired),
        # from the coordinator that starts this holder; not an option of the job's.
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
            Check("leases", lambda now: self._lapse(now)),
            Check("turn timeouts", self._time_out_turns),
            Check("heap and cache", self._trim_when_running),
            Check("sessions gauge", self._publish_sessions),
        ])
        self._sessions_published: int | None = None  # what the gauge says now
        self._sandboxes_published: int | None = None
        self._parts = HolderParts(
            instance_id=instance_id, runtime=runtime,
            table=SessionTable(instance_id),
            gate=TurnGate(instance_id, max_retired_marks, retired=retired),
            sandboxes=Sandboxes(instance_id, sandbox_root, blob_root, namespace,
                                sandbox_limits, sandbox_restore_setid, tree_budget,
                                container_env),
            ops=HolderOperationTable(instance_id), heap=trimmer or NoTrimmer(),
            watchdog=self._watchdog)
        # Each part typed by the Protocol it serves: mypy checks that it does.
        sessions = Sessions(self._parts, max_state_bytes)
        self._sessions: HolderSessionCalls = sessions
        self._ledger: HolderLedgerCalls = sessions
        self._turns: HolderTurnCalls = Turns(self._parts, sessions)
        operations = HolderOperations(self._parts, RestoreUndo(self._parts))
        self._operations: HolderOperationCalls = operations
        self._lapse = operations.lapse
        self._snapshots: HolderSnapshotCalls = SnapshotPhases(self._parts, operations)
        self._restores: HolderRestoreCalls = RestorePhases(self._parts, operations)

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
        boxes = self._parts.sandboxes.count()  # nemo_ckpt_holder_sandboxes
        if boxes != self._sandboxes_published:
            self._parts.runtime.metrics.set_gauge("sandboxes", float(boxes),
                                                  {"instance": self.instance_id})
            self._sandboxes_published = boxes

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
            sandboxes_removed_at_start=self._parts.sandboxes.removed_at_start,
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
