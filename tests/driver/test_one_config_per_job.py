"""One config per job (issue 29, case 6): a restarted driver finds the job's coordinator
and holders alive by name, made with whoever's config created them. In-process, under
virtual time, as ``tests/simulation/test_reliability.py``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.errors import ConfigMismatchError
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.snapshot_files import read_snapshot
from nemo_ckpt.transport import COORDINATOR
from tests.harness import CONFIG, World, cut_of

pytestmark = pytest.mark.timeout(60)


def restarted_driver(world: World, **changes: Any) -> Any:
    """A second driver process of the same job, with ``changes`` to its config."""
    config = CheckpointConfig(**{**CONFIG.model_dump(), **changes})
    return world.checkpoint(world.sim.new_actor("driver", "driver-2", "node-0"), config)


def test_a_restarted_driver_with_a_longer_lease_has_it_adopted_by_the_live_coordinator(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    # Its own level: the simulation's runner silences the package's loggers.
    caplog.set_level(logging.WARNING, logger="nemo_ckpt.coordinator")
    path = world.path("ckpt")
    second = restarted_driver(world, lease_s=30.0, drain_timeout_s=2.0)

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)  # the first driver made the coordinator
        coordinator = world.sim.live(COORDINATOR)[0]

        async def long_block() -> None:  # twice the first driver's lease
            await asyncio.sleep(CONFIG.lease_s * 2)


        async with second.snapshot(path) as snap:
            await snap.check_against_cut(cut_of(live))
            await long_block()
        assert world.sim.live(COORDINATOR)[0] is coordinator  # the same, live one
        assert sum(len(v) for v in read_snapshot(path).sessions.values()) == 6
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())
    assert "adopting them: drain_timeout_s 1.0 -> 2.0, lease_s 6.0 -> 30.0" in caplog.text


@pytest.mark.parametrize(("field", "value"), [
    ("max_state_bytes", 1024), ("turn_timeout_s", 99.0), ("max_retired_marks", 7)])
def test_a_driver_whose_config_differs_where_the_actors_cannot_change_is_refused(
        world: World, field: str, value: object) -> None:
    second = restarted_driver(world, **{field: value})

    async def scenario() -> None:
        await world.populate()
        with pytest.raises(ConfigMismatchError,
                           match=rf"{field} is .* there, {value!r} in yours.*shutdown\(\)"):
            async with second.snapshot(world.path("ckpt")):
                pass
        assert set(world.states().values()) == {HolderState.RUNNING}  # nothing paused

    world.run(scenario())


def test_holders_found_alive_by_a_new_coordinator_are_compared_with_the_drivers_config(
        world: World) -> None:
    second = restarted_driver(world, max_state_bytes=4096)

    async def scenario() -> None:
        await world.populate()  # holders made with the first driver's max_state_bytes
        world.sim.kill(world.sim.live(COORDINATOR)[0])  # the new driver makes its own
        with pytest.raises(ConfigMismatchError) as refused:
            await second.ensure_holders()
        message = str(refused.value)
        for instance in ("holder-0", "holder-1", "holder-2"):
            assert (f"{instance} was made with max_state_bytes={CONFIG.max_state_bytes}, "
                    f"yours gives 4096") in message

    world.run(scenario())


@pytest.mark.parametrize("first_call", ["its maker's", "the job's driver's"])
def test_a_coordinator_made_by_a_mismatched_driver_steps_aside_for_the_jobs_config(
        world: World, first_call: str) -> None:
    # The job's coordinator died; a driver with another config made the next one by its
    # call. The holders were made with the job's config: the job's driver still snapshots
    # (simulation seed 2654), whichever of the two reaches the new coordinator first.
    second = restarted_driver(world, max_state_bytes=4096)
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        world.sim.kill(world.sim.live(COORDINATOR)[0])
        await asyncio.sleep(CONFIG.lease_s)  # the dead one's name is released
        if first_call == "its maker's":
            with pytest.raises(ConfigMismatchError, match="holder-0 was made with"):
                await second.ensure_holders()
        else:  # made, not yet attached to
            second._transport.coordinator()
        impostor = world.sim.live(COORDINATOR)[0]
        await world.snapshot(path, live)
        assert not impostor.alive
        (successor,) = world.sim.live(COORDINATOR)
        assert successor.obj._config.max_state_bytes == CONFIG.max_state_bytes
        assert sum(len(v) for v in read_snapshot(path).sessions.values()) == 6
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())
