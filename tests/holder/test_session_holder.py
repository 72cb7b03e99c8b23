"""The session holder's state machine, driven directly (no Ray) for speed and precision.

Every test runs on virtual time (``tests/virtual_time.py``): a lease that lapses or a turn
that times out is stepped exactly, without waiting for it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import pickle
from datetime import datetime, timezone
from pathlib import Path

import pytest

from actors.drills import HOLDER_POINTS, PhaseDelays
from actors.holder.actor import SessionHolder
from nemo_ckpt.errors import (
    CaptureKeyCollisionError,
    HolderBusyError,
    HolderStateError,
    LeaseExpiredError,
    OperationAbortedError,
    RestoreConflictError,
    RetiredAttemptError,
    SessionExistsError,
    SessionNotFoundError,
    SnapshotNotFoundError,
    StaleSnapshotError,
    StateTooLargeError,
    TurnAbortedError,
    TurnInProgressError,
    TurnTimedOutError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState, ShardRef
from nemo_ckpt.protocol.operations import new_operation_id
from nemo_ckpt.session_record import encode_turns
from nemo_ckpt.shard_refs import shard_entry, shard_ref
from nemo_ckpt.storage.checkpoint_folder import prepare_environment_dir
from nemo_ckpt.storage.manifest import encode_manifest
from nemo_ckpt.storage.shards import read_shard
from nemo_ckpt.storage.snapshot_files import read_manifest, write_manifest
from tests.virtual_time import now, on_virtual_time, virtual_runtime

pytestmark = pytest.mark.timeout(30)


def holder(node_id: str = "node-a", delays: dict[str, float] | None = None,
           **kw: object) -> SessionHolder:
    """A holder on virtual time; ``delays`` makes those of its phases take longer
    (``actors.drills``), to aim a fault at them."""
    phases = PhaseDelays(HOLDER_POINTS)
    for phase, seconds in (delays or {}).items():
        phases.set(phase, seconds)
    runtime = dataclasses.replace(virtual_runtime(), reached=phases.reached)
    return SessionHolder("holder-0", node_id=node_id, runtime=runtime,
                         **kw)  # type: ignore[arg-type]


_tokens = itertools.count()


async def begin(h: SessionHolder, ep: Ep) -> str:
    """Begin a turn of ``ep`` as a client does: with a token of its own."""
    token = f"tok{next(_tokens)}"
    await h.begin_turn(ep, token)
    return token


async def run_turn(h: SessionHolder, ep: Ep, record: bytes, state: bytes,
                   keys: tuple[str, ...] = ()) -> None:
    token = await begin(h, ep)
    await h.commit_turn(ep, token, record, state, keys)


@on_virtual_time
async def test_turns_append_records_replace_state_and_collect_staging_keys() -> None:
    h = holder()
    ep = Ep("r", 0)
    await h.open_session(ep, b"s0")
    await run_turn(h, ep, b"t0", b"s1", ("r/0",))
    await run_turn(h, ep, b"t1", b"s2", ("r/1",))
    s = await h.get_session("r")
    assert (s.turns, s.state, s.staging_keys) == ((b"t0", b"t1"), b"s2", {"r/0", "r/1"})


@on_virtual_time
async def test_an_aborted_turn_records_nothing() -> None:
    h = holder()
    ep = Ep("r", 0)
    await h.open_session(ep, b"s0")
    token = await begin(h, ep)
    await h.abort_turn(ep, token)
    s = await h.get_session("r")
    assert (s.turns, s.state, s.staging_keys) == ((), b"s0", frozenset())
    with pytest.raises(TurnInProgressError, match="no turn in flight"):
        await h.commit_turn(ep, token, b"late", b"x")


@on_virtual_time
async def test_one_turn_at_a_time_per_session() -> None:
    h = holder()
    await h.open_session(Ep("r", 0))
    await begin(h, Ep("r", 0))
    with pytest.raises(TurnInProgressError, match="one turn at a time"):
        await begin(h, Ep("r", 0))


@on_virtual_time
async def test_colliding_capture_keys_are_refused() -> None:
    h = holder()
    await h.open_session(Ep("r", 1))  # capture key "r-a1"
    with pytest.raises(CaptureKeyCollisionError, match="'r-a1'"):
        await h.open_session(Ep("r-a1", 0))
    # The same open again (its answer was lost) changes nothing; another one is refused.
    assert (await h.open_session(Ep("r", 1))).episode == Ep("r", 1)
    with pytest.raises(SessionExistsError, match="already open"):
        await h.open_session(Ep("r", 1), b"another initial state")
    with pytest.raises(SessionExistsError, match="already has a live session"):
        await h.open_session(Ep("r", 2))


@on_virtual_time
async def test_oversized_state_and_records_are_refused() -> None:
    h = holder(max_state_bytes=10)
    with pytest.raises(StateTooLargeError, match="11 bytes, over the limit of 10"):
        await h.open_session(Ep("r", 0), b"x" * 11)
    await h.open_session(Ep("r", 0), b"ok")
    token = await begin(h, Ep("r", 0))
    with pytest.raises(StateTooLargeError):
        await h.commit_turn(Ep("r", 0), token, b"y" * 11, b"")
    assert (await h.get_session("r")).turns == ()


@on_virtual_time
async def test_a_session_that_does_not_exist_is_named() -> None:
    with pytest.raises(SessionNotFoundError, match="'nope'"):
        await begin(holder(), Ep("nope", 0))


@on_virtual_time
async def test_new_turns_wait_while_paused_and_run_after_resume() -> None:
    h = holder()
    await h.open_session(Ep("r", 0))
    await h.pause("snap-1", drain_timeout_s=1, lease_s=10)
    waiting = asyncio.ensure_future(h.begin_turn(Ep("r", 0), "t1"))
    await asyncio.sleep(0.2)
    assert not waiting.done(), "a turn began while the holder was paused"
    await h.commit_snapshot("snap-1")
    await asyncio.wait_for(waiting, 2)
    await h.commit_turn(Ep("r", 0), "t1", b"t", b"s")


@on_virtual_time
async def test_pause_drains_turns_in_flight_before_capture() -> None:
    h = holder()
    ep = Ep("r", 0)
    await h.open_session(ep)
    token = await begin(h, ep)

    async def finish_soon() -> None:
        await asyncio.sleep(0.2)
        await h.commit_turn(ep, token, b"t0", b"s1", ["r/0"])

    finisher = asyncio.ensure_future(finish_soon())
    report = await h.pause("snap-1", drain_timeout_s=5, lease_s=10)
    await finisher
    assert report.turns_in_flight == 0 and report.drain_seconds == pytest.approx(0.2)
    capture = await h.capture("snap-1")
    assert capture.captured() == [("r", 0, ["r/0"], 1)] and capture.restarting == ()
    assert capture.captured_count == 1


@on_virtual_time
async def test_a_session_mid_turn_at_the_deadline_restarts_and_is_not_captured() -> None:
    h = holder()
    await h.open_session(Ep("busy", 0))
    await h.open_session(Ep("idle", 0))
    await begin(h, Ep("busy", 0))
    report = await h.pause("snap-1", drain_timeout_s=0.1, lease_s=10)
    assert report.turns_in_flight == 1
    capture = await h.capture("snap-1")
    assert [c[0] for c in capture.captured()] == ["idle"]
    assert capture.restarting == (("busy", 0),)


@on_virtual_time
async def test_repeated_phases_are_idempotent_and_stale_ids_refused(tmp_path: Path) -> None:
    h = holder()
    await h.open_session(Ep("r", 0), b"s")
    p1 = await h.pause("snap-1", 1, 10)
    assert await h.pause("snap-1", 1, 10) == p1
    c1 = await h.capture("snap-1")
    assert await h.capture("snap-1") == c1
    with pytest.raises(HolderBusyError,
                       match="refuses a call for snap-0: it is paused for snap-1"):
        await h.capture("snap-0")
    with pytest.raises(HolderBusyError,
                       match="refuses pause for snapshot snap-2: it is paused for snap-1"):
        await h.pause("snap-2", 1, 10)
    directory = prepare_environment_dir(tmp_path)
    await h.start_writes("snap-1", str(directory))
    await h.start_writes("snap-1", str(directory))
    r1 = await h.finish_writes("snap-1")
    assert await h.finish_writes("snap-1") == r1
    assert len(r1.shards) == 1 and r1.bytes_written == r1.shards[0].bytes
    await h.commit_snapshot("snap-1")
    await h.commit_snapshot("snap-1")
    assert (await h.info()).state is HolderState.RUNNING
    with pytest.raises(StaleSnapshotError, match="snap-1 already committed"):
        await h.capture("snap-1")


@on_virtual_time
async def test_the_capture_reports_each_sessions_latest_turns_keys_and_state() -> None:
    h = holder()
    await h.open_session(Ep("a", 0), b"12345")
    await h.open_session(Ep("b", 1), b"1")
    await h.open_session(Ep("gone", 0), b"x" * 100)
    await run_turn(h, Ep("a", 0), b"t0", b"123", ("a/0",))
    await run_turn(h, Ep("a", 0), b"t1", b"1234567", ("a/1", "a/0b"))
    await h.retire([Ep("gone", 0)])
    await h.open_session(Ep("busy", 0), b"y" * 50)
    await begin(h, Ep("busy", 0))
    await h.pause("snap-1", drain_timeout_s=0.05, lease_s=10)
    capture = await h.capture("snap-1")
    assert sorted(capture.captured()) == [("a", 0, ["a/0", "a/0b", "a/1"], 2),
                                          ("b", 1, [], 0)]
    held = [encode_turns((b"t0", b"t1")) + b"1234567", encode_turns(()) + b"1"]
    assert (capture.captured_count, capture.state_bytes) == (2, sum(map(len, held)))
    assert capture.restarting == (("busy", 0),)


@on_virtual_time
async def test_begin_pauses_and_captures_without_writing_until_asked(tmp_path: Path) -> None:
    h = holder()
    await h.open_session(Ep("r", 0), b"s")
    directory = prepare_environment_dir(tmp_path)
    pause, capture = await h.begin_snapshot("snap-1", 1, 10, str(directory))
    assert (pause.turns_in_flight, capture.captured_count) == (0, 1)
    await asyncio.sleep(0.1)
    assert list(directory.iterdir()) == []  # the write waits for start_writes
    await h.start_writes("snap-1")  # into the folder begin named
    report = await h.finish_writes("snap-1")
    assert [p.name for p in directory.iterdir()] == [report.shards[0].file]
    assert [r.episode for r in read_shard(directory, shard_entry(report.shards[0]))] == [Ep("r", 0)]


@on_virtual_time
async def test_finish_writes_starts_a_write_whose_start_message_never_came(
    tmp_path: Path,
) -> None:
    h = holder()
    await h.open_session(Ep("r", 0), b"s")
    directory = prepare_environment_dir(tmp_path)
    await h.begin_snapshot("snap-1", 1, 10, str(directory))
    report = await h.finish_writes("snap-1")
    assert report.bytes_written > 0 and (directory / report.shards[0].file).is_file()
    await h.start_writes("snap-1")  # arriving late, it is a no-op
    assert await h.finish_writes("snap-1") == report


@on_virtual_time
async def test_persist_of_a_snapshot_not_yet_captured_is_refused() -> None:
    h = holder()
    await h.open_session(Ep("r", 0), b"s")
    await h.pause("snap-1", 1, 10)
    with pytest.raises(HolderStateError, match="persist for snapshot snap-1 before capture"):
        await h.finish_writes("snap-1")


@on_virtual_time
async def test_a_lapsed_lease_resumes_the_holder_and_blocks_the_commit(tmp_path: Path) -> None:
    h = holder()
    await h.open_session(Ep("r", 0))
    await h.pause("snap-1", 1, lease_s=0.3)
    await h.capture("snap-1")
    await h.start_writes("snap-1", str(prepare_environment_dir(tmp_path)))
    await asyncio.sleep(0.6)
    info = await h.info()
    assert info.state is HolderState.RUNNING and info.operation_id is None
    with pytest.raises(LeaseExpiredError, match="lease of snap-1 lapsed"):
        await h.finish_writes("snap-1")
    with pytest.raises(LeaseExpiredError):
        await h.renew("snap-1", 10)
    await h.abort("snap-1")  # the coordinator's abort still succeeds
    # Without a manifest the written shard is no snapshot; turns flow again.
    with pytest.raises(SnapshotNotFoundError, match="interrupted before it committed"):
        read_manifest(tmp_path)
    await asyncio.wait_for(begin(h, Ep("r", 0)), 1)


@on_virtual_time
async def test_a_shard_finished_after_its_snapshot_was_aborted_removes_itself(
    tmp_path: Path,
) -> None:
    h = holder(delays={"persist": 0.3})
    await h.open_session(Ep("r", 0))
    await h.pause("snap-1", 1, 10)
    await h.capture("snap-1")
    await h.start_writes("snap-1", str(prepare_environment_dir(tmp_path)))
    await h.abort("snap-1")  # aborted while the write is still pending
    await asyncio.sleep(0.6)
    assert list((tmp_path / "environment").iterdir()) == []


@on_virtual_time
async def test_a_lease_lapses_at_the_watchdogs_first_look_past_its_deadline() -> None:
    h = holder(watch_period_s=0.1)
    await h.pause("snap-1", 1, lease_s=0.25)
    await asyncio.sleep(0.29 - now())
    assert h.current == (HolderState.PAUSED, "snap-1")  # past the deadline, not yet seen
    await asyncio.sleep(0.31 - now())
    assert h.current == (HolderState.RUNNING, None)
    await h.commit_snapshot("snap-1")  # a late resume changes nothing
    assert h.current == (HolderState.RUNNING, None)
    with pytest.raises(LeaseExpiredError, match="lease of snap-1 lapsed"):
        await h.capture("snap-1")


@on_virtual_time
async def test_renewing_the_lease_keeps_the_holder_paused() -> None:
    h = holder()
    await h.pause("snap-1", 1, lease_s=0.3)
    for _ in range(4):
        await asyncio.sleep(0.15)
        await h.renew("snap-1", 0.3)
    assert (await h.info()).state is HolderState.PAUSED


@on_virtual_time
async def test_retire_drops_the_session_and_refuses_its_late_turns() -> None:
    h = holder()
    ep = Ep("r", 0)
    await h.open_session(ep)
    token = await begin(h, ep)
    assert await h.retire([ep]) == ["r"]
    with pytest.raises(RetiredAttemptError, match="retired"):
        await h.commit_turn(ep, token, b"late", b"")
    with pytest.raises(RetiredAttemptError):
        await begin(h, ep)
    with pytest.raises(RetiredAttemptError):
        await h.open_session(ep)
    assert await h.forget([ep]) == []
    await h.open_session(ep)  # forgotten: the refusal is gone too
    assert await h.forget([ep]) == ["r"]


@on_virtual_time
async def test_retire_and_forget_are_refused_while_paused() -> None:
    h = holder()
    await h.pause("snap-1", 1, 10)
    for op in (h.retire, h.forget):
        with pytest.raises(HolderBusyError, match="paused for snap-1"):
            await op([Ep("r", 0)])


@on_virtual_time
async def test_a_manifest_written_from_the_holders_report_restores_through_the_wire_type(
        tmp_path: Path) -> None:
    # The path of a snapshot and its restore across the wire: the holder reports its
    # shard as a ShardRef, the coordinator writes the manifest's ShardEntry from it, and
    # a restore reads the manifest and sends the shard back to a holder as a ShardRef.
    src = holder()
    ep = Ep("r", 0)
    await src.open_session(ep, b"s0")
    await run_turn(src, ep, b"t0", b"s1", ("r/0",))
    await src.pause("snap-1", 1, 10)
    await src.capture("snap-1")
    directory = prepare_environment_dir(tmp_path)
    await src.start_writes("snap-1", str(directory))
    report = await src.finish_writes("snap-1")
    assert [type(s) for s in report.shards] == [ShardRef]
    write_manifest(directory, encode_manifest(
        snapshot_id="snap-1", created_at=datetime.now(timezone.utc), instances=["holder-0"],
        shards=[shard_entry(s) for s in report.shards], restarted_rollouts=0, metrics={}))
    shards = [shard_ref(s) for s in read_manifest(tmp_path).shards]
    assert shards == list(report.shards)  # nothing lost on disk and back
    dst = holder("node-b")
    await dst.prepare_restore("restore-1", str(directory),
                              pickle.loads(pickle.dumps(shards)), 10)  # as sent
    assert await dst.commit_restore("restore-1") == 1
    (s,) = await dst.sessions()
    assert (s.episode, s.turns, s.state, s.staging_keys) == (Ep("r", 1), (b"t0",), b"s1",
                                                            {"r/0"})


@on_virtual_time
async def test_restore_installs_next_attempts_only_on_commit(tmp_path: Path) -> None:
    src = holder()
    ep = Ep("r", 0)
    await src.open_session(ep, b"s0")
    await run_turn(src, ep, b"t0", b"s1", ("r/0",))
    await src.pause("snap-1", 1, 10)
    await src.capture("snap-1")
    directory = prepare_environment_dir(tmp_path)
    await src.start_writes("snap-1", str(directory))
    report = await src.finish_writes("snap-1")

    dst = holder("node-b")
    prepared = await dst.prepare_restore("restore-1", str(directory), list(report.shards), 10)
    assert prepared.continued() == [("r", 0)] and prepared.staging_keys == {"r/0"}
    assert prepared.sessions_by_shard() == [(report.shards[0].file, [("r", 0)])]
    assert (await dst.info()).state is HolderState.RESTORING
    assert await dst.sessions() == []
    assert await dst.commit_restore("restore-1") == 1
    (s,) = await dst.sessions()
    assert s.episode == Ep("r", 1) and s.turns == (b"t0",) and s.state == b"s1"
    assert s.staging_keys == {"r/0"} and s.earlier_capture_keys == ("r",)
    await run_turn(dst, Ep("r", 1), b"t1", b"s2")  # it continues as a live session


@on_virtual_time
async def test_an_aborted_restore_leaves_nothing_and_a_conflict_is_refused(tmp_path: Path) -> None:
    src = holder()
    await src.open_session(Ep("r", 0))
    await src.pause("s", 1, 10)
    await src.capture("s")
    directory = prepare_environment_dir(tmp_path)
    await src.start_writes("s", str(directory))
    shards = list((await src.finish_writes("s")).shards)

    dst = holder("node-b")
    await dst.prepare_restore("restore-1", str(directory), shards, 10)
    await dst.abort("restore-1")
    assert await dst.sessions() == [] and (await dst.info()).state is HolderState.RUNNING

    await dst.open_session(Ep("r", 5))
    with pytest.raises(RestoreConflictError, match=r"\['r'\]"):
        await dst.prepare_restore("restore-2", directory, shards, 10)
    assert (await dst.info()).state is HolderState.RUNNING
    assert [s.episode for s in await dst.sessions()] == [Ep("r", 5)]


@on_virtual_time
async def test_a_turn_past_its_timeout_is_aborted_by_the_holder() -> None:
    h = holder(turn_timeout_s=0.2)
    await h.open_session(Ep("r", 0))
    token = await begin(h, Ep("r", 0))
    await asyncio.sleep(0.35)  # the watchdog looks every 0.1 s
    with pytest.raises(TurnInProgressError, match="aborted"):
        await h.commit_turn(Ep("r", 0), token, b"late", b"")
    assert (await h.sessions())[0].turns == ()


@on_virtual_time
async def test_a_timed_out_turns_commit_says_it_ran_past_turn_timeout_s() -> None:
    # Its worker learns why, and that it may run the turn again; a retried commit is
    # refused for the timeout, not taken for a second turn in flight (seed 21174).
    h = holder(turn_timeout_s=0.2)
    await h.open_session(Ep("r", 0))
    token = await begin(h, Ep("r", 0))
    await asyncio.sleep(0.35)
    for _ in range(2):
        with pytest.raises(TurnTimedOutError, match=r"ran longer than turn_timeout_s "
                                                    r"\(0.2s.*run the turn again"):
            await h.commit_turn(Ep("r", 0), token, b"late", b"")
    # A token that never began is refused as before, not as a timeout.
    with pytest.raises(TurnInProgressError, match="no turn in flight") as refused:
        await h.commit_turn(Ep("r", 0), "never-begun", b"t", b"")
    assert not isinstance(refused.value, TurnTimedOutError)
    token = await begin(h, Ep("r", 0))  # the turn runs again
    head = await h.commit_turn(Ep("r", 0), token, b"t0", b"s1")
    assert head.turn_count == 1 and await h.read_turns(Ep("r", 0)) == [b"t0"]


@on_virtual_time
async def test_the_time_a_pause_holds_a_turn_does_not_count_against_its_timeout() -> None:
    # RL's barrier may hold a worker mid-turn for as long as the snapshot takes: its turn
    # is not its worker's loss (simulation seed 8146).
    h = holder(turn_timeout_s=0.5)
    await h.open_session(Ep("r", 0))
    token = await begin(h, Ep("r", 0))
    await asyncio.sleep(0.3)
    report = await h.pause("snap-1", drain_timeout_s=0.2, lease_s=10)
    assert report.turns_in_flight == 1
    await asyncio.sleep(2.0)  # paused four times the turn's timeout
    await h.commit_snapshot("snap-1")
    await asyncio.sleep(0.1)  # 0.4 s of the turn's 0.5 s counted
    head = await h.commit_turn(Ep("r", 0), token, b"t0", b"s1")
    assert (head.turn_count, head.state) == (1, b"s1")
    token = await begin(h, Ep("r", 0))
    await asyncio.sleep(0.6)  # running again, the timeout still holds
    with pytest.raises(TurnInProgressError, match="aborted"):
        await h.commit_turn(Ep("r", 0), token, b"t1", b"s2")


@on_virtual_time
async def test_persist_writes_a_shard_and_capture_ignores_later_turns(tmp_path: Path) -> None:
    h = holder()
    ep = Ep("r", 0)
    await h.open_session(ep, b"s0")
    await h.pause("snap-1", 1, 10)
    await h.capture("snap-1")
    directory = prepare_environment_dir(tmp_path)
    await h.start_writes("snap-1", str(directory))
    report = await h.finish_writes("snap-1")
    await h.commit_snapshot("snap-1")
    await run_turn(h, ep, b"after", b"s1")
    (shard,) = report.shards
    assert [r.turns for r in read_shard(directory, shard)] == [()]
    with pytest.raises(SnapshotNotFoundError):
        read_manifest(tmp_path)  # shards alone are not a snapshot: the coordinator commits


# --- issue 11: the holder's half of the reviewed cases -----------------------------------


@on_virtual_time
async def test_a_turn_aborted_by_its_caller_before_its_begin_arrives_never_opens() -> None:
    # Case 4: the worker's turn() was cancelled while its begin_turn waited at the gate.
    h = holder()
    ep = Ep("r", 0)
    await h.open_session(ep)
    await h.pause("snap-1", 1, 10)
    waiting = asyncio.ensure_future(h.begin_turn(ep, "tok-gone"))
    await asyncio.sleep(0.05)
    await h.abort_turn(ep, "tok-gone")  # the client's abort, sent as it was cancelled
    await h.commit_snapshot("snap-1")
    with pytest.raises(TurnAbortedError, match="aborted by its caller before it began"):
        await asyncio.wait_for(waiting, 1)
    assert (await h.info()).turns_in_flight == 0
    report = await h.pause("snap-2", drain_timeout_s=5, lease_s=10)
    assert report.turns_in_flight == 0 and report.drain_seconds == 0  # nothing to drain
    await h.commit_snapshot("snap-2")
    await run_turn(h, ep, b"t0", b"s1")  # the session's turns go on
    assert (await h.close_session("r")).turns == (b"t0",)


@on_virtual_time
async def test_an_abort_that_overtakes_its_begin_leaves_the_holder_running() -> None:
    # Case 7: Ray does not order an async actor's calls; the late begin pauses nothing.
    h = holder()
    op = new_operation_id("snap", 0.0, "d0d0d0d0", 3)
    await h.abort(op)
    with pytest.raises(OperationAbortedError, match="was aborted"):
        await h.begin_snapshot(op, 1, 10, ".")
    with pytest.raises(OperationAbortedError):
        await h.prepare_restore(op, ".", [], 10)
    info = await h.info()
    assert info.state is HolderState.RUNNING and info.operation_id is None


@on_virtual_time
async def test_a_call_for_an_operation_its_driver_has_moved_past_is_refused() -> None:
    # Fencing that outlives the bounded history: a driver runs one operation at a time.
    h = holder()
    newer = new_operation_id("snap", 0.0, "d0d0d0d0", 9)
    await h.begin_snapshot(newer, 1, 10, ".")
    await h.abort(newer)
    for _ in range(70):  # more finished operations than the history keeps
        other = new_operation_id("snap", 0.0, "e1e1e1e1", _ + 1)
        await h.begin_snapshot(other, 1, 10, ".")
        await h.commit_snapshot(other)
    late = new_operation_id("snap", 0.0, "d0d0d0d0", 8)
    with pytest.raises(StaleSnapshotError, match="late: its driver has started a newer"):
        await h.begin_snapshot(late, 1, 10, ".")
    assert (await h.info()).state is HolderState.RUNNING
    assert h.bounds()["history"] <= 64


@on_virtual_time
async def test_staging_keys_must_be_strings_and_a_refused_commit_changes_nothing() -> None:
    # Case 8: a bare string, a non-string key, a mix: refused, session and capture intact.
    h = holder()
    ep = Ep("r", 0)
    await h.open_session(ep, b"s0")
    await run_turn(h, ep, b"t0", b"s1", ("r/0",))
    for bad, message in (("row-1", "not one str"), ([17], "non-empty strings"),
                         (["row-1", 2], "non-empty strings"), ([""], "non-empty strings")):
        token = await begin(h, ep)
        with pytest.raises(TypeError, match=message):
            await h.commit_turn(ep, token, b"t1", b"s2", bad)  # type: ignore[arg-type]
        session = await h.get_session("r")
        assert (session.turns, session.state, session.staging_keys) == (
            (b"t0",), b"s1", {"r/0"})
    await h.pause("snap-1", 1, 10)
    assert (await h.capture("snap-1")).captured() == [("r", 0, ["r/0"], 1)]


@on_virtual_time
async def test_retire_marks_are_monotone_until_forgotten() -> None:
    # Case 15: retiring attempt 1 refuses a zombie's attempt 0 too.
    h = holder()
    await h.open_session(Ep("r", 0))
    assert await h.retire([Ep("r", 1)]) == ["r"]  # the older live attempt goes too
    for attempt in (0, 1):
        with pytest.raises(RetiredAttemptError, match="every attempt up to 1 of 'r'"):
            await h.open_session(Ep("r", attempt))
    await h.open_session(Ep("r", 2))  # the next attempt is welcome
    assert await h.forget([Ep("r", 0)]) == []  # forgetting below the mark keeps it
    with pytest.raises(RetiredAttemptError):
        await h.open_session(Ep("r", 0))
    await h.forget([Ep("r", 1)])
    await h.close_session("r-a2")
    await h.open_session(Ep("r", 0))  # forgotten: the refusal is gone


@on_virtual_time
async def test_retire_marks_are_bounded() -> None:
    h = holder(max_retired_marks=3)
    await h.retire([Ep(f"r{k}", 0) for k in range(5)])
    assert h.bounds()["retire_marks"] == 3
    await h.open_session(Ep("r0", 0))  # the oldest marks went first
    with pytest.raises(RetiredAttemptError):
        await h.open_session(Ep("r4", 0))


@on_virtual_time
async def test_renewals_keep_a_restore_whose_read_outlasts_one_lease(tmp_path: Path) -> None:
    # Case 6: the lease is renewed while prepare_restore is still reading.
    src = holder()
    await src.open_session(Ep("r", 0), b"s")
    directory = prepare_environment_dir(tmp_path)
    await src.begin_snapshot("snap-1", 1, 10, str(directory))
    shards = list((await src.finish_writes("snap-1")).shards)
    dst = holder("node-b", watch_period_s=0.02, delays={"prepare_restore": 0.6})
    preparing = asyncio.ensure_future(dst.prepare_restore("restore-1", str(directory),
                                                          shards, 0.2))
    for _ in range(8):
        await asyncio.sleep(0.1)
        await dst.renew("restore-1", 0.2)
    prepared = await preparing
    assert prepared.continued() == [("r", 0)]
    assert await dst.commit_restore("restore-1") == 1


async def restored_elsewhere(tmp_path: Path) -> tuple[SessionHolder, str, list[ShardRef]]:
    """Rollout r captured on one holder and restored, committed, on another (node-b):
    that holder, the snapshot's folder and its shards."""
    src = holder()
    await src.open_session(Ep("r", 0), b"s")
    directory = prepare_environment_dir(tmp_path)
    await src.begin_snapshot("snap-1", 1, 10, str(directory))
    shards = list((await src.finish_writes("snap-1")).shards)
    dst = holder("node-b")
    await dst.prepare_restore("restore-1", str(directory), shards, 10)
    assert await dst.commit_restore("restore-1") == 1
    return dst, str(directory), shards


