"""What the session holder's parts share: its session table, turn gate, sandboxes and
operation table, its clock and blocking-work runner, its heap trimmer and watchdog, and
the one transition (``HolderParts.set_state``). ``actors.holder.actor`` makes one and
routes to the parts that use it (``actors.holder.operations``, ``actors.holder.sessions``,
``actors.holder.snapshot``, ``actors.holder.restore``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from actors.holder.sandboxes import Sandboxes
from actors.holder.session_table import Held, SessionTable
from actors.holder.states import (
    Ended,
    HolderOperationTable,
    OperationState,
    RestoreLoading,
    RestoreWork,
    SnapshotPaused,
    SnapshotReleased,
    SnapshotWork,
)
from actors.holder.turn_gate import TurnGate
from actors.holder.watchdog import Watchdog
from nemo_ckpt.errors import HolderBusyError, JobStoppedError
from nemo_ckpt.protocol.operations import Outcome
from nemo_ckpt.sandbox_backend import ContainerRef
from nemo_ckpt.session_record import SessionHead, SessionRecord
from nemo_ckpt.transport import Clock, Runtime

__all__ = ["HolderParts", "NoTrimmer", "Trimmer"]

log = logging.getLogger("nemo_ckpt.holder")

class Trimmer(Protocol):
    """Gives freed heap memory back to the OS (``actors.holder.heap.HeapTrimmer`` under Ray)."""

    def note(self, payload_bytes: int) -> None: ...

    def request(self) -> None: ...

    async def maybe_trim(self) -> bool: ...


class NoTrimmer:
    """A holder's trimmer outside Ray: trims nothing."""

    def note(self, payload_bytes: int) -> None:
        del payload_bytes

    def request(self) -> None:
        return None

    async def maybe_trim(self) -> bool:
        return False


@dataclass(eq=False)
class HolderParts:
    """The holder's state and parts, shared by its session, snapshot and restore parts.

    Each operation's state is a value of ``actors.holder.states``, entered only through
    ``set_state``, which alone opens and closes the turn gate and, on entering ``Ended``,
    records the operation's one outcome in a bounded history."""

    instance_id: str
    runtime: Runtime
    # The live sessions, each kept encoded (actors/holder/session_table.py): a capture joins
    # their rows, a shard is written from them as they are.
    table: SessionTable
    gate: TurnGate
    # The sessions' sandbox directories, and the node cache of their files.
    sandboxes: Sandboxes
    ops: HolderOperationTable
    # Gives the heap the session calls' freed buffers back to the OS (actors/holder/heap.py):
    # they are most of a holder's growth beyond its sessions. Driven by the watchdog.
    heap: Trimmer
    watchdog: Watchdog
    last_snapshot_id: str | None = None
    # The stop snapshot that parked this holder's sessions (``SnapshotPhases.park``);
    # None again once a restore commits here.
    parked_by: str | None = None
    replay_restarts: int = 0  # SessionClient.replay_diverged, since the holder started

    @property
    def clock(self) -> Clock:
        return self.runtime.clock

    # --- the one transition ------------------------------------------------------------

    def set_state(self, op_id: str, new: OperationState) -> OperationState | None:
        """Move operation ``op_id`` to ``new``: the only place that opens or closes the
        turn gate and that ends an operation (recording its outcome). Returns the state
        it left (None if it was not open); an end that is not a commit goes through
        ``actors.holder.operations.HolderOperations.end``, which undoes what it left."""
        old = self.ops.enter(op_id, new)
        if isinstance(new, Ended) and isinstance(old, SnapshotPaused | SnapshotReleased) \
                and new.outcome is Outcome.COMMITTED:
            self.last_snapshot_id = op_id
        self.gate.set_open(self.ops.current is None, self.clock.monotonic())
        if not self.gate.is_open:
            self.watchdog.ensure_running()  # the lease must be watched from now on
        return old

    def settle_restore(self) -> None:
        """A turn ran: the restore live here is in use, and no abort undoes it now."""
        live = self.ops.live_restore()
        if live is not None:
            self.set_state(live[0], Ended(Outcome.COMMITTED))

    def background(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` as blocking work nobody waits for (its error is dropped)."""
        task = asyncio.ensure_future(self.runtime.run_blocking(fn, *args))
        task.add_done_callback(lambda f: f.cancelled() or f.exception())

    # --- refusals -----------------------------------------------------------------------

    def refusal(self, op_id: str) -> Exception:
        return self.ops.refusal(op_id, self.clock.monotonic())

    def busy(self, what: str) -> HolderBusyError:
        return self.ops.busy(what, self.clock.monotonic())

    def refuse_if_parked(self) -> None:
        """Refuse a new session or turn once a stop snapshot parked this holder."""
        if self.parked_by is not None:
            raise JobStoppedError(
                f"{self.instance_id}: this job was stopped: snapshot {self.parked_by} "
                f"parked every session of this holder and freed their sandboxes once it "
                f"was durable, so no session or turn runs here until a restore from it "
                f"(RayEnvironmentCheckpoint.restored) brings them back")

    def require_running(self, what: str) -> None:
        if self.ops.current is not None:
            raise self.busy(what)

    def current_snapshot(self, op_id: str) -> SnapshotWork:
        """The work of snapshot ``op_id`` while it is open here, or a refusal."""
        work = self.ops.snapshot(op_id)
        if work is None:
            raise self.refusal(op_id)
        return work

    def current_restore(self, op_id: str) -> RestoreWork:
        """The work of restore ``op_id`` while it is preparing here, or a refusal."""
        state = self.ops.get(op_id)
        if not isinstance(state, RestoreLoading):
            raise self.refusal(op_id)
        return state.work

    def restore_open(self, work: RestoreWork) -> bool:
        """Whether ``work``'s restore is still preparing (not aborted or lapsed)."""
        state = self.ops.get(work.id)
        return isinstance(state, RestoreLoading) and state.work is work

    # --- shared by the session calls and the phases --------------------------------------

    async def after_stop_capture(self, capture_key: str) -> None:
        """Wait while an open stop snapshot holds ``capture_key``'s session as of its
        last committed turn (``SnapshotPhases.capture``): a commit of the turn in flight
        lands after its end, refused once it parked the session, accepted if it was
        aborted or lapsed. Bounded by the snapshot's lease."""
        while True:
            current = self.ops.current
            if not isinstance(current, SnapshotPaused) \
                    or capture_key not in current.work.held_mid_turn:
                return
            self.watchdog.ensure_running()
            await self.gate.wait_open()

    async def wait_for_gate(self) -> None:
        self.watchdog.ensure_running()
        await self.gate.wait_open()

    def record(self, held: Held) -> SessionRecord:
        """``held`` as its caller sees it, with its sandbox (a directory or a container)
        if it has one."""
        return dataclasses.replace(held.record(self.instance_id), **self._sandbox_of(held))

    def head(self, held: Held) -> SessionHead:
        """``held`` as a turn sees it (``SessionHead``: no turn records)."""
        return SessionHead(self.instance_id, held.episode(), held.turn_count, held.state_bytes(),
                           **self._sandbox_of(held))

    def _sandbox_of(self, held: Held) -> dict[str, Any]:
        """The fields of a session's sandbox as its caller sees them."""
        fields: dict[str, Any] = {}
        if held.rollout_id in self.sandboxes.restart_only:
            fields["restart_only"] = True
        location = self.sandboxes.location(held.rollout_id)
        if isinstance(location, ContainerRef):
            fields["container"] = location.name
        elif location is not None:
            fields["directory"] = str(location)
        return fields
