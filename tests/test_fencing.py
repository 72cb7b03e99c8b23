"""Work of an older coordinator incarnation never touches what a newer one owns (issue
29, case 1): a coordinator Ray declared dead (its node stalled) runs again and finishes
an old commit while the job, through its successor, snapshots into the same path.
In-process, under virtual time, as ``tests/test_reliability.py``; the same on real Ray
in ``tests/test_ray_as_it_behaves.py``."""

from __future__ import annotations

import asyncio

import pytest

from actors.coordinator import CheckpointCoordinator
from nemo_ckpt.errors import OperationAbortedError
from nemo_ckpt.operations import new_operation_id
from nemo_ckpt.snapshot_files import read_manifest, read_snapshot
from nemo_ckpt.testing.sim import EPOCH
from nemo_ckpt.transport import COORDINATOR
from tests.test_reliability import CONFIG, World

pytestmark = pytest.mark.timeout(60)


def zombie(world: World) -> CheckpointCoordinator:
    """A coordinator incarnation the job no longer finds by name (Ray declared it dead),
    still running: the next driver call makes a successor."""
    actor = world.sim.new_actor(COORDINATOR, "zombie", "node-0")
    return CheckpointCoordinator(CONFIG, world.sim.transport(actor, CONFIG))


def test_a_zombie_coordinators_late_clean_up_spares_its_successors_snapshot(
        world: World) -> None:
    path = world.path("ckpt")
    old = zombie(world)

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)
        # The old incarnation's snapshot: its manifest lands, then its node stalls.
        op = new_operation_id("snap", EPOCH + world.sim.loop.time(), "olddrivr", 1)
        await old.begin_snapshot(op, str(path))
        await old.start_writes(op)
        await old.inject_delay("after_manifest", 3.0)
        late = asyncio.ensure_future(old.commit_snapshot(op, str(path), {}, 0))
        while read_manifest(path).snapshot_id != op:
            await asyncio.sleep(0.01)

        async def block() -> None:  # the stalled one runs again meanwhile
            await asyncio.sleep(6.0)
            assert late.done()

        await world.snapshot(path, live, block)  # through the successor
        loaded = read_snapshot(path)  # every shard it names is there
        assert loaded.manifest.snapshot_id not in (op,)
        assert sum(len(v) for v in loaded.sessions.values()) == 6
        late.result()

    world.run(scenario())


def test_a_zombie_coordinator_never_commits_a_snapshot_its_successor_aborted(
        world: World) -> None:
    path = world.path("ckpt")
    old = zombie(world)

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)
        first = read_manifest(path).snapshot_id
        op = new_operation_id("snap", EPOCH + world.sim.loop.time(), "olddrivr", 1)
        await old.begin_snapshot(op, str(path))
        await old.start_writes(op)
        await old.inject_delay("before_manifest", 3.0)  # shards durable, then a stall
        late = asyncio.ensure_future(old.commit_snapshot(op, str(path), {}, 0))
        await asyncio.sleep(0.5)
        # Its driver, told the coordinator died, aborts through the successor.
        transport = world.sim.transport(world.driver, CONFIG)
        assert await transport.call(transport.coordinator(), "abort", op, str(path)) \
            == "aborted"
        with pytest.raises(OperationAbortedError, match="another coordinator"):
            await late
        assert read_manifest(path).snapshot_id == first  # the aborted one never landed
        read_snapshot(path)

    world.run(scenario())