@on_virtual_time
async def test_an_abort_from_a_coordinator_that_never_committed_keeps_the_restore_live(
        tmp_path: Path) -> None:
    # A coordinator taken for dead while it prepared, whose successor committed the same
    # restore, aborts when it runs again: it must not undo the successor's commit.
    dst, directory, shards = await restored_elsewhere(tmp_path)
    await dst.abort("restore-1", keep_committed=True)
    assert [s.episode for s in await dst.sessions()] == [Ep("r", 1)]
    await dst.abort("restore-1")  # one that may follow a failed commit still undoes it
    assert await dst.sessions() == []


@on_virtual_time
async def test_an_abort_after_commit_restore_drops_what_went_live(tmp_path: Path) -> None:
    # Case 5: another holder failed its commit; this one went live and must drop it again.
    dst, directory, shards = await restored_elsewhere(tmp_path)
    await dst.abort("restore-1")
    assert await dst.sessions() == []
    # ...and the retry restores it.
    await dst.prepare_restore("restore-2", directory, shards, 10)
    assert await dst.commit_restore("restore-2") == 1
    assert [s.episode for s in await dst.sessions()] == [Ep("r", 1)]
    await run_turn(dst, Ep("r", 1), b"t", b"s2")
    await dst.abort("restore-2")  # in use: too late to undo, nothing is dropped
    assert [s.episode for s in await dst.sessions()] == [Ep("r", 1)]


