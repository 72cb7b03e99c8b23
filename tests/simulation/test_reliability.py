"""The reviewed cases of issue 11, each replayed as one deterministic scenario: the real
driver, coordinator and holders in-process (``actors.sim``), under virtual
time, with a fault aimed at one phase boundary. Each asserts what a user would see: the
error raised, the holders' state, the files on disk, the sessions that are live.
(The same faults, at random points, run in ``tests/simulation/``; cases 1-6 also run
on a real cluster in ``tests/ray_cluster/test_faults.py``.)
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from actors.sim import SimActor
from nemo_ckpt import RayEnvironmentCheckpoint
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.errors import (
    BackendUnavailableError,
    CheckpointPathBusyError,
    CheckpointPathError,
    HolderBusyError,
    LeaseExpiredError,
    NemoCkptError,
    OperationAbortedError,
    ShardCorruptedError,
    SnapshotMismatchError,
    StaleSnapshotError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.sessions import Turn
from nemo_ckpt.storage.checkpoint_folder import environment_dir, environment_folder
from nemo_ckpt.storage.claims import STALE_FACTOR, ClaimWatch
from nemo_ckpt.storage.path_claims import claim_path
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot
from nemo_ckpt.transport import COORDINATOR, HOLDER
from tests.harness import CONFIG, World, cut_of, files, snapshotted_by_a_first_job

pytestmark = pytest.mark.timeout(60)

# --- case 1: a committed snapshot is never deleted ---------------------------------------


def test_a_driver_cancelled_during_its_commit_leaves_the_snapshot_committed(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)
        first = read_manifest(path).snapshot_id
        task = asyncio.current_task()
        assert task is not None
        world.on_send("commit_snapshot", lambda: world.sim.loop.call_later(0.0005, task.cancel))
        with pytest.raises(asyncio.CancelledError):
            await world.snapshot(path, live)
        # The cancellation came after the commit: the new snapshot is whole, the older
        # one's shards went (replaced), and the holders run.
        loaded = read_snapshot(path)
        assert loaded.manifest.snapshot_id != first
        assert sum(len(v) for v in loaded.sessions.values()) == 6
        assert set(world.states().values()) == {HolderState.RUNNING}
        assert len(files(path)) == 3 + 1  # three shards and the manifest

    world.run(scenario())


def test_a_coordinator_dying_right_after_the_manifest_rename_commits_the_snapshot(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)
        world.sim.after_io = lambda actor, name: (
            world.sim.kill(actor) if actor.kind == COORDINATOR and name == "write_manifest"
            else None)
        await world.snapshot(path, live)  # the abort's answer: committed, so no error
        world.sim.after_io = None
        loaded = read_snapshot(path)
        assert sum(len(v) for v in loaded.sessions.values()) == 6
        assert set(world.states().values()) == {HolderState.RUNNING}  # not by the lease
        await world.snapshot(path, live)  # and the next one works at once

    world.run(scenario())


def test_an_abort_from_a_fresh_coordinator_never_removes_a_committed_snapshot(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)
        committed = read_manifest(path).snapshot_id
        before = files(path)
        coordinator = world.sim.live(COORDINATOR)[0]
        world.sim.kill(coordinator)
        transport = world.sim.transport(world.driver, CONFIG)
        answer = await transport.call(transport.coordinator(), "abort", committed, str(path))
        assert answer == "committed" and files(path) == before
        read_snapshot(path)

    world.run(scenario())


# --- case 2: one holder lost leaves no other holder paused ---------------------------------


def test_a_holder_lost_during_the_pause_leaves_the_others_running_and_a_retry_works(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        world.on_deliver("begin_snapshot", lambda holder: world.sim.kill(holder), kind=HOLDER)
        with pytest.raises(BackendUnavailableError) as failed:
            await world.snapshot(path, live)
        assert world.ckpt.is_unavailable(failed.value)
        # Before the error reached the driver, every other holder was resumed.
        assert set(world.states().values()) == {HolderState.RUNNING}
        assert len(world.holders()) == 2
        # The retry it asks for works at once (the lost holder is recreated, empty).
        survivors = {i: eps for i, eps in live.items() if i in world.holders()}
        await world.snapshot(path, survivors)
        assert len(world.holders()) == 3

    world.run(scenario())


def test_a_failure_on_several_holders_carries_every_holders_error(world: World) -> None:
    async def scenario() -> None:
        live = await world.populate()
        killed: list[str] = []

        def kill_two(target: SimActor, m: str, args: tuple[Any, ...]) -> None:
            if m == "begin_snapshot" and target.kind == HOLDER and len(killed) < 2:
                killed.append(target.name)
                world.sim.kill(target)

        world.sim.on_deliver = kill_two
        with pytest.raises(BackendUnavailableError, match="begin_snapshot failed on 2 holders"
                           ) as failed:
            await world.snapshot(world.path("ckpt"), live)
        assert sorted(failed.value.failures) == sorted(killed)
        assert all(isinstance(e, BackendUnavailableError)
                   for e in failed.value.failures.values())

    world.run(scenario())


# --- case 3: a driver cancelled during begin or prepare aborts ------------------------------


@pytest.mark.parametrize("when", ["begin_snapshot", "renew"])
def test_a_driver_cancelled_during_begin_resumes_every_holder(world: World, when: str) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        for delays in world.holder_delays().values():
            delays.set("pause", 3.0)  # a long drain: renewals come meanwhile
        task = asyncio.current_task()
        assert task is not None
        world.on_send(when, lambda: world.sim.loop.call_later(0.002, task.cancel))
        with pytest.raises(asyncio.CancelledError):
            await world.snapshot(path, live)
        assert set(world.states().values()) == {HolderState.RUNNING}
        for delays in world.holder_delays().values():
            delays.set("pause", 0)
        await world.snapshot(path, live)  # the same driver's next snapshot works

    world.run(scenario())


# --- case 4: a worker cancelled at a closed gate leaves no turn open -----------------------


def test_a_turn_cancelled_while_waiting_at_the_gate_leaves_nothing_behind(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        ep = live["holder-0"][0]
        client = await world.client("holder-0")
        entered: list[Turn] = []

        async def worker() -> None:
            async with client.turn(ep) as turn:
                entered.append(turn)
                turn.complete(b"never", b"x", [])

        async def block() -> None:
            waiting = world.sim.spawn(world.worker, worker())
            await asyncio.sleep(0.5)  # it waits at the closed gate
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

        await world.snapshot(path, live, block)
        await asyncio.sleep(0.1)
        holder = world.holders()["holder-0"]
        assert (await holder.info()).turns_in_flight == 0 and not entered
        async with world.ckpt.snapshot(world.path("next")) as snap:  # no drain wait
            assert snap is not None and snap.restarted_rollouts == 0
            assert snap.metrics(0.0)["drain_seconds"] < 0.1
            await snap.check_against_cut(cut_of(live))
        async with client.turn(ep) as turn:  # the session's turns go on
            turn.complete(b"t2", b"s3", [])
        assert [r.turns for r in await client.sessions() if r.episode == ep] == [
            (b"t0", b"t1", b"t2")]

    world.run(scenario())


# --- case 5: a restore is all or nothing -----------------------------------------------------


def test_a_snapshot_begun_as_its_coordinator_dies_reaches_the_successor_ray_names_later(
        world: World) -> None:
    """Ray tells a dead coordinator's callers of its death only after a while, and
    releases its name later still. A snapshot begun at the death spent its wait for the
    successor waiting for that notice, and gave up before the name was released
    (simulation seed 30646): the wait counts from the notice."""
    path = world.path("ckpt")
    window = CONFIG.lease_s + CONFIG.phase_timeout_s  # the driver's wait for a new name

    async def scenario() -> None:
        live = await world.populate()
        world.sim.death_delay = lambda actor: (window * 0.8, window * 0.5)
        dead = world.sim.live(COORDINATOR)[0]
        world.sim.kill(dead)
        await world.snapshot(path, live)
        loaded = read_snapshot(path)
        assert sum(len(v) for v in loaded.sessions.values()) == 6
        assert world.sim.live(COORDINATOR) and dead not in world.sim.live(COORDINATOR)

    world.run(scenario())


def test_a_holder_dying_during_commit_restore_leaves_nothing_live_and_the_retry_works(
        tmp_path: Path) -> None:
    path, live = snapshotted_by_a_first_job(tmp_path)
    world = World(tmp_path)  # a fresh job restores
    try:
        async def scenario() -> None:
            await world.ckpt.ensure_holders()
            arrivals: list[str] = []

            def kill_second(target: SimActor, m: str, args: tuple[Any, ...]) -> None:
                if m == "commit_restore" and target.kind == HOLDER:
                    arrivals.append(target.name)
                    if len(arrivals) == 2:
                        world.sim.kill(target)  # one holder committed already

            world.sim.on_deliver = kill_second
            with pytest.raises(BackendUnavailableError):
                async with world.ckpt.restored(path):
                    pass
            sessions = [await h.sessions() for h in world.holders().values()]
            assert sessions == [[]] * len(sessions)
            world.sim.on_deliver = None
            async with world.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 6
            restored_eps = {s.episode for h in world.holders().values()
                            for s in await h.sessions()}
            assert restored_eps == {ep.next_attempt() for eps in live.values() for ep in eps}

        world.run(scenario())
    finally:
        world.close()


def test_a_restore_whose_commit_answer_is_lost_but_won_returns_with_its_sessions_live(
        tmp_path: Path) -> None:
    """Issue 34 (found by the simulation's lost answers, seed 7 at 2d6310c): the driver
    raised "unavailable, retry" for a restore its coordinator had committed."""
    path, live = snapshotted_by_a_first_job(tmp_path)
    world = World(tmp_path)
    try:
        async def scenario() -> None:
            await world.ckpt.ensure_holders()
            world.sim.lose_reply = lambda target, method: (
                target.kind == COORDINATOR and method == "commit_restore")
            async with world.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 6
            world.sim.lose_reply = lambda target, method: False
            restored_eps = {s.episode for h in world.holders().values()
                            for s in await h.sessions()}
            assert restored_eps == {ep.next_attempt() for eps in live.values() for ep in eps}

        world.run(scenario())
    finally:
        world.close()


def _lose_first_answer(world: World, method: str) -> list[str]:
    """Lose the coordinator's answer to the first ``method`` call after it ran."""
    lost: list[str] = []

    def lose_once(target: Any, m: str) -> bool:
        if target.kind == COORDINATOR and m == method and not lost:
            lost.append(m)
            return True
        return False

    world.sim.lose_reply = lose_once
    return lost


@pytest.mark.parametrize("first_call", ["begin_snapshot", "prepare_restore"])
def test_a_first_call_whose_answer_is_lost_is_answered_again_not_refused_as_in_progress(
        tmp_path: Path, first_call: str) -> None:
    """The coordinator ran the operation's first call, its answer was lost, and the
    driver sent it again (simulation seed 202): the repeat answers as the first one did,
    instead of "already in progress", so the snapshot commits and the restore goes live."""
    path = tmp_path / "ckpt"
    first = World(tmp_path)
    try:
        lost = _lose_first_answer(first, first_call)
        live = first.run(first.populate())
        first.run(first.snapshot(path, live))
        assert (environment_dir(path) / "manifest.json").exists()
    finally:
        first.close()
    world = World(tmp_path)
    try:
        if first_call == "prepare_restore":
            lost = _lose_first_answer(world, first_call)

        async def scenario() -> None:
            async with world.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 6

        world.run(scenario())
        assert lost == [first_call]
    finally:
        world.close()


# --- case 6: leases are renewed through long phases ------------------------------------------


def test_a_restore_whose_read_outlasts_the_lease_succeeds(tmp_path: Path) -> None:
    path, live = snapshotted_by_a_first_job(tmp_path)
    world = World(tmp_path)
    try:
        world.sim.io_cost = lambda name: CONFIG.lease_s * 2 if name == "load_shard" else 0.001

        async def scenario() -> None:
            async with world.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 6
            assert world.sim.loop.time() > CONFIG.lease_s * 2  # the read took two leases

        world.run(scenario())
    finally:
        world.close()


# --- case 7: a late first call after its abort pauses nothing -------------------------------


def test_a_begin_that_arrives_after_its_abort_pauses_nothing(world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        slow = world.holders()["holder-1"]

        def delay(target: SimActor, method: str, reply: bool) -> float:
            # The begin to holder-1 is stuck on a slow link, past the call's deadline.
            return 10.0 if (target.obj is slow and method == "begin_snapshot"
                            and not reply) else 0.001

        world.sim.message_delay = delay
        with pytest.raises(BackendUnavailableError, match="holder-1 did not finish begin"):
            await world.snapshot(path, live)
        assert set(world.states().values()) == {HolderState.RUNNING}
        await asyncio.sleep(10)  # the late begin arrives: refused, nothing pauses
        assert world.states()["holder-1"] is HolderState.RUNNING
        world.sim.message_delay = lambda target, method, reply: 0.001
        await world.snapshot(path, live)

    world.run(scenario())


def test_a_turn_right_after_a_failed_one_waits_for_its_abort_and_runs(world: World) -> None:
    """An async actor may run calls out of order: the next turn of the session must
    not overtake the abort of the one that failed."""

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        client = await world.client("holder-0")
        ep = Ep("r", 0)
        await client.open(ep, b"s0")

        def delay(target: SimActor, method: str, reply: bool) -> float:
            return 0.5 if (method == "abort_turn" and not reply) else 0.001

        world.sim.message_delay = delay
        with pytest.raises(RuntimeError, match="tool failed"):
            async with client.turn(ep):
                raise RuntimeError("tool failed")
        async with client.turn(ep) as turn:
            turn.complete(b"t0", b"s1", ["r-a0/row0"])
        record = await client.get(ep)
        assert (record.turns, record.state) == ((b"t0",), b"s1")

    world.run(scenario())


# --- case 10: a refused snapshot never commits ------------------------------------------------


def test_a_mismatch_caught_inside_the_block_still_refuses_the_commit(world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        with pytest.raises(SnapshotMismatchError, match="unexpected_episode"):
            async with world.ckpt.snapshot(path) as snap:
                assert snap is not None
                wrong = {i: eps for i, eps in live.items() if i != "holder-0"}
                try:
                    await snap.check_against_cut(cut_of(wrong))
                except SnapshotMismatchError:
                    pass  # caught, and the block goes on
        assert not (environment_dir(path) / "manifest.json").exists()
        assert files(path) == []
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())


# --- case 11: two jobs in one path ------------------------------------------------------------


def test_a_second_job_snapshotting_into_a_path_in_use_is_refused_not_cleaned(
        world: World) -> None:
    path = world.path("shared")
    other_config = CheckpointConfig(**{**CONFIG.model_dump(), "namespace": "other-job"})
    other_driver = world.sim.new_actor("driver", "other-driver", "node-0")
    other = world.checkpoint(other_driver, other_config)

    async def scenario() -> None:
        live = await world.populate()
        await other.ensure_holders()

        async def second_job() -> None:
            with pytest.raises(CheckpointPathBusyError, match="two jobs must not"):
                async with other.snapshot(path):
                    pass

        async def block() -> None:  # while the first job's snapshot is in progress
            await world.sim.spawn(other_driver, second_job())

        await world.snapshot(path, live, block)
        loaded = read_snapshot(path)
        assert sum(len(v) for v in loaded.sessions.values()) == 6
        # Once it is over, the other job may replace it (a newer manifest there).
        await world.sim.spawn(other_driver, _snapshot_plain(other, path))
        assert read_manifest(path).snapshot_id != loaded.manifest.snapshot_id
        read_snapshot(path)

    world.run(scenario())


def test_a_claim_write_failing_for_seconds_inside_the_block_still_commits(
        world: World) -> None:
    """The shared disk full for a few seconds while RL saves: the claim's renewals fail,
    but the holders' leases are renewed on time, and the commit writes the claim again."""
    path = world.path("ckpt")
    full_until: list[float] = []

    def disk_full(name: str, args: tuple[Any, ...]) -> str | None:
        if name == "claim_path" and full_until and world.sim.loop.time() < full_until[0]:
            return "fail"
        return None

    world.sim.io_faults = disk_full

    async def scenario() -> None:
        live = await world.populate()

        async def block() -> None:  # longer than a lease, the claim unwritable for most
            full_until.append(world.sim.loop.time() + CONFIG.lease_s * 1.5)
            await asyncio.sleep(CONFIG.lease_s * 2)

        await world.snapshot(path, live, block)
        loaded = read_snapshot(path)
        assert sum(len(v) for v in loaded.sessions.values()) == 6
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())


def test_a_commit_refuses_a_path_another_job_claimed_while_its_claim_could_not_be_renewed(
        world: World) -> None:
    path = world.path("ckpt")
    failing: list[bool] = []
    world.sim.io_faults = lambda name, args: "fail" if name == "claim_path" and failing \
        else None

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)
        first = read_manifest(path).snapshot_id

        async def block() -> None:
            failing.append(True)  # our renewals fail from here on, past the claim's ttl
            await asyncio.sleep(CONFIG.lease_s * 2 * 1.1)
            failing.clear()
            # Another job, having watched our claim unchanged for its ttl, took the path.
            watched = [0.0]
            watch = ClaimWatch(clock=lambda: watched[0])
            with pytest.raises(CheckpointPathBusyError):  # seen for the first time: live
                claim_path(environment_folder(path), "snapshot-other-1", "other-job", watch,
                           CONFIG.lease_s * 2)
            watched[0] += CONFIG.lease_s * 2 * 2
            claim_path(environment_folder(path), "snapshot-other-1", "other-job", watch,
                       CONFIG.lease_s * 2)

        with pytest.raises(CheckpointPathBusyError, match="two jobs must not"):
            await world.snapshot(path, live, block)
        assert read_manifest(path).snapshot_id == first  # the previous snapshot stands
        assert set(world.states().values()) == {HolderState.RUNNING}


