"""The holder's operations from admission to their end: a new snapshot or restore let in
or refused (``admit``); its lease renewed by the coordinator (``renew``), lapsed by
the watchdog (``lapse``); aborted (``abort``).

An operation ends here, and only here, without committing (``end``): the one transition
(``HolderParts.set_state``) records the outcome and opens the gate, then a restore's undo,
which lives beside its phases (``actors.holder.restore.RestoreUndo``), drops what it
staged or made live. A snapshot leaves nothing to undo: a shard still being written
removes itself once written (``SnapshotPhases._persist``). The phase parts end an
operation through ``end``; none calls back into the holder that composes them.
"""

from __future__ import annotations

import logging
from typing import Protocol

from actors.holder.parts import HolderParts
from actors.holder.states import (
    Ended,
    OperationState,
    RestoreLive,
    RestoreLoading,
    SnapshotPaused,
    SnapshotReleased,
)
from nemo_ckpt.protocol.operations import Outcome

__all__ = ["HolderOperations", "Undo"]

log = logging.getLogger("nemo_ckpt.holder")


class Undo(Protocol):
    """What a restore leaves behind when it ends without committing."""

    def undo(self, op_id: str, old: OperationState) -> None:
        """``op_id`` left ``old`` for an end that is not a commit: drop what it left."""
        ...


class HolderOperations:
    """Admits, renews, lapses and aborts the holder's operations."""

    def __init__(self, parts: HolderParts, restores: Undo) -> None:
        self._parts = parts
        self._restores = restores
        self.instance_id = parts.instance_id

    def admit(self, op_id: str, what: str, restore: bool = False) -> None:
        """Let a new operation start, or refuse: one that already ended or that its
        driver has moved past (a late call), or while another one runs.

        A new restore supersedes the last one if it went live here but was never used
        (no turn since): its sessions go first. That is how the retry of a restore that
        failed elsewhere adopts this holder when the failed one's abort has not reached
        it yet (a slow link): all or nothing, whichever message comes first."""
        parts = self._parts
        now = parts.clock.monotonic()
        parts.ops.refuse_ended(op_id, now)
        if parts.ops.current is not None:
            raise parts.busy(what)
        parts.ops.history.note(op_id)
        live = parts.ops.live_restore()
        if restore and live is not None:
            self.end(live[0], Outcome.ABORTED)

    async def renew(self, operation_id: str, lease_s: float) -> float:
        """Extend the lease of the snapshot or restore in progress (paused, restoring or
        released); returns seconds left. Refused, without changing anything, for any
        other operation."""
        state = self._parts.ops.get(operation_id)
        if not isinstance(state, SnapshotPaused | SnapshotReleased | RestoreLoading):
            raise self._parts.refusal(operation_id)
        state.lease_deadline = self._parts.clock.monotonic() + lease_s
        return lease_s

    async def lapse(self, now: float) -> None:
        """End every open operation whose lease ran out: nobody renews it any more. A
        shard already written stays (a coordinator may hold its report and commit it);
        one written later removes itself (``SnapshotPhases._persist``)."""
        ops = self._parts.ops
        for op_id in ops.lapsed(now):
            released = isinstance(ops.get(op_id), SnapshotReleased)
            log.warning("%s: lease of %s lapsed%s", self.instance_id, op_id,
                        " while its shard was written" if released
                        else "; resuming by itself")
            self.end(op_id, Outcome.LAPSED)

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
        if keep_committed and isinstance(self._parts.ops.get(operation_id), RestoreLive):
            log.warning("%s: an abort of %s from a coordinator that never committed it "
                        "leaves it live: it was committed here", self.instance_id,
                        operation_id)
            return
        self.end(operation_id, Outcome.ABORTED)

    def end(self, op_id: str, outcome: Outcome) -> None:
        """End ``op_id`` with ``outcome`` (aborted or lapsed), and undo what it left."""
        assert outcome is not Outcome.COMMITTED
        old = self._parts.set_state(op_id, Ended(outcome))
        if old is None:
            return
        if not isinstance(old, RestoreLive):  # an undone restore says so itself
            log.info("%s: %s %s", self.instance_id, op_id, outcome.value)
        self._restores.undo(op_id, old)