@on_virtual_time
async def test_a_retried_restore_adopts_a_holder_whose_abort_has_not_arrived(
    tmp_path: Path,
) -> None:
    # Case 5 with a slow link: restore-1 went live here, failed elsewhere, and its abort
    # is still on its way when the retry's prepare arrives.
    src = holder()
    await src.open_session(Ep("r", 0), b"s")
    directory = prepare_environment_dir(tmp_path)
    await src.begin_snapshot("snap-1", 1, 10, str(directory))
    shards = list((await src.finish_writes("snap-1")).shards)
    dst = holder("node-b")
    await dst.prepare_restore("restore-1", str(directory), shards, 10)
    await dst.commit_restore("restore-1")
    await dst.prepare_restore("restore-2", directory, shards, 10)  # no conflict
    assert await dst.sessions() == []  # restore-1's sessions went first
    await dst.abort("restore-1")  # the late abort changes nothing now
    assert await dst.commit_restore("restore-2") == 1
    assert [s.episode for s in await dst.sessions()] == [Ep("r", 1)]


@on_virtual_time
async def test_many_sessions_open_in_one_call_all_or_none() -> None:
    h = holder()
    await h.open_session(Ep("taken", 0))
    batch = [(Ep(f"r{k}", 0), b"s") for k in range(3)]
    with pytest.raises(SessionExistsError, match="'taken' already has a live session"):
        await h.open_sessions([*batch, (Ep("taken", 1), b"")])
    assert [s.episode for s in await h.sessions()] == [Ep("taken", 0)]  # none opened
    with pytest.raises(SessionExistsError, match="listed twice"):
        await h.open_sessions([batch[0], batch[0]])
    assert await h.open_sessions(batch) == 3
    assert len(await h.sessions()) == 4
    await run_turn(h, Ep("r1", 0), b"t", b"s1")