@pytest.mark.parametrize("offset", [-86_400.0, 86_400.0], ids=["behind", "ahead"])
def test_a_second_job_whose_clock_is_skewed_takes_over_a_path_only_from_a_job_that_died(
        world: World, offset: float) -> None:
    # Issue 23, case 1: the other job's clock, a day behind or ahead, decides nothing;
    # only a claim it has watched unchanged for the claim's ttl, on its own clock, goes.
    path = world.path("shared")
    other_config = CheckpointConfig(**{**CONFIG.model_dump(), "namespace": "other-job"})
    other_driver = world.sim.new_actor("driver", "other-driver", "node-0")
    other = world.checkpoint(other_driver, other_config)
    ttl = 2 * CONFIG.lease_s

    async def scenario() -> None:
        live = await world.populate()
        await other.ensure_holders()
        coordinators = {a.obj._owner.split("@")[0]: a for a in world.sim.live(COORDINATOR)}
        coordinators["other-job"].clock_offset = offset

        async def second_job() -> None:
            await world.sim.spawn(other_driver, _snapshot_plain(other, path))

        async def block() -> None:
            for _ in range(3):  # renewed while it runs: refused, however long watched
                with pytest.raises(CheckpointPathBusyError, match="two jobs must not"):
                    await second_job()
                await asyncio.sleep(ttl)
            # The first job's coordinator dies mid-snapshot: its claim stays, unrenewed.
            world.sim.kill(coordinators["job"])
            with pytest.raises(CheckpointPathBusyError, match="two jobs must not"):
                await second_job()
            await asyncio.sleep(ttl * STALE_FACTOR - 2)
            with pytest.raises(CheckpointPathBusyError, match="two jobs must not"):
                await second_job()
            await asyncio.sleep(3)
            await second_job()

        with pytest.raises(NemoCkptError):  # the first job's snapshot lost its coordinator
            await world.snapshot(path, live, block)
        loaded = read_snapshot(path)  # the other job's: its holders hold no session
        assert loaded.manifest.instances and not any(loaded.sessions.values())

    world.run(scenario())


