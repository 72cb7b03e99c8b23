"""The coordinator's operation lifecycle stepped without actors: each state a value,
entered only through ``OperationTable.set_state``, the outcome recorded once."""

from __future__ import annotations

import asyncio

import pytest

from actors.coordinator.operation_table import OperationTable
from actors.coordinator.states import (
    Aborted,
    Committed,
    FoundCommitted,
    RestoreCommitting,
    RestoreOperation,
    RestorePreparing,
    RestoreVerified,
    SnapshotBeginning,
    SnapshotCaptured,
    SnapshotCommitting,
    SnapshotOperation,
    SnapshotWriting,
    Unseen,
)
from nemo_ckpt.errors import (
    BackendUnavailableError,
    LeaseExpiredError,
    OperationAbortedError,
    StaleSnapshotError,
)
from nemo_ckpt.protocol.operations import Outcome

SNAP = "snap-20261201T000000-0badf00d-000002"
EARLIER = "snap-20261201T000000-0badf00d-000001"
RESTORE = "restore-20261201T000000-0badf00d-000003"


def _snapshot(table: OperationTable, op_id: str = SNAP) -> SnapshotOperation:
    return table.open(SnapshotOperation(op_id, "/ckpt/a", 0.0, 10.0, SnapshotBeginning()))


async def test_a_snapshot_steps_to_committed_and_a_late_call_gets_that_outcome() -> None:
    table = OperationTable(lease_s=10.0)
    op = _snapshot(table)
    table.set_state(op, SnapshotCaptured((), order=1))
    table.set_state(op, SnapshotWriting((), order=1))
    table.set_state(op, SnapshotCommitting((), order=1, released=2.0))
    assert op.committing and op.outcome is None and table.get(SNAP) is op
    table.set_state(op, Committed())
    assert op.outcome is Outcome.COMMITTED and op.closed.is_set()
    assert table.get(SNAP) is None and not table
    assert isinstance(table.refusal(SNAP), StaleSnapshotError)
    with pytest.raises(StaleSnapshotError, match="already committed"):
        _snapshot(table)


async def test_moves_outside_the_lifecycle_are_refused_and_change_nothing() -> None:
    table = OperationTable(lease_s=10.0)
    op = _snapshot(table)
    with pytest.raises(RuntimeError, match="no move from SnapshotBeginning to SnapshotCommitting"):
        table.set_state(op, SnapshotCommitting((), order=1))
    assert isinstance(op.state, SnapshotBeginning)
    table.set_state(op, Aborted())
    with pytest.raises(RuntimeError, match="no move from Aborted to Committed"):
        table.set_state(op, Committed())
    assert table.outcome(SNAP) is Outcome.ABORTED


async def test_an_abort_found_committed_is_its_own_move_and_replaces_the_outcome() -> None:
    table = OperationTable(lease_s=10.0)
    op = _snapshot(table)
    table.set_state(op, Aborted())
    assert isinstance(table.refusal(SNAP), OperationAbortedError)
    table.set_state(op, FoundCommitted())
    assert op.outcome is Outcome.COMMITTED and table.outcome(SNAP) is Outcome.COMMITTED


async def test_a_lapsed_operation_refuses_later_calls_with_the_lease_error() -> None:
    table = OperationTable(lease_s=7.0)
    op = _snapshot(table)
    table.set_state(op, Aborted(Outcome.LAPSED))
    refusal = table.refusal(SNAP)
    assert isinstance(refusal, LeaseExpiredError) and "no renewal for 7s" in str(refusal)


async def test_a_repeated_first_call_and_a_late_one_are_refused() -> None:
    table = OperationTable(lease_s=10.0)
    _snapshot(table)
    with pytest.raises(StaleSnapshotError, match="already in progress"):
        _snapshot(table)
    with pytest.raises(StaleSnapshotError, match="is late"):
        _snapshot(table, EARLIER)
    assert isinstance(table.refusal("snap-unknown"), BackendUnavailableError)


async def test_a_restore_steps_through_its_own_states() -> None:
    table = OperationTable(lease_s=10.0)
    op = table.open(RestoreOperation(RESTORE, "/ckpt/a", 0.0, 10.0, RestorePreparing()))
    with pytest.raises(RuntimeError):
        table.set_state(op, SnapshotCaptured((), order=1))
    table.set_state(op, RestoreVerified(read_seconds=0.3))
    table.set_state(op, RestoreCommitting(read_seconds=0.3))
    assert op.committing and op.kind == "restore"
    table.set_state(op, Aborted())
    assert table.outcome(RESTORE) is Outcome.ABORTED and op.closed.is_set()


async def test_an_operation_heard_of_only_by_its_abort_is_recorded_as_aborted() -> None:
    table = OperationTable(lease_s=10.0)
    op = table.adopt(SnapshotOperation(SNAP, "/ckpt/a", 0.0, 0.0, Unseen()))
    table.set_state(op, Aborted())
    assert table.outcome(SNAP) is Outcome.ABORTED
    with pytest.raises(OperationAbortedError):
        _snapshot(table)  # its late first call


async def test_ending_a_commit_cancels_its_pending_check_of_the_captures() -> None:
    table = OperationTable(lease_s=10.0)
    op = _snapshot(table)
    table.set_state(op, SnapshotCaptured((), order=1))
    check: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    table.set_state(op, SnapshotCommitting((), order=1, released=1.0, unique_check=check))
    table.set_state(op, Aborted())
    assert check.cancelled()
    assert table.bounds() == {"open": 0, "history": 1, "results": 0}
