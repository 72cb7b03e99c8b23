"""The coordinator's record of its operations: one record and one outcome each.

``OperationTable`` opens a record for each first call, answers or refuses every later
one from it, and is the only place a record's state changes (``set_state``): the move
is checked against ``actors.coordinator.states``, and entering a terminal state alone
records the outcome, in a bounded history (``nemo_ckpt.protocol.operations``) that answers late
and repeated calls once the record is gone.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from actors.coordinator.states import (
    FoundCommitted,
    Operation,
    OperationState,
    SnapshotCommitting,
    Terminal,
    Unseen,
    can_move,
)
from nemo_ckpt.errors import BackendUnavailableError, StaleSnapshotError
from nemo_ckpt.protocol.operations import HISTORY_SIZE, LifecycleTable

__all__ = ["OperationTable"]

T = TypeVar("T")


class OperationTable(LifecycleTable[Operation]):
    """Open operations by id, and the outcomes of the last ones that ended (the base:
    ``nemo_ckpt.protocol.operations.LifecycleTable``)."""

    def __init__(self, lease_s: float) -> None:
        super().__init__()
        self.lease_s = lease_s  # for the refusal of a lapsed operation
        # What a committed snapshot's commit answered, for a repeated commit.
        self._results: OrderedDict[str, Any] = OrderedDict()
        # The first call of each operation (begin_snapshot, prepare_restore) as it runs
        # or answered, for a repeat of it: kept while the operation is open.
        self._first: dict[str, asyncio.Future[Any]] = {}

    def open_ones(self) -> list[Operation]:
        return list(self._open.values())

    def bounds(self) -> dict[str, int]:
        """The sizes of what the table remembers: open records, outcomes, results."""
        return {"open": len(self._open), "history": len(self.history),
                "results": len(self._results)}

    def result(self, op_id: str) -> Any:
        """What the commit of ``op_id`` answered, if it committed recently here."""
        return self._results.get(op_id)

    def keep_result(self, op_id: str, result: Any) -> None:
        self._results[op_id] = result
        while len(self._results) > HISTORY_SIZE:
            self._results.popitem(last=False)

    def open(self, op: Operation) -> Operation:
        """Record a first call's operation, or refuse an id that ended, is late, or is
        open."""
        if op.id in self._open:
            raise StaleSnapshotError(f"{op.id} is already in progress; a repeated first "
                                     f"call is refused")
        self.refuse_ended(op.id)
        self.history.note(op.id)
        self._open[op.id] = op
        return op

    async def first_call(self, op_id: str, start: Callable[[], Awaitable[T]]) -> T:
        """Run ``op_id``'s first call, or answer a repeat of it as the first one answers
        (waiting for it while it runs): a driver whose answer was lost sends it again
        (``nemo_ckpt.driver.link``), and it must learn what happened, not meet its own
        operation "already in progress". A repeat after the operation ended starts it
        again, which ``open`` refuses with its outcome."""
        running = self._first.get(op_id)
        if running is None or (running.done() and op_id not in self._open):
            for ended in [i for i, f in self._first.items() if f.done() and i not in self._open]:
                del self._first[ended]
            running = asyncio.ensure_future(start())
            running.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._first[op_id] = running
        answer: T = await asyncio.shield(running)
        return answer

    def adopt(self, op: Operation) -> Operation:
        """Record an operation first heard of by its abort; it must be ``Unseen``."""
        assert isinstance(op.state, Unseen) and op.id not in self._open
        self._open[op.id] = op
        return op

    def set_state(self, op: Operation, state: OperationState) -> None:
        """Move ``op`` to ``state``: the one transition. Entering a terminal state records
        the outcome (``FoundCommitted`` replaces the abort recorded before it) and closes
        the record: the data of the states before it is dropped with them."""
        if not can_move(op.state, state):
            raise RuntimeError(f"{op.id}: no move from {op.state!r} to {state!r}")
        old, op.state = op.state, state
        if not isinstance(state, Terminal):
            return
        self._close(op.id, state.outcome, replace=isinstance(state, FoundCommitted))
        if isinstance(old, SnapshotCommitting) and old.unique_check is not None:
            old.unique_check.cancel()  # decodes every capture: needless now
        op.closed.set()

    # --- the coordinator's words for a refusal (``LifecycleTable.refusal``) --------------

    def _lapsed(self, op_id: str) -> str:
        return (f"the lease of {op_id} lapsed (no renewal for {self.lease_s:g}s: the "
                f"driver stalled or could not reach the coordinator), so it was aborted and "
                f"the holders resumed; retry")

    def _aborted(self, op_id: str) -> str:
        return f"{op_id} was aborted; retry the operation"

    def _unknown(self, op_id: str, now: float) -> Exception:
        return BackendUnavailableError(
            f"coordinator knows no operation {op_id}: it restarted since the operation "
            f"began, and the holders resume by their lease; retry the operation")