def test_a_snapshot_or_restore_given_a_collapsed_or_malformed_url_is_refused_at_once(
        world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    sent: list[str] = []
    world.sim.on_send = lambda caller, callee, m, args: sent.append(m)

    async def scenario() -> None:
        live = await world.populate()
        sent.clear()
        for bad, needle in ((Path("s3://nemo/demo"), "pathlib.Path collapsed"),
                            ("s3://nemo/a/../b", "'..' segment")):
            with pytest.raises(CheckpointPathError, match=needle):
                async with world.ckpt.snapshot(bad):  # type: ignore[arg-type]
                    pass
            with pytest.raises(CheckpointPathError, match=needle):
                async with world.ckpt.restored(bad):  # type: ignore[arg-type]
                    pass
        assert sent == []  # nothing reached the coordinator or a holder
        assert set(world.states().values()) == {HolderState.RUNNING}
        # The driver is free for the next operation.
        await world.snapshot(world.path("ckpt"), live)
        assert read_manifest(world.path("ckpt")).snapshot_id

    world.run(scenario())
    assert not (tmp_path / "s3:").exists()


def test_a_snapshot_that_captured_later_is_not_replaced_by_an_older_one_still_writing(
        world: World) -> None:
    """Holders resume as a commit begins, so a second driver of the job can snapshot
    into the same path while the first snapshot's shards are still being written; the
    newer snapshot's manifest must be the one left there."""
    path = world.path("ckpt")
    second_driver = world.sim.new_actor("driver", "second-driver", "node-0")
    second = world.checkpoint(second_driver, CONFIG)
    slow_writes = [3]  # the first snapshot's three shard writes take long

    def io_cost(name: str) -> float:
        if name == "write_held_shard" and slow_writes[0] > 0:
            slow_writes[0] -= 1
            return 5.0
        return 0.002

    async def scenario() -> None:
        live = await world.populate()
        world.sim.io_cost = io_cost
        ids: dict[str, str] = {}

        async def snapshot(ckpt: RayEnvironmentCheckpoint, name: str) -> None:
            async with ckpt.snapshot(path) as snap:
                assert snap is not None
                ids[name] = snap.snapshot_id
                await snap.check_against_cut(cut_of(live))

        first = world.sim.spawn(world.driver, snapshot(world.ckpt, "first"))
        while slow_writes[0] > 0:  # until the first commit released the holders
            await asyncio.sleep(0.05)
        await world.sim.spawn(second_driver, snapshot(second, "second"))
        await first
        loaded = read_snapshot(path)
        assert loaded.manifest.snapshot_id == ids["second"]
        assert sum(len(v) for v in loaded.sessions.values()) == 6
        assert len(files(path)) == 3 + 1  # the older snapshot's shards went
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())