@on_virtual_time
async def test_a_released_snapshot_lets_turns_run_while_its_shard_is_written(
    tmp_path: Path,
) -> None:
    # The backend resumes as the context exits; the capture is an immutable copy.
    h = holder(delays={"persist": 0.3})
    ep = Ep("r", 0)
    await h.open_session(ep, b"s0")
    directory = prepare_environment_dir(tmp_path)
    await h.begin_snapshot("snap-1", 1, 10, str(directory))
    await h.start_writes("snap-1")
    await h.release("snap-1")
    assert (await h.info()).state is HolderState.RUNNING
    await asyncio.wait_for(run_turn(h, ep, b"t0", b"s1"), 0.2)  # not after the write
    report = await h.finish_writes("snap-1")
    assert [r.turns for r in read_shard(directory, shard_entry(report.shards[0]))] == [()]
    await h.renew("snap-1", 10)
    await h.commit_snapshot("snap-1")
    assert h.bounds()["released"] == 0 and (await h.info()).last_snapshot_id == "snap-1"


@on_virtual_time
async def test_a_late_or_repeated_release_of_an_earlier_snapshot_leaves_the_next_one_paused(
    tmp_path: Path,
) -> None:
    # The driver and the coordinator both release, and either copy may come late.
    h = holder()
    await h.open_session(Ep("r", 0), b"s0")
    directory = str(prepare_environment_dir(tmp_path))
    await h.begin_snapshot("snap-1", 1, 10, directory)
    await h.release("snap-1")
    await h.release("snap-1")
    await h.finish_writes("snap-1")
    await h.commit_snapshot("snap-1")
    await h.begin_snapshot("snap-2", 1, 10, directory)
    await h.release("snap-1")
    assert h.current == (HolderState.PAUSED, "snap-2")
    await h.release("snap-2")
    assert h.current == (HolderState.RUNNING, None)


