"""Work of an older coordinator incarnation never touches what a newer one owns (issue
29, case 1): a coordinator Ray declared dead (its node stalled) runs again and finishes
an old commit while the job, through its successor, snapshots into the same path.
In-process, under virtual time, as ``tests/simulation/test_reliability.py``; the same on real Ray
in ``tests/ray_cluster/test_ray_as_it_behaves.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from actors.coordinator.actor import CheckpointCoordinator
from nemo_ckpt.errors import OperationAbortedError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.protocol.operations import new_operation_id
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot
from nemo_ckpt.testing.virtual_time import EPOCH
from nemo_ckpt.transport import COORDINATOR
from tests.harness import CONFIG, World

pytestmark = pytest.mark.timeout(60)


class Stalled(NamedTuple):
    committed: str  # the snapshot at the path before the stalled one
    operation: str  # the stalled one
    live: dict[str, list[Ep]]
    commit: asyncio.Future[Any]  # its commit, stalled


async def stalled_commit(world: World, path: Path, stall_at: str) -> Stalled:
    """A committed snapshot at ``path``, then a coordinator incarnation the job no longer
    finds by name (Ray declared it dead), still running, commits its own snapshot there
    and stalls for 3 s at ``stall_at``: the next driver call makes a successor."""
    actor = world.sim.new_actor(COORDINATOR, "zombie", "node-0")
    old = CheckpointCoordinator(CONFIG, world.sim.transport(actor, CONFIG))
    live = await world.populate()
    await world.snapshot(path, live)
    committed = read_manifest(path).snapshot_id
    op = new_operation_id("snap", EPOCH + world.sim.loop.time(), "olddrivr", 1)
    await old.begin_snapshot(op, str(path))
    await old.start_writes(op)
    actor.delays.set(stall_at, 3.0)
    late = asyncio.ensure_future(old.commit_snapshot(op, str(path), {}, 0))
    return Stalled(committed, op, live, late)


def test_a_zombie_coordinators_late_clean_up_spares_its_successors_snapshot(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        # The old incarnation's snapshot: its manifest lands, then its node stalls.
        _, op, live, late = await stalled_commit(world, path, "after_manifest")
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

    async def scenario() -> None:
        # Its shards are durable, then it stalls before its manifest.
        first, op, _, late = await stalled_commit(world, path, "before_manifest")
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