async def _snapshot_plain(ckpt: RayEnvironmentCheckpoint, path: Path) -> None:
    async with ckpt.snapshot(path):
        pass


# --- case 13: a restore checks what the shards hold against the manifest ----------------------


def test_a_restore_refuses_a_shard_holding_a_rollout_twice(tmp_path: Path) -> None:
    path, live = snapshotted_by_a_first_job(tmp_path)
    # Craft holder-0's shard: rollout r0 at attempts 0 and 3, hash fixed in the manifest.
    loaded = read_snapshot(path)
    records = loaded.sessions["holder-0"]
    twin = records[0].__class__(records[0].instance_id, Ep(records[0].episode.rollout_id, 3),
                                records[0].turns, records[0].state)
    shard = next(s for s in loaded.manifest.shards if s.instance_id == "holder-0")
    entry = write_shard(environment_dir(path), shard.file, "holder-0", [records[0], twin])
    manifest_file = environment_dir(path) / "manifest.json"
    data = json.loads(manifest_file.read_text())
    for listed in data["shards"]:
        if listed["file"] == shard.file:  # its length, hash and chunk hashes
            listed.update(entry.model_dump(include={"bytes", "content_hash", "chunks"}))
    manifest_file.write_text(json.dumps(data))
    world = World(tmp_path)
    try:
        async def scenario() -> None:
            with pytest.raises(ShardCorruptedError, match="holds rollout 'holder-0-r0' twice"):
                async with world.ckpt.restored(path):
                    pass
            sessions = [await h.sessions() for h in world.holders().values()]
            assert sessions == [[]] * len(sessions)
            assert set(world.states().values()) == {HolderState.RUNNING}

        world.run(scenario())
    finally:
        world.close()


