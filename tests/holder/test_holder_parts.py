"""The holder's parts alone: its operations' lifecycles, its turn gate, its watchdog."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.holder.states import (
    Ended,
    HolderOperationTable,
    RestoreLive,
    RestoreLoading,
    RestoreWork,
    SnapshotPaused,
    SnapshotReleased,
    SnapshotWork,
)
from actors.holder.turn_gate import TurnGate
from actors.holder.watchdog import Check, Watchdog
from nemo_ckpt.errors import (
    HolderBusyError,
    HolderStateError,
    LeaseExpiredError,
    OperationAbortedError,
    StaleSnapshotError,
    TurnInProgressError,
)
from nemo_ckpt.phases import HolderState
from nemo_ckpt.protocol.operations import Outcome
from nemo_ckpt.storage.local_folder import LocalFolder
from tests.virtual_time import LoopClock, now, on_virtual_time

pytestmark = pytest.mark.timeout(30)


def paused(op_id: str, deadline: float = 10.0) -> SnapshotPaused:
    return SnapshotPaused(SnapshotWork(op_id, LocalFolder(Path("."))), deadline)


# --- the lifecycles ------------------------------------------------------------------------


def test_an_ended_operation_keeps_its_first_outcome() -> None:
    ops = HolderOperationTable("holder-0")
    ops.enter("snap-1", paused("snap-1"))
    ops.enter("snap-1", Ended(Outcome.LAPSED))
    ops.enter("snap-1", Ended(Outcome.COMMITTED))  # a late resume
    ops.enter("snap-1", Ended(Outcome.ABORTED))  # a late abort
    assert ops.outcome("snap-1") is Outcome.LAPSED and ops.get("snap-1") is None


def test_an_abort_that_comes_first_is_the_outcome_and_the_operation_cannot_start() -> None:
    ops = HolderOperationTable("holder-0")
    ops.enter("snap-1", Ended(Outcome.ABORTED))
    with pytest.raises(HolderStateError, match="already ended"):
        ops.enter("snap-1", paused("snap-1"))
    assert ops.outcome("snap-1") is Outcome.ABORTED and ops.current is None


def test_the_gate_closes_for_one_operation_at_a_time() -> None:
    ops = HolderOperationTable("holder-0")
    first = paused("snap-1")
    ops.enter("snap-1", first)
    with pytest.raises(HolderStateError, match="closed for another"):
        ops.enter("snap-2", paused("snap-2"))
    assert ops.current is first and ops.current_id() == "snap-1"
    ops.enter("snap-1", SnapshotReleased(first.work, first.lease_deadline))
    ops.enter("snap-2", paused("snap-2"))  # released: the gate is free again
    assert ops.current_id() == "snap-2"
    assert [s.work.id for s in ops.released()] == ["snap-1"]


def test_a_transition_not_in_the_list_is_refused() -> None:
    ops = HolderOperationTable("holder-0")
    state = paused("snap-1")
    ops.enter("snap-1", state)
    ops.enter("snap-1", SnapshotReleased(state.work, 10.0))
    with pytest.raises(HolderStateError, match="SnapshotReleased to SnapshotPaused"):
        ops.enter("snap-1", state)
    with pytest.raises(HolderStateError, match="NoneType to RestoreLive"):
        ops.enter("restore-1", RestoreLive((), ()))


async def test_a_live_restore_is_committed_until_undone_and_undone_is_its_outcome() -> None:
    ops = HolderOperationTable("holder-0")
    ops.enter("restore-1", RestoreLoading(RestoreWork("restore-1"), 10.0))
    assert ops.current is not None and ops.current.value is HolderState.RESTORING
    ops.enter("restore-1", RestoreLive(("r",), ()))
    assert ops.outcome("restore-1") is Outcome.COMMITTED and ops.current is None
    ops.enter("restore-1", Ended(Outcome.ABORTED))  # found committed after its abort
    assert ops.outcome("restore-1") is Outcome.ABORTED and ops.live_restore() is None


async def test_a_live_restore_settled_by_a_turn_stays_committed_after_a_late_abort() -> None:
    ops = HolderOperationTable("holder-0")
    ops.enter("restore-1", RestoreLoading(RestoreWork("restore-1"), 10.0))
    ops.enter("restore-1", RestoreLive(("r",), ()))
    ops.enter("restore-1", Ended(Outcome.COMMITTED))
    ops.enter("restore-1", Ended(Outcome.ABORTED))
    assert ops.outcome("restore-1") is Outcome.COMMITTED


def test_a_late_call_is_refused_with_its_operations_recorded_outcome() -> None:
    ops = HolderOperationTable("holder-0")
    for op_id, outcome in (("snap-1", Outcome.LAPSED), ("snap-2", Outcome.ABORTED),
                           ("snap-3", Outcome.COMMITTED)):
        ops.enter(op_id, paused(op_id))
        ops.enter(op_id, Ended(outcome))
    assert isinstance(ops.refusal("snap-1", now=0.0), LeaseExpiredError)
    assert isinstance(ops.refusal("snap-2", now=0.0), OperationAbortedError)
    refusal = ops.refusal("snap-3", now=0.0)
    assert isinstance(refusal, StaleSnapshotError) and "already committed" in str(refusal)
    assert "no operation snap-9 here" in str(ops.refusal("snap-9", now=0.0))


def test_a_call_for_another_operation_while_the_gate_is_closed_names_the_lease_left() -> None:
    ops = HolderOperationTable("holder-0")
    ops.enter("snap-1", paused("snap-1", deadline=10.0))
    refusal = ops.refusal("snap-0", now=7.5)
    assert isinstance(refusal, HolderBusyError)
    assert str(refusal).startswith("holder-0 refuses a call for snap-0: it is paused for "
                                   "snap-1") and "at most 2.5s" in str(refusal)


def test_lapsed_leases_list_the_gate_closing_operation_first() -> None:
    ops = HolderOperationTable("holder-0")
    first = paused("snap-1", deadline=5.0)
    ops.enter("snap-1", first)
    ops.enter("snap-1", SnapshotReleased(first.work, 5.0))
    ops.enter("snap-2", paused("snap-2", deadline=3.0))
    ops.enter("snap-3", Ended(Outcome.ABORTED))
    assert ops.lapsed(4.0) == ["snap-2"]
    assert ops.lapsed(6.0) == ["snap-2", "snap-1"]


# --- the turn gate -------------------------------------------------------------------------


@on_virtual_time
async def test_a_drain_returns_when_the_last_turn_ends_or_at_its_deadline() -> None:
    gate = TurnGate("holder-0", max_retired_marks=10)
    gate.begin("a", "t1", now())

    async def end_later() -> None:
        await asyncio.sleep(0.3)
        gate.take("a", "t1")
        await gate.notify()

    ending = asyncio.ensure_future(end_later())
    await gate.drain(5.0)
    assert now() == pytest.approx(0.3) and len(gate) == 0
    await ending
    gate.begin("b", "t2", now())
    await gate.drain(1.0)
    assert now() == pytest.approx(1.3) and "b" in gate


def test_one_turn_at_a_time_and_only_its_token_ends_it() -> None:
    gate = TurnGate("holder-0", max_retired_marks=10)
    gate.begin("a", "t1", 0.0)
    with pytest.raises(TurnInProgressError, match="one turn at a time"):
        gate.begin("a", "t2", 0.0)
    assert not gate.take("a", "t2") and gate.holds("a", "t1")
    assert gate.take("a", "t1") and len(gate) == 0


def test_a_token_aborted_before_its_begin_is_refused_once() -> None:
    gate = TurnGate("holder-0", max_retired_marks=10, max_aborted_tokens=2)
    assert not gate.abort("a", "early")  # not in flight: remembered
    assert gate.consume_aborted("early") and not gate.consume_aborted("early")
    for token in ("x", "y", "z"):
        gate.abort("a", token)
    assert gate.aborted_tokens == 2 and not gate.consume_aborted("x")  # the oldest went


def test_time_out_ends_only_the_turns_past_the_timeout() -> None:
    gate = TurnGate("holder-0", max_retired_marks=10)
    gate.begin("old", "t1", 0.0)
    gate.begin("new", "t2", 1.0)
    assert gate.time_out(now=1.5, timeout_s=1.0) == ["old"]
    assert "new" in gate and "old" not in gate


def test_time_out_does_not_count_the_time_the_gate_was_closed() -> None:
    gate = TurnGate("holder-0", max_retired_marks=10)
    gate.begin("a", "t1", 0.0)
    gate.set_open(False, now=0.5)
    assert gate.time_out(now=5.0, timeout_s=1.0) == []  # none ends while closed
    gate.begin("b", "t2", 6.0)  # a begin that passed the gate before it closed
    gate.set_open(True, now=10.0)
    assert gate.time_out(now=10.4, timeout_s=1.0) == []  # a: 0.5 + 0.4 s counted
    assert gate.time_out(now=10.6, timeout_s=1.0) == ["a"]
    assert gate.time_out(now=10.9, timeout_s=1.0) == []  # b: counted from the opening
    assert gate.time_out(now=11.1, timeout_s=1.0) == ["b"]


def test_retire_marks_only_rise_and_the_oldest_go_past_the_bound() -> None:
    gate = TurnGate("holder-0", max_retired_marks=2)
    assert gate.retire("r", 3) == 3 and gate.retire("r", 1) == 3
    gate.forget("r", 2)  # below the mark: kept
    assert gate.retired_up_to("r") == 3
    gate.retire("s", 0)
    gate.retire("t", 0)
    gate.bound_marks()
    assert gate.retired_up_to("r") is None and gate.retire_marks == 2


# --- the watchdog --------------------------------------------------------------------------


@on_virtual_time
async def test_the_watchdog_runs_its_named_checks_in_order_every_period() -> None:
    seen: list[tuple[str, float]] = []

    def check(name: str) -> Check:
        async def run(at: float) -> None:
            seen.append((name, round(at, 6)))
        return Check(name, run)

    dog = Watchdog(LoopClock(), 0.5, [check("leases"), check("turn timeouts")])
    assert dog.names == ("leases", "turn timeouts")
    dog.ensure_running()
    dog.ensure_running()  # one loop, however often it is asked
    await asyncio.sleep(1.2)
    assert seen == [("leases", 0.5), ("turn timeouts", 0.5),
                    ("leases", 1.0), ("turn timeouts", 1.0)]


@on_virtual_time
async def test_a_watchdog_stopped_by_a_failing_check_starts_again_when_asked() -> None:
    ticks: list[float] = []

    async def flaky(at: float) -> None:
        ticks.append(at)
        if len(ticks) == 1:
            raise OSError("disk gone")

    dog = Watchdog(LoopClock(), 0.1, [Check("flaky", flaky)])
    dog.ensure_running()
    await asyncio.sleep(0.35)
    assert len(ticks) == 1  # the loop stopped at the failure
    dog.ensure_running()
    await asyncio.sleep(0.25)
    assert len(ticks) == 3
