"""Faults and bad input on a real local multi-node cluster.

For every case: a clear error of its own class (or success where survivable), no holder
left paused or restoring, the previously committed snapshot still restorable and
unchanged, and no acknowledged turn lost from the live sessions that survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient, SessionRecord
from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.errors import (
    BackendUnavailableError,
    CheckpointPathError,
    ManifestInvalidError,
    ShardCorruptedError,
    SnapshotNotFoundError,
    SnapshotReadError,
    SnapshotWriteError,
    StateTooLargeError,
    TornSnapshotError,
    UnsafeShardNameError,
    UnsupportedFormatVersionError,
)
from nemo_ckpt.phases import HolderState
from nemo_ckpt.sessions import Turn
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from nemo_ckpt.storage.snapshot_files import (
    LoadedSnapshot,
    read_manifest,
    read_snapshot,
    snapshot_rollouts,
)
from nemo_ckpt.testing import StaticCut
from tests.conftest import alive_node_ids, kill_a_driver_inside, remove_node_and_wait

pytestmark = pytest.mark.timeout(120)

INSTANCES = ("holder-0", "holder-1", "holder-2")


# --- helpers ---------------------------------------------------------------------------


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 15.0,
                     what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


def holder(ckpt: RayEnvironmentCheckpoint, instance: str) -> Any:
    return ray.get_actor(HOLDER_NAME_PREFIX + instance, namespace=ckpt.config.namespace)


async def client(ckpt: RayEnvironmentCheckpoint, instance: str) -> SessionClient:
    return await SessionClient.connect(instance, namespace=ckpt.config.namespace)


async def populate(ckpt: RayEnvironmentCheckpoint, instances: tuple[str, ...] = INSTANCES,
                   state: bytes = b"s") -> dict[str, list[Ep]]:
    """Two rollouts per instance, two committed turns each."""
    live: dict[str, list[Ep]] = {}
    for inst in instances:
        c = await client(ckpt, inst)
        live[inst] = [Ep(f"{inst}-r{k}", 0) for k in range(2)]
        for ep in live[inst]:
            await c.open(ep, state)
            for t in range(2):
                async with c.turn(ep) as turn:
                    turn.complete(f"t{t}".encode(), state, [f"{ep.capture_key}/row{t}"])
    return live


def cut_of(live: dict[str, list[Ep]]) -> StaticCut:
    rows = {f"{ep.capture_key}/row{t}" for eps in live.values() for ep in eps for t in range(2)}
    return StaticCut({i: set(eps) for i, eps in live.items()}, rows)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


async def sessions_of(ckpt: RayEnvironmentCheckpoint, instances: Any
                      ) -> dict[str, list[SessionRecord]]:
    return {i: await (await client(ckpt, i)).sessions() for i in instances}


async def all_running(ckpt: RayEnvironmentCheckpoint) -> bool:
    return all(h.state is HolderState.RUNNING for h in await ckpt.holders())


async def assert_recovered(ckpt: RayEnvironmentCheckpoint, path: Path, baseline: dict[str, bytes],
                           survivors: dict[str, list[SessionRecord]]) -> None:
    """No holder paused; the committed snapshot unchanged; survivors kept every turn."""
    await wait_until(lambda: all_running(ckpt), 15, "every holder running")
    env = environment_dir(path)
    try:
        await wait_until(lambda: _async(tree(env) == baseline), 15, "partial files removed")
    except AssertionError:
        raise AssertionError(
            f"files now {sorted(tree(env))}, committed {sorted(baseline)}") from None
    read_snapshot(path)  # still restorable
    assert await sessions_of(ckpt, survivors) == survivors
    for inst, records in survivors.items():  # and they keep running turns
        if not records:
            continue
        c = await client(ckpt, inst)
        ep = records[0].episode
        async with c.turn(ep) as turn:
            turn.complete(b"after", b"s", [])


async def commit_baseline(ckpt: RayEnvironmentCheckpoint, path: Path) -> dict[str, bytes]:
    """Commit a snapshot at ``path`` and return its files, to compare after a fault."""
    async with ckpt.snapshot(path):
        pass
    return tree(environment_dir(path))


async def _async(value: bool) -> bool:
    return value


async def snapshot_in_background(ckpt: RayEnvironmentCheckpoint, path: Path
                                 ) -> asyncio.Future[None]:
    async def run() -> None:
        async with ckpt.snapshot(path):
            pass
    return asyncio.ensure_future(run())


def restore_in_background(ckpt: RayEnvironmentCheckpoint, path: Path) -> asyncio.Future[None]:
    async def run() -> None:
        async with ckpt.restored(path):
            pass
    return asyncio.ensure_future(run())


def coordinator(ckpt: RayEnvironmentCheckpoint) -> Any:
    return ray.get_actor(ckpt.config.coordinator_name, namespace=ckpt.config.namespace)


async def states(ckpt: RayEnvironmentCheckpoint) -> dict[str, HolderState]:
    return {h.instance_id: h.state for h in await ckpt.holders()}


async def all_in(ckpt: RayEnvironmentCheckpoint, state: HolderState) -> bool:
    return set((await states(ckpt)).values()) == {state}


async def resumed_within(ckpt: RayEnvironmentCheckpoint, seconds: float, since: float) -> None:
    """Every holder RUNNING within ``seconds`` of ``since`` (the loop's clock): resumed by
    an abort, not by a lease lapsing."""
    left = since + seconds - asyncio.get_running_loop().time()
    await wait_until(lambda: all_running(ckpt), max(left, 0.0),
                     f"every holder running within {seconds}s (lease_s is "
                     f"{ckpt.config.lease_s:g}s)")


async def manifest_names_the_open_snapshot(ckpt: RayEnvironmentCheckpoint, path: Path) -> str:
    """Wait until the manifest at ``path`` names the snapshot open now (its rename, the
    commit point, happened); return that snapshot's id."""
    def named() -> str | None:
        open_now = ckpt.open_operation
        return open_now if open_now and read_manifest(path).snapshot_id == open_now else None

    await wait_until(lambda: _async(named() is not None), 15, "the new manifest's rename")
    snapshot_id = named()
    assert snapshot_id is not None
    return snapshot_id


def env_files(path: Path) -> list[str]:
    """The files in the snapshot folder, claims (dot files) aside."""
    return sorted(p.name for p in environment_dir(path).iterdir() if not p.name.startswith("."))


def files_named_by(loaded: LoadedSnapshot) -> list[str]:
    return sorted(["manifest.json", *(s.file for s in loaded.manifest.shards)])


def episodes_of(sessions: dict[str, list[SessionRecord]]) -> dict[str, list[Ep]]:
    return {i: [r.episode for r in records] for i, records in sessions.items() if records}


def continued_of(live: dict[str, list[Ep]]) -> set[tuple[str, str, int]]:
    return {(i, ep.rollout_id, ep.attempt) for i, eps in live.items() for ep in eps}


@contextlib.asynccontextmanager
async def job(config: CheckpointConfig) -> AsyncIterator[RayEnvironmentCheckpoint]:
    """A job of its own with ``config``; its actors are killed when it ends."""
    checkpoint = RayEnvironmentCheckpoint(config)
    try:
        await checkpoint.ensure_holders()
        yield checkpoint
    finally:
        checkpoint.shutdown()


@contextlib.asynccontextmanager
async def fresh_job(ckpt: RayEnvironmentCheckpoint, **changes: Any
                    ) -> AsyncIterator[RayEnvironmentCheckpoint]:
    """The job that restores after ``ckpt``'s job ended: ``ckpt``'s actors are killed, and
    the new job runs in a namespace of its own, with ``ckpt``'s options but ``changes``."""
    ckpt.shutdown()
    options = {**ckpt.config.model_dump(), "namespace": f"{ckpt.config.namespace}-next",
               **changes}
    async with job(CheckpointConfig(**options)) as fresh:
        yield fresh


# --- actor and node faults ---------------------------------------------------------------


@pytest.mark.parametrize("phase", ["pause", "capture", "persist", "finish_writes"])
async def test_a_holder_killed_in_a_snapshot_phase_fails_it_cleanly(
    ckpt: Any, tmp_path: Path, phase: str
) -> None:
    live = await populate(ckpt)
    path = tmp_path / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    await holder(ckpt, "holder-1").inject_delay.remote(phase, 30)
    task = await snapshot_in_background(ckpt, path)
    await asyncio.sleep(1.5)
    assert not task.done()
    ray.kill(holder(ckpt, "holder-1"))
    with pytest.raises(BackendUnavailableError, match="holder-1") as err:
        await asyncio.wait_for(task, 30)
    assert ckpt.is_unavailable(err.value)
    survivors = await sessions_of(ckpt, ["holder-0", "holder-2"])
    await assert_recovered(ckpt, path, baseline, survivors)

    # The next snapshot works; the lost instance's rollouts are reported, not dropped.
    async with ckpt.snapshot(tmp_path / "next") as snap:
        await snap.check_against_cut(cut_of(live))
    lost = {("holder-1", ep) for ep in live["holder-1"]}
    assert snap.check_result.not_held == lost
    assert snap.metrics(0)["not_held_rollouts"] == 2


async def test_a_holder_killed_during_restore_leaves_nothing_and_the_snapshot_restores_later(
    ckpt: Any, tmp_path: Path
) -> None:
    await populate(ckpt)
    path = tmp_path / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    expected = {(i, f"{i}-r{k}", 0) for i in INSTANCES for k in range(2)}
    ckpt.shutdown()  # a new job restores

    fresh = RayEnvironmentCheckpoint(ckpt.config)
    try:
        await fresh.ensure_holders()
        await holder(fresh, "holder-1").inject_delay.remote("prepare_restore", 30)

        async def restore() -> None:
            async with fresh.restored(path):
                pass

        task = asyncio.ensure_future(restore())
        await asyncio.sleep(1.5)
        ray.kill(holder(fresh, "holder-1"))
        with pytest.raises(BackendUnavailableError, match="holder-1"):
            await asyncio.wait_for(task, 30)
        holders = await fresh.holders()
        assert {(h.instance_id, h.state, h.sessions) for h in holders} == {
            ("holder-0", HolderState.RUNNING, 0), ("holder-2", HolderState.RUNNING, 0)}
        assert tree(environment_dir(path)) == baseline
        async with fresh.restored(path) as restored:
            assert restored.continued_attempts == expected
        assert sorted(h.sessions for h in await fresh.holders()) == [2, 2, 2]
    finally:
        fresh.shutdown()


async def instance_on(ckpt: RayEnvironmentCheckpoint, node_id: str) -> str:
    (inst,) = [h.instance_id for h in await ckpt.ensure_holders() if h.node_id == node_id]
    return inst


async def test_a_node_removed_during_a_snapshot_fails_it_and_the_next_reports_the_loss(
    ckpt: Any, cluster: Any, extra_node: Any, tmp_path: Path
) -> None:
    victim = await instance_on(ckpt, extra_node.node_id)
    live = await populate(ckpt, (*INSTANCES, victim))
    path = tmp_path / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    await holder(ckpt, victim).inject_delay.remote("capture", 30)
    task = await snapshot_in_background(ckpt, path)
    await asyncio.sleep(1.5)
    cluster.remove_node(extra_node, allow_graceful=False)
    with pytest.raises(BackendUnavailableError, match=victim) as err:
        await asyncio.wait_for(task, 40)
    assert ckpt.is_unavailable(err.value)
    survivors = await sessions_of(ckpt, INSTANCES)
    await assert_recovered(ckpt, path, baseline, survivors)

    await wait_until(lambda: _async(extra_node.node_id not in alive_node_ids()), 20,
                     "the node to be declared dead")
    await ckpt.check_startup()  # every alive node still has its holder
    async with ckpt.snapshot(tmp_path / "next") as snap:
        await snap.check_against_cut(cut_of(live))
    assert snap.check_result.not_held == {(victim, ep) for ep in live[victim]}


async def test_a_node_removed_between_snapshots_is_reported_and_a_new_node_gets_a_holder(
    ckpt: Any, cluster: Any, extra_node: Any, tmp_path: Path
) -> None:
    victim = await instance_on(ckpt, extra_node.node_id)
    live = await populate(ckpt, ("holder-0", victim))
    async with ckpt.snapshot(tmp_path / "before") as snap:
        await snap.check_against_cut(cut_of(live))
    cluster.remove_node(extra_node, allow_graceful=False)
    await wait_until(lambda: _async(extra_node.node_id not in alive_node_ids()), 20,
                     "the node to be declared dead")
    await ckpt.check_startup()
    async with ckpt.snapshot(tmp_path / "after") as snap:
        await snap.check_against_cut(cut_of(live))
    assert snap.check_result.not_held == {(victim, ep) for ep in live[victim]}
    after = tmp_path / "after"
    assert {r.instance_id for r in snapshot_rollouts(after, read_manifest(after))[0]} == {
        "holder-0"}

    replacement = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        await ckpt.check_startup()
        assert replacement.node_id in {h.node_id for h in await ckpt.holders()}
    finally:
        remove_node_and_wait(cluster, replacement)


async def test_a_coordinator_killed_mid_snapshot_is_retriable_and_a_new_one_takes_over(
    ckpt: Any, tmp_path: Path
) -> None:
    await populate(ckpt)
    path = tmp_path / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    survivors = await sessions_of(ckpt, INSTANCES)
    with pytest.raises(BackendUnavailableError, match="coordinator") as err:
        async with ckpt.snapshot(path):
            ray.kill(ray.get_actor(ckpt.config.coordinator_name,
                                   namespace=ckpt.config.namespace))
            await asyncio.sleep(0.5)
    assert ckpt.is_unavailable(err.value)
    await assert_recovered(ckpt, path, baseline, survivors)
    async with ckpt.snapshot(tmp_path / "next") as snap:
        assert snap is not None and snap.captured_rollouts == 6


async def test_a_driver_that_dies_inside_the_snapshot_leaves_holders_resuming_by_lease(
    ckpt: Any, cluster: Any, tmp_path: Path
) -> None:
    await populate(ckpt)
    survivors = await sessions_of(ckpt, INSTANCES)
    path = tmp_path / "ckpt"
    kill_a_driver_inside(cluster.address, ckpt.config, "snapshot", path, timeout_s=90)
    paused = {h.state for h in await ckpt.holders()}
    assert paused == {HolderState.PAUSED}, "the holders should wait for their lease"
    await wait_until(lambda: all_running(ckpt), ckpt.config.lease_s + 5, "lease expiry")
    assert not (environment_dir(path) / "manifest.json").exists()
    assert await sessions_of(ckpt, INSTANCES) == survivors
    async with ckpt.snapshot(tmp_path / "next") as snap:
        assert snap is not None and snap.captured_rollouts == 6


# --- the reviewed cases 1-6 (tests/simulation/test_reliability.py), on a real cluster -------


async def test_a_driver_cancelled_while_its_commit_runs_keeps_the_new_snapshot_committed(
    ckpt: RayEnvironmentCheckpoint, tmp_path: Path
) -> None:
    """Case 1 (a). Pre-fix, the abort after the cancellation removed the new shards that
    the manifest already named: the snapshot read as torn."""
    live = await populate(ckpt)
    path = tmp_path / "ckpt"
    await commit_baseline(ckpt, path)
    older = read_manifest(path).snapshot_id
    await coordinator(ckpt).inject_delay.remote("after_manifest", 3.0)
    task = await snapshot_in_background(ckpt, path)
    new = await manifest_names_the_open_snapshot(ckpt, path)
    assert not task.done()
    task.cancel()  # while the driver awaits the commit
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    # The commit ran to its end before the cancellation was raised: the new snapshot
    # is whole, and it replaced the older one, whose shards are gone.
    loaded = read_snapshot(path)
    assert loaded.manifest.snapshot_id == new != older
    assert episodes_of(loaded.sessions) == live
    assert env_files(path) == files_named_by(loaded)
    assert await states(ckpt) == dict.fromkeys(INSTANCES, HolderState.RUNNING)


async def test_a_coordinator_killed_after_the_manifest_rename_commits_and_resumes_at_once(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    """Case 1 (b). Pre-fix, the abort sent to the fresh coordinator removed the new shards
    (a torn snapshot) and ``snapshot()`` raised. A long lease tells the abort's resume
    from the lease's, with room for the fresh coordinator's start on a loaded machine."""
    config = CheckpointConfig(allow_unchecked_snapshots=True,
                              namespace=namespace, drain_timeout_s=1.0, lease_s=30.0,
                              phase_timeout_s=10.0, persist_timeout_s=30.0)
    async with job(config) as ckpt:
        live = await populate(ckpt)
        path = tmp_path / "ckpt"
        await commit_baseline(ckpt, path)
        older = read_manifest(path).snapshot_id
        doomed = coordinator(ckpt)
        await doomed.inject_delay.remote("after_manifest", 30.0)
        task = await snapshot_in_background(ckpt, path)
        new = await manifest_names_the_open_snapshot(ckpt, path)
        killed_at = asyncio.get_running_loop().time()
        ray.kill(doomed, no_restart=True)
        await asyncio.wait_for(task, 30)  # the abort's answer is "committed": no error
        await resumed_within(ckpt, config.lease_s / 2, killed_at)
        loaded = read_snapshot(path)
        assert loaded.manifest.snapshot_id == new != older
        assert episodes_of(loaded.sessions) == live

        # The next snapshot works at once, and its clean-up removes both older ones.
        async with ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(cut_of(live))
        loaded = read_snapshot(path)
        assert loaded.manifest.snapshot_id not in (new, older)
        assert episodes_of(loaded.sessions) == live
        assert env_files(path) == files_named_by(loaded)


async def test_a_holder_killed_during_begin_resumes_the_others_before_the_error_arrives(
    ckpt: RayEnvironmentCheckpoint, tmp_path: Path
) -> None:
    """Case 2. Pre-fix, the survivors stayed paused until their lease lapsed, and the
    retry got HolderStateError."""
    live = await populate(ckpt)
    survivors = await sessions_of(ckpt, ["holder-0", "holder-2"])
    doomed = holder(ckpt, "holder-1")
    await doomed.inject_delay.remote("pause", 30)
    path = tmp_path / "ckpt"
    task = await snapshot_in_background(ckpt, path)
    await wait_until(lambda: all_in(ckpt, HolderState.PAUSED), 10, "every holder paused")
    ray.kill(doomed, no_restart=True)
    with pytest.raises(BackendUnavailableError, match="holder-1") as err:
        await asyncio.wait_for(task, 30)
    assert ckpt.is_unavailable(err.value)
    # Checked at once, not after the lease: resumed before the error reached the driver.
    assert await states(ckpt) == {"holder-0": HolderState.RUNNING,
                                  "holder-2": HolderState.RUNNING}
    assert await sessions_of(ckpt, survivors) == survivors

    # The immediate retry works; the lost instance's rollouts are reported as not held.
    async with ckpt.snapshot(path) as snap:
        assert snap is not None
        await snap.check_against_cut(cut_of(live))
    assert snap.check_result is not None
    assert snap.check_result.not_held == {("holder-1", ep) for ep in live["holder-1"]}
    assert episodes_of(read_snapshot(path).sessions) == episodes_of(survivors)


async def test_a_driver_cancelled_during_begin_resumes_every_holder_at_once(
    ckpt: RayEnvironmentCheckpoint, tmp_path: Path
) -> None:
    """Case 3, begin. Pre-fix, no abort was sent: the holders stayed paused until their
    lease lapsed."""
    live = await populate(ckpt)
    slow = holder(ckpt, "holder-1")
    await slow.inject_delay.remote("pause", 30)
    path = tmp_path / "ckpt"
    task = await snapshot_in_background(ckpt, path)
    await wait_until(lambda: all_in(ckpt, HolderState.PAUSED), 10, "every holder paused")
    cancelled_at = asyncio.get_running_loop().time()
    task.cancel()
    await resumed_within(ckpt, 1.5, cancelled_at)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)

    await slow.inject_delay.remote("pause", 0)
    async with ckpt.snapshot(path) as snap:  # the same driver's next snapshot works
        assert snap is not None
        await snap.check_against_cut(cut_of(live))
    assert episodes_of(read_snapshot(path).sessions) == live


async def test_a_driver_cancelled_while_a_restore_prepares_resumes_every_holder_at_once(
    ckpt: RayEnvironmentCheckpoint, tmp_path: Path
) -> None:
    """Case 3, a restore's prepare. Pre-fix, no abort was sent: the holders stayed
    restoring until their lease lapsed."""
    live = await populate(ckpt)
    path = tmp_path / "ckpt"
    await commit_baseline(ckpt, path)
    async with fresh_job(ckpt) as fresh:
        slow = holder(fresh, "holder-1")
        await slow.inject_delay.remote("prepare_restore", 30)
        task = restore_in_background(fresh, path)
        await wait_until(lambda: all_in(fresh, HolderState.RESTORING), 10,
                         "every holder restoring")
        cancelled_at = asyncio.get_running_loop().time()
        task.cancel()
        await resumed_within(fresh, 1.5, cancelled_at)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert {h.sessions for h in await fresh.holders()} == {0}

        await slow.inject_delay.remote("prepare_restore", 0)
        async with fresh.restored(path) as restored:  # the same driver's next restore
            assert restored.continued_attempts == continued_of(live)
        assert episodes_of(await sessions_of(fresh, INSTANCES)) == {
            i: [ep.next_attempt() for ep in eps] for i, eps in live.items()}


async def test_a_turn_cancelled_at_the_closed_gate_leaves_no_turn_in_flight(
    ckpt: RayEnvironmentCheckpoint, tmp_path: Path
) -> None:
    """Case 4. Pre-fix, the turn opened once the gate did and stayed in flight for ever:
    the next drain waited for its deadline and the session refused its next turn
    (TurnInProgressError)."""
    live = await populate(ckpt)
    ep = live["holder-0"][0]
    c = await client(ckpt, "holder-0")
    entered: list[Turn] = []

    async def worker() -> None:
        async with c.turn(ep) as turn:
            entered.append(turn)
            turn.complete(b"never", b"x", [])

    async with ckpt.snapshot(tmp_path / "ckpt") as snap:
        assert snap is not None
        await snap.check_against_cut(cut_of(live))
        waiting = asyncio.ensure_future(worker())
        await asyncio.sleep(0.5)  # its begin_turn reaches the holder: the gate is closed
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert {h.instance_id: h.turns_in_flight for h in await ckpt.holders()} == dict.fromkeys(
        INSTANCES, 0)
    assert entered == []

    async with ckpt.snapshot(tmp_path / "next") as snap:
        assert snap is not None
    assert snap.restarted_rollouts == 0  # nothing was mid-turn at the drain deadline
    assert snap.metrics(0.0)["drain_seconds"] < ckpt.config.drain_timeout_s

    async with c.turn(ep) as turn:  # the session's next turn works
        turn.complete(b"t2", b"s", [])
    assert (await c.get(ep)).turns == (b"t0", b"t1", b"t2")


async def test_a_holder_killed_in_commit_restore_leaves_nothing_live_and_the_retry_restores(
    ckpt: RayEnvironmentCheckpoint, tmp_path: Path
) -> None:
    """Case 5. Pre-fix, the holders that had committed kept the restored sessions live,
    and the retry failed with RestoreConflictError."""
    live = await populate(ckpt)
    path = tmp_path / "ckpt"
    await commit_baseline(ckpt, path)
    async with fresh_job(ckpt) as fresh:
        doomed = holder(fresh, "holder-1")
        await doomed.inject_delay.remote("commit_restore", 30)
        task = restore_in_background(fresh, path)

        async def others_committed() -> bool:
            return {(h.instance_id, h.state, h.sessions) for h in await fresh.holders()} == {
                ("holder-0", HolderState.RUNNING, 2), ("holder-1", HolderState.RESTORING, 0),
                ("holder-2", HolderState.RUNNING, 2)}

        await wait_until(others_committed, 10, "holder-0 and holder-2 committed the restore")
        ray.kill(doomed, no_restart=True)
        with pytest.raises(BackendUnavailableError, match="holder-1") as err:
            await asyncio.wait_for(task, 30)
        assert fresh.is_unavailable(err.value)
        # All or nothing: before the error arrived, the holders that went live dropped it.
        assert {(h.instance_id, h.state, h.sessions) for h in await fresh.holders()} == {
            ("holder-0", HolderState.RUNNING, 0), ("holder-2", HolderState.RUNNING, 0)}

        async with fresh.restored(path) as restored:  # the retry restores it
            assert restored.continued_attempts == continued_of(live)
        sessions = await sessions_of(fresh, INSTANCES)
        assert episodes_of(sessions) == {i: [ep.next_attempt() for ep in eps]
                                         for i, eps in live.items()}
        assert {r.turns for records in sessions.values() for r in records} == {(b"t0", b"t1")}


async def test_a_restore_whose_shard_read_outlasts_the_lease_succeeds(
    ckpt: RayEnvironmentCheckpoint, tmp_path: Path
) -> None:
    """Case 6. Pre-fix, renewals started only after the prepare: the lease lapsed during
    the read and the restore failed with LeaseExpiredError."""
    live = await populate(ckpt)
    path = tmp_path / "ckpt"
    await commit_baseline(ckpt, path)
    lease = 2.0
    async with fresh_job(ckpt, lease_s=lease, drain_timeout_s=0.5) as fresh:
        await holder(fresh, "holder-1").inject_delay.remote("prepare_restore", 1.5 * lease)
        started = asyncio.get_running_loop().time()
        async with fresh.restored(path) as restored:
            assert restored.continued_attempts == continued_of(live)
        assert asyncio.get_running_loop().time() - started > lease  # the read took longer
        assert episodes_of(await sessions_of(fresh, INSTANCES)) == {
            i: [ep.next_attempt() for ep in eps] for i, eps in live.items()}
        assert await all_running(fresh)


# --- storage faults -------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount a small tmpfs (needs root, as on this project's machines and CI)."""
    mounted: list[Path] = []

    def mount(size: str = "4m") -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(point)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


async def test_a_read_only_checkpoint_folder_is_a_write_error_and_keeps_the_old_snapshot(
    ckpt: Any, tmpfs: Callable[..., Path]
) -> None:
    await populate(ckpt)
    path = tmpfs() / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    survivors = await sessions_of(ckpt, INSTANCES)
    subprocess.run(["mount", "-o", "remount,ro", str(path.parent)], check=True)
    with pytest.raises(SnapshotWriteError, match="read-only") as err:
        async with ckpt.snapshot(path):
            pass
    assert not ckpt.is_unavailable(err.value)
    await assert_recovered(ckpt, path, baseline, survivors)


async def test_a_full_disk_is_a_write_error_and_leaves_no_partial_files(
    ckpt: Any, tmpfs: Callable[..., Path]
) -> None:
    await populate(ckpt, ("holder-0",))
    path = tmpfs("1m") / "ckpt"
    baseline = await commit_baseline(ckpt, path)
    c = await client(ckpt, "holder-1")
    for k in range(4):  # 4 x 400 KiB does not fit in what is left of 1 MiB
        await c.open(Ep(f"big{k}", 0), os.urandom(400 << 10))
    survivors = await sessions_of(ckpt, INSTANCES)
    with pytest.raises(SnapshotWriteError, match="filesystem is full") as err:
        async with ckpt.snapshot(path):
            pass
    assert not ckpt.is_unavailable(err.value)
    await assert_recovered(ckpt, path, baseline, survivors)


async def test_a_folder_removed_mid_write_is_a_write_error(ckpt: Any, tmp_path: Path) -> None:
    await populate(ckpt)
    committed = tmp_path / "committed"
    baseline = await commit_baseline(ckpt, committed)
    survivors = await sessions_of(ckpt, INSTANCES)
    await holder(ckpt, "holder-0").inject_delay.remote("persist", 1.0)
    doomed = tmp_path / "doomed"
    with pytest.raises(SnapshotWriteError, match="disappeared") as err:
        async with ckpt.snapshot(doomed):
            shutil.rmtree(doomed)
    assert not ckpt.is_unavailable(err.value)
    await assert_recovered(ckpt, committed, baseline, survivors)


async def test_a_persist_past_its_deadline_is_unavailable_and_cleans_up(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(allow_unchecked_snapshots=True,
        namespace=namespace, drain_timeout_s=0.5, lease_s=4, persist_timeout_s=1.0))
    try:
        await ckpt.ensure_holders()
        await populate(ckpt)
        path = tmp_path / "ckpt"
        async with ckpt.snapshot(path):
            pass
        baseline = tree(environment_dir(path))
        survivors = await sessions_of(ckpt, INSTANCES)
        await holder(ckpt, "holder-2").inject_delay.remote("persist", 3.0)
        with pytest.raises(BackendUnavailableError, match="within 1.0s") as err:
            async with ckpt.snapshot(path):
                pass
        assert ckpt.is_unavailable(err.value)
        await asyncio.sleep(3.0)  # the slow write finishes, then removes its own file
        await assert_recovered(ckpt, path, baseline, survivors)
    finally:
        ckpt.shutdown()


# --- bad input -------------------------------------------------------------------------------


def _flip(path: Path) -> None:
    shard = next(environment_dir(path).glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _edit_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    m = environment_dir(path) / "manifest.json"
    data = json.loads(m.read_text())
    edit(data)
    m.write_text(json.dumps(data))


def _escape(d: dict[str, Any]) -> None:
    old = d["shards"][0]["file"]
    d["shards"][0]["file"] = "../../outside.msgpack"
    for r in d.get("rollouts", []):
        if r["shard"] == old:
            r["shard"] = "../../outside.msgpack"


BAD_SNAPSHOTS: dict[str, tuple[Callable[[Path], Any], type[SnapshotReadError], str]] = {
    "no-snapshot": (lambda p: shutil.rmtree(p), SnapshotNotFoundError, "no environment snapshot"),
    "torn": (lambda p: next(environment_dir(p).glob("shard-*")).unlink(), TornSnapshotError,
             "torn"),
    "corrupt-shard": (_flip, ShardCorruptedError, "xxh3-128"),
    "future-version": (lambda p: _edit_manifest(p, lambda d: d.update(format_version=7)),
                       UnsupportedFormatVersionError, "format version 7"),
    "garbage-manifest": (lambda p: (environment_dir(p) / "manifest.json").write_bytes(b"\x00{"),
                         ManifestInvalidError, "not valid JSON"),
    "escaping-name": (lambda p: _edit_manifest(p, _escape), UnsafeShardNameError,
                      "not a plain file name"),
    "path-is-a-file": (lambda p: (shutil.rmtree(p), p.write_text("x")), CheckpointPathError,
                       "is a file"),
}


@pytest.mark.parametrize("case", sorted(BAD_SNAPSHOTS))
async def test_a_bad_snapshot_is_refused_and_no_holder_changes(
    ckpt: Any, tmp_path: Path, case: str
) -> None:
    await populate(ckpt, ("holder-0",))
    path = tmp_path / "ckpt"
    async with ckpt.snapshot(path):
        pass
    ckpt.shutdown()
    damage, error, needle = BAD_SNAPSHOTS[case]
    damage(path)
    fresh = RayEnvironmentCheckpoint(ckpt.config)
    try:
        await fresh.ensure_holders()
        with pytest.raises(error, match=needle) as err:
            async with fresh.restored(path):
                pytest.fail("the restore block ran on a bad snapshot")
        assert str(path) in str(err.value)
        assert not fresh.is_unavailable(err.value)
        assert {(h.state, h.sessions) for h in await fresh.holders()} == {
            (HolderState.RUNNING, 0)}
    finally:
        fresh.shutdown()


async def test_invalid_input_from_environment_workers_is_refused(
    cluster: Any, namespace: str
) -> None:
    ckpt = RayEnvironmentCheckpoint(CheckpointConfig(allow_unchecked_snapshots=True,
                                                     namespace=namespace, max_state_bytes=1024))
    try:
        await ckpt.ensure_holders()
        c = await client(ckpt, "holder-0")
        with pytest.raises(ValueError, match="rollout_id must not be empty"):
            Ep("", 0)
        with pytest.raises(TypeError, match="expected an EnvironmentEpisode"):
            await c.open(("r", 0), b"")  # type: ignore[arg-type]
        with pytest.raises(StateTooLargeError, match="2048 bytes, over the limit of 1024"):
            await c.open(Ep("big", 0), b"x" * 2048)
        await c.open(Ep("ok", 0), b"")
        with pytest.raises(StateTooLargeError):
            async with c.turn(Ep("ok", 0)) as turn:
                turn.complete(b"r", b"y" * 4096, [])
        assert (await c.get(Ep("ok", 0))).turns == ()
        with pytest.raises(TypeError, match="must be bytes"):
            async with c.turn(Ep("ok", 0)) as turn:
                turn.complete(b"r", "not bytes", [])  # type: ignore[arg-type]
    finally:
        ckpt.shutdown()