# --- case 14: memory is bounded ----------------------------------------------------------------


def test_an_abandoned_operation_is_reaped_and_histories_stay_bounded(world: World) -> None:
    async def scenario() -> None:
        live = await world.populate()
        transport = world.sim.transport(world.driver, CONFIG)
        coordinator = transport.coordinator()
        coord = coordinator.ref.obj
        # A driver that begins a snapshot and vanishes: never renews, never commits.
        await transport.call(coordinator, "begin_snapshot",
                             "snap-20261201T000000-0badf00d-000001", str(world.path("x")))
        assert coord.operations and set(world.states().values()) == {HolderState.PAUSED}
        await asyncio.sleep(CONFIG.lease_s + 2)
        assert not coord.operations and set(world.states().values()) == {HolderState.RUNNING}
        with pytest.raises(LeaseExpiredError, match="lease of snap-20261201T000000-0badf00d"):
            await transport.call(coordinator, "commit_snapshot",
                                 "snap-20261201T000000-0badf00d-000001",
                                 str(world.path("x")), {}, 0)
        for _ in range(80):
            await world.snapshot(world.path("y"), live)
        bounds = coord.operations.bounds()
        assert bounds["history"] <= 64 and bounds["results"] <= 64 and bounds["open"] == 0
        assert coord.folders.locks_held == 0
        for holder in world.holders().values():
            assert holder.bounds()["history"] <= 64

    world.run(scenario())