@on_virtual_time
async def test_a_released_snapshot_aborted_or_lapsed_leaves_no_shard(tmp_path: Path) -> None:
    h = holder(watch_period_s=0.02, delays={"persist": 0.2})
    await h.open_session(Ep("r", 0), b"s0")
    directory = prepare_environment_dir(tmp_path)
    for op, end in (("snap-1", "abort"), ("snap-2", "lapse")):
        await h.begin_snapshot(op, 1, lease_s=0.1 if end == "lapse" else 10,
                      directory=str(directory))
        await h.start_writes(op)
        await h.release(op)
        if end == "abort":
            await h.abort(op)
        await asyncio.sleep(0.4)
        assert list(directory.iterdir()) == [] and h.bounds()["released"] == 0
    with pytest.raises(LeaseExpiredError):
        await h.finish_writes("snap-2")


@on_virtual_time
async def test_a_late_abort_after_the_commit_leaves_the_snapshot_committed(
    tmp_path: Path,
) -> None:
    h = holder()
    await h.open_session(Ep("r", 0), b"s")
    await h.begin_snapshot("snap-1", 1, 10, str(prepare_environment_dir(tmp_path)))
    await h.finish_writes("snap-1")
    await h.commit_snapshot("snap-1")
    await h.abort("snap-1")  # overtaken by the resume: its outcome stands
    assert (await h.info()).last_snapshot_id == "snap-1"
    with pytest.raises(StaleSnapshotError, match="snap-1 already committed"):
        await h.finish_writes("snap-1")


