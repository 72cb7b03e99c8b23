"""Handles that outlive the actor they named (issue 29): a worker's ``SessionClient``
finds its instance's current holder by name after the one it held died. In-process,
under virtual time, as ``tests/simulation/test_reliability.py``."""

from __future__ import annotations

import pytest

from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.snapshot_files import read_snapshot
from nemo_ckpt.transport import COORDINATOR, HOLDER
from tests.harness import CONFIG, World

pytestmark = pytest.mark.timeout(60)


def test_a_client_whose_holder_was_killed_reaches_its_successor_once_it_runs(
        world: World) -> None:
    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        client = await world.client("holder-1")
        await client.open(Ep("before", 0), b"s")
        victim = next(a for a in world.sim.live(HOLDER) if a.name == "holder-1")
        world.sim.kill(victim)  # an OOM kill
        with pytest.raises(BackendUnavailableError, match="holder holder-1"):
            await client.open(Ep("r", 0), b"s")
        # Until a successor runs, the client says so (and what starts one) at once.
        with pytest.raises(BackendUnavailableError,
                           match="holder holder-1 is not running.*check_startup"):
            await client.open(Ep("r", 0), b"s")
        await world.ckpt.check_startup()  # makes holder-1 again, on the same node
        record = await client.open(Ep("r", 0), b"s")  # the same client gets through
        assert record.episode == Ep("r", 0)
        assert [r.episode for r in await client.sessions()] == [Ep("r", 0)]

    world.run(scenario())


def test_a_clients_holder_info_names_its_holder_and_then_the_successor(world: World) -> None:
    """``holder_info`` goes the way of the client's session calls: typed, and to the
    instance's current holder once a successor runs."""
    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        client = await world.client("holder-1")
        await client.open(Ep("r", 0), b"s")
        info = await client.holder_info()
        assert (info.instance_id, info.state, info.sessions) == (
            "holder-1", HolderState.RUNNING, 1)
        world.sim.kill(next(a for a in world.sim.live(HOLDER) if a.name == "holder-1"))
        with pytest.raises(BackendUnavailableError, match="holder holder-1"):
            await client.holder_info()
        await world.ckpt.check_startup()
        info = await client.holder_info()
        assert (info.instance_id, info.sessions) == ("holder-1", 0)

    world.run(scenario())


def test_an_abort_while_the_coordinators_name_points_at_the_dead_reaches_its_successor(
        world: World) -> None:
    """Case 2: the coordinator's node is lost inside a snapshot's block, and until Ray
    declares it dead its name resolves to the dead actor. The abort keeps looking the
    name up: the surviving holders resume at once (not by their lease), and the next
    attempt works."""
    path = world.path("ckpt")
    key = (CONFIG.namespace, CONFIG.coordinator_name)

    async def scenario() -> None:
        live = await world.populate()
        failed_at: list[float] = []

        async def block() -> None:
            dead = world.sim.live(COORDINATOR)[0]
            world.sim.kill(dead)
            world.sim.registry[key] = dead  # the name not released yet
            world.sim.loop.call_later(2.0, world.sim.registry.pop, key, None)

        started = world.sim.loop.time()
        with pytest.raises(BackendUnavailableError):
            try:
                await world.snapshot(path, live, block)
            finally:
                failed_at.append(world.sim.loop.time())
        assert set(world.states().values()) == {HolderState.RUNNING}
        # Resumed by the abort, not by the lease.
        assert failed_at[0] - started < CONFIG.lease_s
        await world.snapshot(path, live)  # the next attempt, at once
        assert sum(len(v) for v in read_snapshot(path).sessions.values()) == 6

    world.run(scenario())