# --- the coordinator answers late and repeated calls with the outcome -----------------------


def test_late_and_repeated_calls_get_the_outcome_or_a_refusal(world: World) -> None:
    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(world.path("a"), live)
        transport = world.sim.transport(world.driver, CONFIG)
        coordinator = transport.coordinator()
        committed = read_manifest(world.path("a")).snapshot_id
        again = await transport.call(coordinator, "commit_snapshot", committed,
                                     str(world.path("a")), {}, 0)
        assert again.rollouts == 6  # the first commit's answer
        with pytest.raises(StaleSnapshotError, match="already committed"):
            await transport.call(coordinator, "begin_snapshot", committed,
                                 str(world.path("a")))
        aborted = "snap-20261201T000000-0badf00d-000009"
        assert await transport.call(coordinator, "abort", aborted, None) == "aborted"
        with pytest.raises(OperationAbortedError):
            await transport.call(coordinator, "begin_snapshot", aborted, str(world.path("b")))
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())


# --- case 16: retriability has one source ------------------------------------------------------


def test_retriability_is_a_property_of_each_error_class_and_the_docs_list_it() -> None:
    from nemo_ckpt import errors

    ckpt = RayEnvironmentCheckpoint(CONFIG)
    assert ckpt.is_unavailable(LeaseExpiredError("lapsed"))
    assert ckpt.is_unavailable(HolderBusyError("busy"))
    assert not ckpt.is_unavailable(SnapshotMismatchError(()))
    table = (Path(__file__).resolve().parents[2] / "docs" / "FAILURES.md").read_text()
    documented: dict[str, bool] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[2] in ("yes", "no"):
            for name in re.findall(r"`(\w+Error)`", cells[0]):
                documented[name] = cells[2] == "yes"
    classes = {name: cls for name, cls in vars(errors).items()
               if isinstance(cls, type) and issubclass(cls, NemoCkptError)
               and cls is not NemoCkptError}
    assert documented == {name: cls.retriable for name, cls in classes.items()
                          if name in documented}
    undocumented = sorted(set(classes) - set(documented) - {"SnapshotReadError",
                                                             "SessionError"})
    assert undocumented == [], f"docs/FAILURES.md lacks {undocumented}"


