"""What the session holder's parts share: its session table, turn gate, sandboxes and
operation table, its clock and blocking-work runner, its heap trimmer and watchdog, and
the one transition (``HolderParts.set_state``) with the admission of a new operation.
``actors.session_holder`` makes one and routes to the parts that use it
(``actors.holder_sessions``, ``actors.holder_snapshots``, ``actors.holder_restores``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from actors.holder_states import (
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
from actors.sandboxes import Sandboxes
from actors.session_table import Held, SessionTable
from actors.turn_gate import TurnGate
from actors.watchdog import Watchdog
from nemo_ckpt.errors import HolderBusyError
from nemo_ckpt.operations import Outcome
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.transport import Clock, Runtime

__all__ = ["HolderParts", "NoTrimmer", "Trimmer"]

log = logging.getLogger("nemo_ckpt.holder")

class Trimmer(Protocol):
    """Gives freed heap memory back to the OS (``actors.heap.HeapTrimmer`` under Ray)."""

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

    Each operation's state is a value of ``actors.holder_states``, entered only through
    ``set_state``, which alone opens and closes the turn gate and, on entering ``Ended``,
    records the operation's one outcome in a bounded history."""

    instance_id: str
    runtime: Runtime
    # The live sessions, each kept encoded (actors/session_table.py): a capture joins
    # their rows, a shard is written from them as they are.
    table: SessionTable
    gate: TurnGate
    # The sessions' sandbox directories, and the node cache of their files.
    sandboxes: Sandboxes
    ops: HolderOperationTable
    # Gives the heap the session calls' freed buffers back to the OS (actors/heap.py):
    # they are most of a holder's growth beyond its sessions. Driven by the watchdog.
    heap: Trimmer
    watchdog: Watchdog
    last_snapshot_id: str | None = None
    replay_restarts: int = 0  # SessionClient.replay_diverged, since the holder started

    @property
    def clock(self) -> Clock:
        return self.runtime.clock

    # --- the one transition ------------------------------------------------------------

    def set_state(self, op_id: str, new: OperationState) -> None:
        """Move operation ``op_id`` to ``new``: the only place that opens or closes the
        turn gate and that ends an operation (recording its outcome)."""
        old = self.ops.enter(op_id, new)
        if isinstance(new, Ended):
            if isinstance(old, SnapshotPaused | SnapshotReleased) \
                    and new.outcome is Outcome.COMMITTED:
                self.last_snapshot_id = op_id
            if isinstance(old, RestoreLoading):
                self._discard_restore(old.work)
            if isinstance(old, RestoreLive) and new.outcome is not Outcome.COMMITTED:
                self._undo(op_id, old)
            elif old is not None and new.outcome is not Outcome.COMMITTED:
                log.info("%s: %s %s", self.instance_id, op_id, new.outcome.value)
        self.gate.set_open(self.ops.current is None, self.clock.monotonic())
        if not self.gate.is_open:
            self.watchdog.ensure_running()  # the lease must be watched from now on

    def _discard_restore(self, work: RestoreWork) -> None:
        """A restore that will not go live: its staged directories go (in the background:
        nothing refers to them), their blobs may leave the cache."""
        self.sandboxes.forget_restore(work.sandboxes)
        if work.sandboxes or self.sandboxes.root is not None:
            self.background(self.sandboxes.discard_staging, work.id)

    def _undo(self, restore_id: str, live: RestoreLive) -> None:
        """Drop the sessions a committed restore made live (see ``RestoreLive``)."""
        for rollout_id in live.rollouts:
            self.table.drop(rollout_id)
            self.sandboxes.drop(rollout_id)
        if live.directories:
            self.sandboxes.doom(live.directories)
            self.background(self.sandboxes.remove_doomed)
        log.warning("%s: restore %s, live here but not used yet, was undone: its %d "
                    "sessions were dropped again", self.instance_id, restore_id,
                    len(live.rollouts))

    def settle_restore(self) -> None:
        """A turn ran: the restore live here is in use, and no abort undoes it now."""
        live = self.ops.live_restore()
        if live is not None:
            self.set_state(live[0], Ended(Outcome.COMMITTED))

    def background(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` as blocking work nobody waits for (its error is dropped)."""
        task = asyncio.ensure_future(self.runtime.run_blocking(fn, *args))
        task.add_done_callback(lambda f: f.cancelled() or f.exception())

    # --- admission -----------------------------------------------------------------------

    def refusal(self, op_id: str) -> Exception:
        return self.ops.refusal(op_id, self.clock.monotonic())

    def busy(self, what: str) -> HolderBusyError:
        return self.ops.busy(what, self.clock.monotonic())

    def admit(self, op_id: str, what: str, restore: bool = False) -> None:
        """Let a new operation start, or refuse: one that already ended or that its
        driver has moved past (a late call), or while another one runs.

        A new restore supersedes the last one if it went live here but was never used
        (no turn since): its sessions go first. That is how the retry of a restore that
        failed elsewhere adopts this holder when the failed one's abort has not reached
        it yet (a slow link): all or nothing, whichever message comes first."""
        self.ops.refuse_ended(op_id, self.clock.monotonic())
        if self.ops.current is not None:
            raise self.busy(what)
        self.ops.history.note(op_id)
        live = self.ops.live_restore()
        if restore and live is not None:
            self.set_state(live[0], Ended(Outcome.ABORTED))

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

    async def wait_for_gate(self) -> None:
        self.watchdog.ensure_running()
        await self.gate.wait_open()

    def record(self, held: Held) -> SessionRecord:
        """``held`` as its caller sees it, with its sandbox directory if it has one."""
        record = held.record(self.instance_id)
        box = self.sandboxes.get(held.rollout_id)
        if box is None:
            return record
        return dataclasses.replace(record, directory=str(box.directory))
