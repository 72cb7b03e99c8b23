"""The coordinator's operations from their first call to their end: opened, and their
lease watched (``open``); renewed by the driver (``renew``); reaped when the lease lapses;
aborted (``abort``, ``end``).

An operation ends here, and only here, without committing: every holder it involved drops
it, then what it holds beyond the holders is released by its kind's ``Holds``, which lives
beside that kind's phases (``actors.coordinator.snapshot.SnapshotHolds``: the path's claim, the blob
store's hold, the files; ``actors.coordinator.restore.RestoreHolds``: the read claim). The phase
parts end an operation through ``end``; no part calls back into the coordinator that
composes them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, TypeVar

from actors.coordinator.parts import CoordinatorParts
from actors.coordinator.states import (
    Aborted,
    Operation,
    RestoreOperation,
    SnapshotOperation,
    Unseen,
)
from nemo_ckpt.protocol.calls import call
from nemo_ckpt.protocol.holder_api import HolderControl
from nemo_ckpt.protocol.operations import Outcome

__all__ = ["Holds", "OperationLifecycle"]

log = logging.getLogger("nemo_ckpt.coordinator")

OpT = TypeVar("OpT", bound=Operation)


class Holds(Protocol):
    """What one kind of operation holds beyond its holders (claims, holds, files)."""

    async def renew(self, op: Operation) -> None:
        """Renewed with the operation's lease; a failure is left to the commit."""
        ...

    async def release(self, op: Operation) -> None:
        """The operation ended without committing (its state says how): undo the rest."""
        ...


class OperationLifecycle:
    """Opens, renews, reaps and aborts the coordinator's operations."""

    def __init__(self, parts: CoordinatorParts, snapshots: Holds, restores: Holds) -> None:
        self._parts = parts
        self._holds: dict[str, Holds] = {SnapshotOperation.kind: snapshots,
                                         RestoreOperation.kind: restores}
        self._clock = parts.transport.runtime.clock
        self._reaper: asyncio.Task[None] | None = None

    def open(self, op: OpT) -> OpT:
        """Record a first call's operation (``OperationTable.open`` refuses a late or
        repeated one), and watch its lease from now on."""
        self._parts.operations.open(op)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())
        return op

    async def _reap(self) -> None:
        """Abort every operation whose lease lapsed: its driver stopped renewing."""
        operations = self._parts.operations
        period = min(self._parts.config.lease_s / 4, 1.0)
        while operations:
            await asyncio.sleep(period)
            now = self._clock.monotonic()
            for op in operations.open_ones():
                if not op.committing and now > op.lease_deadline:
                    log.warning("operation %s: no renewal for %.1fs; aborting it", op.id,
                                self._parts.config.lease_s)
                    await self.end(op, Outcome.LAPSED)

    async def renew(self, operation_id: str) -> None:
        """Renew the lease of the operation and of every holder taking part in it."""
        op = self._parts.operations.get(operation_id)
        if op is None:
            raise self._parts.operations.refusal(operation_id)
        lease_s = self._parts.config.lease_s
        op.lease_deadline = self._clock.monotonic() + lease_s
        # The holders first, and whatever the claims' writes do: a disk full for a few
        # seconds must not lapse the holders' leases (the commit checks the claims).
        await self._parts.holders.fan(
            op.holders, call(HolderControl.renew, operation_id, lease_s),
            tolerate_failures=True)
        await self._holds[op.kind].renew(op)

    async def abort(self, operation_id: str, checkpoint_path: str | None = None,
                    caller_error: str | None = None) -> str:
        """End the operation without a trace and return its outcome.

        The outcome is "committed" when its commit won (committed is final: nothing is
        removed then), else "aborted" or "lapsed". Every holder it involved drops it,
        and its files go. An operation this coordinator never saw (its predecessor
        died, or this abort overtook the first call) is aborted on every holder and
        remembered, so that its late first call is refused; it is a snapshot when the
        driver names its ``checkpoint_path``. ``caller_error`` names the exception that
        ended the caller's block, for the failure metric.
        """
        operations = self._parts.operations
        op = operations.get(operation_id)
        if op is None:
            known = operations.outcome(operation_id)
            if known is not None:
                if caller_error is not None:
                    self._parts.count_failure("snapshot" if checkpoint_path else "restore",
                                              caller_error)
                return known.value
            now = self._clock.monotonic()
            kind = SnapshotOperation if checkpoint_path is not None else RestoreOperation
            op = operations.adopt(kind(operation_id, checkpoint_path, now, now, Unseen()))
        if caller_error is not None:
            self._parts.count_failure(op.kind, caller_error)
        if op.committing:  # commit and abort exclude each other: the commit decides
            await op.closed.wait()
        else:
            await self.end(op, Outcome.ABORTED)
        assert op.outcome is not None
        return op.outcome.value

    async def end(self, op: Operation, outcome: Outcome) -> None:
        """End ``op`` with ``outcome`` (aborted or lapsed) and undo it everywhere: every
        holder it involved, then what it holds (its kind's ``Holds.release``). An
        operation that ended already is waited for."""
        if op.outcome is not None:
            await op.closed.wait()
            return
        unseen = isinstance(op.state, Unseen)
        # Only an abort that may follow a commit undoes a restore committed on a holder: a
        # restore this coordinator never began to commit (it stalled, was taken for dead,
        # and its successor committed the same id) must stay live.
        keep = isinstance(op, RestoreOperation) and not unseen and not op.committing
        self._parts.operations.set_state(op, Aborted(outcome))
        await self._holders_drop(op, unseen, keep)
        await self._holds[op.kind].release(op)

    async def _holders_drop(self, op: Operation, unseen: bool, keep_committed: bool) -> None:
        """Every holder ``op`` involved drops it, and every holder registered now: a
        holder made since (its predecessor died) may have been paused by a late call of
        this operation (a coordinator taken for dead that runs again); the abort it
        records refuses any later one. For an operation never seen here, every holder
        registered, answering or not: one slow to answer its info (a stalled link) may
        still be paused for it."""
        holders = self._parts.holders
        if unseen:
            await holders.discover()
            targets = holders.registered
        else:
            targets = dict(op.holders)
            for inst, handle in self._parts.transport.holders().items():
                if inst not in targets:
                    targets[inst] = handle
                elif targets[inst].ref != handle.ref:  # another incarnation of it now
                    targets[f"{inst} (now)"] = handle
        await holders.fan(targets, call(HolderControl.abort, op.id, keep_committed),
                          tolerate_failures=True, direct=True)
