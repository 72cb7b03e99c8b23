"""The coordinator's fan-out through relays (``actors.coordinator.holders``, from
``relay_min_holders`` holders on), in-process under virtual time
(``actors.sim``): what a user sees is what a flat fan-out gives them, and a
relay that dies mid-phase fails only its group's calls, as those holders' own deaths
would, without leaving any holder paused. (The simulation kills relays at random points
too: ``tests/simulation/faults.py``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.sim import SimActor
from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.snapshot_files import read_snapshot
from nemo_ckpt.transport import COORDINATOR, HOLDER, RELAY
from tests.harness import CONFIG, World

pytestmark = pytest.mark.timeout(60)

NODES = 5  # groups of ceil(sqrt(5)) = 3 and 2 holders: two relays


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path, nodes=NODES, config=CONFIG.model_copy(update={"relay_min_holders": 2}))
    try:
        yield w
    finally:
        w.close()


def _relays(world: World) -> list[SimActor]:
    return [a for a in world.sim.actors if a.kind == RELAY]


def test_a_snapshot_and_restore_through_relays_keep_every_holders_sessions(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)
        assert len(_relays(world)) == 2  # the coordinator called its holders through them
        loaded = read_snapshot(path)
        assert {i: {r.episode for r in rs} for i, rs in loaded.sessions.items()} == {
            i: set(eps) for i, eps in live.items()}
        assert set(world.states().values()) == {HolderState.RUNNING}
        fresh = world.checkpoint(world.sim.new_actor("driver", "driver-2", "node-0"),
                                 CONFIG.model_copy(update={"namespace": "restored",
                                                           "relay_min_holders": 2}))
        async with fresh.restored(path) as restored:
            continued = set(restored.continued_attempts)
        assert continued == {(i, ep.rollout_id, ep.attempt)
                             for i, eps in live.items() for ep in eps}

    world.run(scenario())


def test_a_relay_dying_mid_pause_fails_its_groups_holders_and_resumes_every_holder(
        world: World) -> None:
    path = world.path("ckpt")

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(path, live)  # relays made and used once
        reached: list[str] = []

        def die_after_first(caller: SimActor, callee: SimActor, m: str,
                            args: tuple[Any, ...]) -> None:
            if caller.kind == RELAY and m == "begin_snapshot" and not reached:
                reached.append(callee.name)
                world.sim.kill(caller)  # right after passing the first begin on

        world.sim.on_send = die_after_first
        with pytest.raises(BackendUnavailableError) as failed:
            await world.snapshot(path, live)
        world.sim.on_send = None
        # The dead relay's whole group failed, by holder, as unreachable via the relay.
        failures = failed.value.failures
        assert reached[0] in failures and 2 <= len(failures) <= 3
        assert all("relay" in str(e) for e in failures.values())
        assert world.ckpt.is_unavailable(failed.value)
        # The abort reached every holder, the one the dead relay had paused included.
        assert set(world.states().values()) == {HolderState.RUNNING}
        assert len(world.holders()) == NODES
        await world.snapshot(path, live)  # the retry works, through a new relay

    world.run(scenario())


def test_failures_behind_different_relays_are_aggregated_not_first_wins(
        world: World) -> None:
    async def scenario() -> None:
        live = await world.populate()
        killed: list[str] = []
        groups = [["holder-0", "holder-1", "holder-2"], ["holder-3", "holder-4"]]

        def kill_one_per_group(target: SimActor, m: str, args: tuple[Any, ...]) -> None:
            if m == "begin_snapshot" and target.kind == HOLDER and not any(
                    target.name in g and set(g) & set(killed) for g in groups):
                killed.append(target.name)
                world.sim.kill(target)

        world.sim.on_deliver = kill_one_per_group
        with pytest.raises(BackendUnavailableError, match="begin_snapshot failed on 2 holders"
                           ) as failed:
            await world.snapshot(world.path("ckpt"), live)
        assert sorted(failed.value.failures) == sorted(killed)
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())


def test_an_abort_reaches_every_holder_directly_so_no_dead_relay_keeps_a_group_paused(
        world: World) -> None:
    async def scenario() -> None:
        live = await world.populate()
        killed: list[str] = []
        aborts: list[tuple[str, str]] = []

        def kill_a_holder(target: SimActor, m: str, args: tuple[Any, ...]) -> None:
            if m == "begin_snapshot" and target.name == "holder-4" and not killed:
                killed.append(target.name)
                world.sim.kill(target)
                for relay in world.sim.live(RELAY):  # dead before the abort, unseen
                    world.sim.kill(relay)

        def note_aborts(caller: SimActor, callee: SimActor, m: str,
                        args: tuple[Any, ...]) -> None:
            if m == "abort" or (m == "relay_call" and args and args[0] == "abort"):
                aborts.append((caller.kind, callee.name))

        world.sim.on_deliver = kill_a_holder
        world.sim.on_send = note_aborts
        with pytest.raises(BackendUnavailableError):
            await world.snapshot(world.path("ckpt"), live)
        assert killed == ["holder-4"]
        assert {kind for kind, _ in aborts} <= {"driver", COORDINATOR}
        reached = {name for kind, name in aborts if kind == COORDINATOR}
        assert {f"holder-{k}" for k in range(NODES)} <= reached
        assert set(world.states().values()) == {HolderState.RUNNING}

    world.run(scenario())