# --- issue 39: turns by delta ----------------------------------------------------------------


def _records(n: int) -> list[bytes]:
    """Turn records of every size class msgpack's bin has (8, 16 and 32 bit lengths)."""
    sizes = (0, 3, 255, 256, 65_535, 65_536, 70_000)
    return [bytes([k % 251]) * sizes[k % len(sizes)] for k in range(n)]


@on_virtual_time
async def test_a_turn_carries_the_sessions_head_not_its_records_whatever_its_length() -> None:
    h = holder()
    ep = Ep("r", 0)
    await h.open_session(ep, b"s0")
    records = _records(300)
    sizes = {}
    for n, record in enumerate(records):
        token = f"tok-{n}"
        head = await h.begin_turn(ep, token)
        assert (head.turn_count, head.state) == (n, b"s0" if n == 0 else b"s")
        assert not hasattr(head, "turns")
        sizes[n] = len(pickle.dumps(head))
        # Turn 7 writes a key turn 3 wrote again.
        keys = (f"r/{n}",) + (("r/3",) if n == 7 else ())
        done = await h.commit_turn(ep, token, record, b"s", keys)
        assert done.turn_count == n + 1
    # What a turn receives does not grow with the session (its count takes a byte more).
    assert sizes[299] - sizes[2] <= 4, sizes
    assert await h.read_turns(ep) == records
    assert await h.read_turns(ep, -3) == records[-3:]
    assert await h.read_turns("r", 5, 7) == records[5:7]
    assert await h.read_turns(ep, 10, 5) == [] and await h.read_turns(ep, 400) == []
    session = await h.get_session(ep)
    assert session.turns == tuple(records)
    assert session.staging_keys == {f"r/{n}" for n in range(300)}
    # Appending joins pieces as a binary counter: a few objects, not one per record.
    assert len(h._parts.table.of_rollout("r").pieces) <= 16
    with pytest.raises(TypeError, match="int bounds"):
        await h.read_turns(ep, "0")  # type: ignore[arg-type]


