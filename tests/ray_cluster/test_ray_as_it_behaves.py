"""Ray as it really behaves (issue 29), on the session's real multi-node cluster: a
coordinator incarnation that runs again after its successor took over, a client whose
holder was killed, handles across ``ray.shutdown()`` and ``ray.init()``, a restarted
driver that finds the job's actors alive with another config."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.coordinator.actor import CheckpointCoordinator
from actors.drills import COORDINATOR_POINTS, PhaseDelays
from actors.ray_transport import CheckpointCoordinatorActor, RayMetrics, RayTransport
from nemo_ckpt import CheckpointConfig, RayEnvironmentCheckpoint, SessionClient
from nemo_ckpt.config import HOLDER_NAME_PREFIX
from nemo_ckpt.errors import (
    BackendUnavailableError,
    ConfigMismatchError,
    SnapshotNotFoundError,
    StartupCheckError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.protocol.operations import new_operation_id
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot
from nemo_ckpt.transport import Runtime
from tests.ray_cluster.test_faults import wait_until

pytestmark = pytest.mark.timeout(120)


async def test_a_zombie_coordinators_late_commit_spares_the_next_snapshot(
        ckpt: Any, tmp_path: Path) -> None:
    """Case 1: a coordinator incarnation the job took for dead (its node stalled right
    after its manifest's rename) finishes that commit while the job, through the named
    coordinator, snapshots into the same path: its clean-up must not remove the new
    snapshot's shards (it took their claim for its own dead predecessor's)."""
    ns = ckpt.config.namespace
    path = tmp_path / "ckpt"
    for inst in ("holder-0", "holder-1"):
        c = await SessionClient.connect(inst, namespace=ns)
        await c.open(Ep(f"{inst}-r", 0), b"s")
    async with ckpt.snapshot(path):
        pass
    delays = PhaseDelays(COORDINATOR_POINTS)
    zombie = CheckpointCoordinator(ckpt.config, RayTransport(
        ckpt.config, Runtime(metrics=RayMetrics(ns), reached=delays.reached)))
    op = new_operation_id("snap", time.time(), "olddrivr", 1)
    await zombie.begin_snapshot(op, str(path))
    await zombie.start_writes(op)
    delays.set("after_manifest", 4.0)
    late = asyncio.ensure_future(zombie.commit_snapshot(op, str(path), {}, 0))
    await wait_until(lambda: _manifest_names(path, op), 30, "the zombie's manifest")

    async with ckpt.snapshot(path):  # the stalled incarnation runs again meanwhile
        await asyncio.wait_for(asyncio.shield(late), 30)
    loaded = read_snapshot(path)  # every shard its manifest names is there
    assert loaded.manifest.snapshot_id != op
    assert sorted(s.episode.rollout_id for v in loaded.sessions.values() for s in v) == [
        "holder-0-r", "holder-1-r"]


async def _manifest_names(path: Path, op: str) -> bool:
    try:
        return read_manifest(path).snapshot_id == op
    except SnapshotNotFoundError:
        return False


async def test_a_client_whose_holder_was_killed_reaches_its_successor(ckpt: Any) -> None:
    """Case 4: an OOM kill of a holder; check_startup makes its successor; the worker's
    existing client, which held the dead handle, gets through without reconnecting."""
    ns = ckpt.config.namespace
    c = await SessionClient.connect("holder-1", namespace=ns)
    await c.open(Ep("lost", 0), b"s")
    ray.kill(ray.get_actor(HOLDER_NAME_PREFIX + "holder-1", namespace=ns), no_restart=True)

    async def killed_holder_refuses() -> bool:
        # ray.kill only asks: a call sent at once can still be served before the kill lands.
        try:
            await c.sessions()
        except BackendUnavailableError as exc:
            assert "holder-1" in str(exc)
            return True
        return False

    await wait_until(killed_holder_refuses, 30, "the killed holder to refuse the client")

    async def successor_runs() -> bool:
        try:
            await ckpt.check_startup()
            await c.open(Ep("a", 0), b"s")
        except BackendUnavailableError:
            return False  # Ray has not released the dead holder's name yet
        except StartupCheckError as exc:
            # Ray handed back the dead holder for its name (get_if_exists): its node has
            # no holder that answers until the name is released; a later check makes one.
            assert "has no session holder that answers" in str(exc)
            return False
        return True

    await wait_until(successor_runs, 60, "the same client to reach holder-1's successor")
    assert [r.episode for r in await c.sessions()] == [Ep("a", 0)]  # "lost" died with it


async def test_a_checkpoint_and_a_client_work_on_across_ray_shutdown_and_init(
        ckpt: Any, cluster: Any, tmp_path: Path) -> None:
    """Case 5: handles belong to one Ray session; the same objects find the job's
    detached actors again by name in the next one, and say what to do in between."""
    ns = ckpt.config.namespace
    c = await SessionClient.connect("holder-0", namespace=ns)
    await c.open(Ep("a", 0), b"s")
    ray.shutdown()
    try:
        with pytest.raises(BackendUnavailableError, match=r"call ray.init\(\)"):
            await ckpt.ensure_holders()
    finally:
        ray.init(address=cluster.address, log_to_driver=False)
    assert len(await ckpt.ensure_holders()) == 3
    async with ckpt.snapshot(tmp_path / "after") as snap:
        assert snap is not None
    assert [s.episode for s in read_snapshot(tmp_path / "after").sessions["holder-0"]] == [
        Ep("a", 0)]
    assert [r.episode for r in await c.sessions()] == [Ep("a", 0)]


async def test_a_snapshot_after_ray_is_initialised_again_ends_by_its_deadline_when_the_commit_never_answers(  # noqa: E501
        cluster: Any, namespace: str, tmp_path: Path) -> None:
    """Issue 56, case 2: after ``ray.shutdown()`` and ``ray.init()`` the same checkpoint
    snapshots through handles looked up again; a commit the live coordinator never
    answers (held at its commit point) ends by the driver's deadline, and so does the
    abort that asks for its outcome: the documented error, not a wait for ever."""
    config = CheckpointConfig(allow_unchecked_snapshots=True, namespace=namespace,
                              checkpoint_root=tmp_path, drain_timeout_s=0.5, lease_s=4.0,
                              phase_timeout_s=5.0, persist_timeout_s=5.0)
    ckpt = RayEnvironmentCheckpoint(config)
    try:
        await ckpt.ensure_holders()
        ray.shutdown()
        ray.init(address=cluster.address, log_to_driver=False)
        async with ckpt.snapshot(tmp_path / "after-init"):
            pass
        assert read_manifest(tmp_path / "after-init") is not None
        coordinator = ray.get_actor(config.coordinator_name, namespace=namespace)
        await coordinator.inject_delay.remote("commit_snapshot", 3600.0)
        with pytest.raises(BackendUnavailableError) as raised:
            async with ckpt.snapshot(tmp_path / "never-answered"):
                pass
        assert "got no answer by its deadline" in str(raised.value)
        assert "may still commit" in str(raised.value)
        assert raised.value.timed_out and ckpt.is_unavailable(raised.value)
    finally:
        await ckpt.shutdown(wait=True)


async def test_a_restarted_driver_with_another_config_is_refused_or_its_deadlines_adopted(
        ckpt: Any, tmp_path: Path) -> None:
    """Case 6: the first driver's coordinator lives on (detached); a second driver's
    lease is adopted, a different max_state_bytes refused, naming the field."""
    await ckpt.ensure_holders()
    longer = RayEnvironmentCheckpoint(ckpt.config.model_copy(update={"lease_s": 12.0}))
    async with longer.snapshot(tmp_path / "long") as snap:
        assert snap is None  # no sessions: nothing to check
        await asyncio.sleep(ckpt.config.lease_s * 1.5)  # past the first driver's lease
    read_snapshot(tmp_path / "long")
    other = RayEnvironmentCheckpoint(CheckpointConfig(
        **{**ckpt.config.model_dump(), "max_state_bytes": 1234}))
    with pytest.raises(ConfigMismatchError, match="max_state_bytes is .* 1234 in yours"):
        await other.ensure_holders()


async def test_control_calls_never_queue_behind_more_waiting_turns_than_a_holder_runs(
        ckpt: Any, tmp_path: Path) -> None:
    """Case 3: with more turns waiting at a paused holder's gate than its session slots,
    release, renewals and persist still run at once: the snapshot commits, well within
    its lease, and the waiting turns then run."""
    config = ckpt.config.model_copy(update={
        "namespace": ckpt.config.namespace + "-slots", "holder_turn_slots": 8,
        "checkpoint_root": tmp_path})
    small = RayEnvironmentCheckpoint(config)
    try:
        await small.ensure_holders()
        c = await SessionClient.connect("holder-0", namespace=config.namespace)
        episodes = [Ep(f"r{k}", 0) for k in range(30)]
        await c.open_many((ep, b"s") for ep in episodes)

        async def turn(ep: Ep) -> None:
            async with c.turn(ep) as t:
                t.complete(b"t", b"s2", [])

        started = asyncio.get_running_loop().time()
        async with small.snapshot(tmp_path / "s") as snap:
            assert snap is not None
            waiting = [asyncio.ensure_future(turn(ep)) for ep in episodes]
            await asyncio.sleep(1.0)  # every turn sent: 8 run (at the gate), 22 queue
            assert not any(w.done() for w in waiting)
        assert asyncio.get_running_loop().time() - started < config.lease_s
        await asyncio.wait_for(asyncio.gather(*waiting), 30)
        assert read_manifest(tmp_path / "s").snapshot_id == snap.snapshot_id
        assert all(len(r.turns) == 1 for r in await c.sessions())
    finally:
        small.shutdown()


async def test_after_the_coordinators_node_is_lost_the_abort_resumes_the_survivors_at_once(
        ckpt: Any, cluster: Any, extra_node: Any, tmp_path: Path) -> None:
    """Case 2: the coordinator's node is removed inside a snapshot's block. Until Ray
    declares the node dead, the coordinator's name resolves to the dead actor; the
    abort keeps looking it up, reaches the successor, and the surviving holders resume
    long before their lease; the next attempt works at once."""
    config = ckpt.config.model_copy(update={
        "namespace": ckpt.config.namespace + "-lost", "lease_s": 30.0,
        "checkpoint_root": tmp_path})
    # The coordinator on the node to be lost (a driver there would have put it there).
    CheckpointCoordinatorActor.options(
        name=config.coordinator_name, namespace=config.namespace, lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(extra_node.node_id, soft=False),
    ).remote(config)
    job = RayEnvironmentCheckpoint(config)
    try:
        survivor = next(h.instance_id for h in await job.ensure_holders()
                        if h.node_id != extra_node.node_id)
        coordinator = ray.get_actor(config.coordinator_name, namespace=config.namespace)
        pid = await coordinator.__ray_call__.remote(lambda self: os.getpid())
        c = await SessionClient.connect(survivor, namespace=config.namespace)
        await c.open(Ep("r", 0), b"s")
        started = asyncio.get_running_loop().time()
        with pytest.raises(BackendUnavailableError):
            async with job.snapshot(tmp_path / "a"):
                cluster.remove_node(extra_node, allow_graceful=False)
                os.kill(pid, signal.SIGKILL)  # a worker may outlive its raylet briefly
        held = ray.get_actor(HOLDER_NAME_PREFIX + survivor, namespace=config.namespace)
        assert (await held.info.remote()).state is HolderState.RUNNING
        assert asyncio.get_running_loop().time() - started < config.lease_s
        async with job.snapshot(tmp_path / "b") as snap:  # the next attempt, at once
            assert snap is not None
        assert [s.episode for s in read_snapshot(tmp_path / "b").sessions[survivor]] == [
            Ep("r", 0)]
    finally:
        job.shutdown()