# --- case 8 (the client's half) and case 9 --------------------------------------------------


def test_a_turn_refuses_staging_keys_that_are_not_strings_at_once() -> None:
    from nemo_ckpt.session_record import SessionHead

    async def never(start: int, stop: int | None) -> list[bytes]:
        raise AssertionError("complete() reads no turn records")

    turn = Turn(SessionHead("holder-0", Ep("r", 0), 0, b""), never)
    with pytest.raises(TypeError, match=r"not one str \('row-1'\); pass \[key\]"):
        turn.complete(b"t", b"s", "row-1")
    with pytest.raises(TypeError, match="non-empty strings"):
        turn.complete(b"t", b"s", [17])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="state of r must be bytes"):
        turn.complete(b"t", "s", [])  # type: ignore[arg-type]
    turn.complete(b"t", b"s", ("row-1",))


@pytest.mark.parametrize("field", ["lease_s", "phase_timeout_s", "persist_timeout_s",
                                   "turn_timeout_s", "drain_timeout_s",
                                   "lease_renew_interval_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_deadlines_that_are_not_finite_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**{field: value})


def test_a_lease_that_a_long_drain_and_one_renewal_period_would_outlast_is_refused() -> None:
    with pytest.raises(ValueError, match=r"drain_timeout_s \(5.0\) \+ the lease renewal "
                                         r"period \(4\) \+ a margin of 10% of lease_s must "
                                         r"be shorter than lease_s \(10.0\)"):
        CheckpointConfig(drain_timeout_s=5.0, lease_s=10.0, lease_renew_interval_s=4.0)
    CheckpointConfig(drain_timeout_s=5.0, lease_s=10.0, lease_renew_interval_s=3.0)
    CheckpointConfig()  # the defaults work


def _slow_holder_start(world: World) -> None:
    """A holder's process takes a second to start: its first answer (``info``) does."""
    world.sim.message_delay = lambda target, method, reply: (
        1.0 if method == "info" and not reply else 0.001)


def test_a_job_on_many_nodes_starts_its_holders_at_once_not_in_turn(tmp_path: Path) -> None:
    world = World(tmp_path, nodes=6)
    try:
        _slow_holder_start(world)
        started = world.sim.loop.time()
        infos = world.run(world.ckpt.ensure_holders())
        assert sorted((i.instance_id, i.node_id) for i in infos) == [
            (f"holder-{k}", f"node-{k}") for k in range(6)]
        assert world.sim.loop.time() - started < 2.0  # one holder's start, not six
    finally:
        world.close()


def test_a_restore_into_a_fresh_job_starts_its_holders_at_once(tmp_path: Path) -> None:
    path, live = snapshotted_by_a_first_job(tmp_path, nodes=4)
    world = World(tmp_path, nodes=4)  # restores with no holder started
    try:
        _slow_holder_start(world)
        started = world.sim.loop.time()

        async def restore() -> list[tuple[str, str, int]]:
            async with world.ckpt.restored(path) as restored:
                return sorted(restored.continued_attempts)

        assert world.run(restore()) == sorted(
            (instance, ep.rollout_id, ep.attempt) for instance, eps in live.items()
            for ep in eps)
        assert sorted(world.holders()) == [f"holder-{k}" for k in range(4)]
        assert world.sim.loop.time() - started < 2.0  # one holder's start, not four
    finally:
        world.close()
