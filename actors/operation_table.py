"""The coordinator's record of its operations: one record and one outcome each.

``OperationTable`` opens a record for each first call, answers or refuses every later
one from it, and is the only place a record's state changes (``set_state``): the move
is checked against ``actors.operation_states``, and entering a terminal state alone
records the outcome, in a bounded history (``nemo_ckpt.operations``) that answers late
and repeated calls once the record is gone.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from actors.operation_states import (
    FoundCommitted,
    Operation,
    OperationState,
    SnapshotCommitting,
    Terminal,
    Unseen,
    can_move,
)
from nemo_ckpt.errors import (
    BackendUnavailableError,
    LeaseExpiredError,
    OperationAbortedError,
    StaleSnapshotError,
)
from nemo_ckpt.operations import HISTORY_SIZE, OperationHistory, Outcome

__all__ = ["OperationTable"]


class OperationTable:
    """Open operations by id, and the outcomes of the last ones that ended."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s  # for the refusal of a lapsed operation
        self._open: dict[str, Operation] = {}
        self._history = OperationHistory()
        # What a committed snapshot's commit answered, for a repeated commit.
        self._results: OrderedDict[str, Any] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._open)

    def get(self, op_id: str) -> Operation | None:
        """The open operation ``op_id``, if any."""
        return self._open.get(op_id)

    def open_ones(self) -> list[Operation]:
        return list(self._open.values())

    def bounds(self) -> dict[str, int]:
        """The sizes of what the table remembers: open records, outcomes, results."""
        return {"open": len(self._open), "history": len(self._history),
                "results": len(self._results)}

    def outcome(self, op_id: str) -> Outcome | None:
        """How ``op_id`` ended, if it is among the last ones that did."""
        return self._history.outcome(op_id)

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
        if self._history.outcome(op.id) is not None or self._history.is_late(op.id):
            raise self.refusal(op.id)
        self._history.note(op.id)
        self._open[op.id] = op
        return op

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
        self._history.record(op.id, state.outcome, replace=isinstance(state, FoundCommitted))
        self._open.pop(op.id, None)
        if isinstance(old, SnapshotCommitting) and old.unique_check is not None:
            old.unique_check.cancel()  # decodes every capture: needless now
        op.closed.set()

    def refusal(self, op_id: str) -> Exception:
        """Why a call for ``op_id``, which is not open here, is refused."""
        outcome = self._history.outcome(op_id)
        if outcome is Outcome.LAPSED:
            return LeaseExpiredError(
                f"the lease of {op_id} lapsed (no renewal for {self.lease_s:g}s: the "
                f"driver stalled or could not reach the coordinator), so it was aborted and "
                f"the holders resumed; retry")
        if outcome is Outcome.ABORTED:
            return OperationAbortedError(f"{op_id} was aborted; retry the operation")
        if outcome is Outcome.COMMITTED:
            return StaleSnapshotError(f"{op_id} already committed")
        if self._history.is_late(op_id):
            return StaleSnapshotError(
                f"{op_id} is late: its driver has started a newer operation since")
        return BackendUnavailableError(
            f"coordinator knows no operation {op_id}: it restarted since the operation "
            f"began, and the holders resume by their lease; retry the operation")