@on_virtual_time
async def test_a_session_of_many_turns_is_snapshotted_restored_and_continued_whole(
        tmp_path: Path) -> None:
    src = holder()
    ep = Ep("r", 0)
    await src.open_session(ep, b"s0")
    records = _records(40)
    for n, record in enumerate(records):
        await run_turn(src, ep, record, f"s{n + 1}".encode(), (f"r/{n}",))
    await src.pause("snap-1", 1, 10)
    await src.capture("snap-1")
    directory = prepare_environment_dir(tmp_path)
    await src.start_writes("snap-1", str(directory))
    report = await src.finish_writes("snap-1")
    (stored,) = read_shard(directory, shard_entry(report.shards[0]))
    assert stored.turns == tuple(records) and stored.state == b"s40"

    dst = holder("node-b")
    await dst.prepare_restore("restore-1", str(directory), list(report.shards), 10)
    await dst.commit_restore("restore-1")
    head = await dst.begin_turn(Ep("r", 1), "tok-next")
    assert (head.turn_count, head.state) == (40, b"s40")
    await dst.commit_turn(Ep("r", 1), "tok-next", b"t40", b"s41", ["r/40"])
    session = await dst.get_session(Ep("r", 1))
    assert session.turns == (*records, b"t40")
    assert session.staging_keys == {f"r/{n}" for n in range(41)}
    assert session.earlier_capture_keys == ("r",)


@on_virtual_time
async def test_a_shard_whose_row_claims_other_turns_than_its_body_holds_is_refused(
        tmp_path: Path) -> None:
    # Its hash matches (a tool wrote it so): the row's count is a claim. Taken, a turn's
    # append would write its pieces behind a header of the wrong count, and the next
    # snapshot's shard would not decode past that session.
    from nemo_ckpt.errors import ShardCorruptedError
    from nemo_ckpt.session_record import encode_row, encode_turns
    from nemo_ckpt.storage.shards import write_shard_parts

    directory = prepare_environment_dir(tmp_path)
    row = encode_row("r", 0, ["r/0"], 3, [])
    entry = write_shard_parts(directory, "shard-s-holder-0-0000.msgpack", "holder-0",
                              b"\x91" + row, 1, [(encode_turns([b"t0", b"t1"]), b"s2")])
    dst = holder("node-b")
    with pytest.raises(ShardCorruptedError, match="says 3 turns, its body holds 2"):
        await dst.prepare_restore("restore-1", str(directory), [shard_ref(entry)], 10)
    assert await dst.sessions() == []
    assert (await dst.info()).state is HolderState.RUNNING
