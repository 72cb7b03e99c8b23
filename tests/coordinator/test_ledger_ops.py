"""RL's ledger operations (``retire``, ``forget``) on every holder, and on every holder
started later (``actors/coordinator/ledger.py``, ``actors/coordinator/retire_marks.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.sim import SimActor
from nemo_ckpt.errors import RetiredAttemptError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.transport import HOLDER
from tests.harness import CONFIG, World

pytestmark = pytest.mark.timeout(60)


async def _successor(world: World, instance: str) -> SimActor:
    """Kill ``instance``'s holder (its sessions and marks go with it) and have the
    coordinator start its successor; returns the dead one."""
    (victim,) = [a for a in world.sim.live(HOLDER) if a.name == instance]
    world.sim.kill(victim)
    await world.ckpt.ensure_holders()
    assert [a for a in world.sim.live(HOLDER) if a.name == instance] != [victim]
    return victim


def test_retire_reaches_a_live_holder_whose_answer_to_discovery_was_lost(
        world: World) -> None:
    """A discovery treats a holder that does not answer as lost; one whose answer was
    only lost on its way back is alive and holds sessions. A retire must reach it too:
    else the retired attempt's session stays there and its late turns are taken
    (simulation seeds 915 and 800749, issue 52's retire_dropped checker)."""

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        client = await world.client("holder-2")
        ep = Ep("r-on-holder-2", 0)
        await client.open(ep, b"s0")
        lost: list[str] = []

        def lose(target: SimActor, method: str) -> bool:
            if method == "info" and target.name == "holder-2" and not lost:
                lost.append(method)
                return True
            return False

        world.sim.lose_reply = lose
        await world.ckpt.holders()  # a discovery: holder-2's answer to it is lost
        assert lost == ["info"]
        assert await world.ckpt.retire([ep]) == [ep.capture_key]
        assert [s.episode for s in await client.sessions()] == []

    world.run(scenario())


def test_a_successor_holder_refuses_an_attempt_rl_retired_before_it_started(
        world: World) -> None:
    """RL retired an attempt; its holder died and the coordinator started another. A
    worker's open of that attempt, retried across the death, lands on the successor: it
    must be refused as the dead holder would have, not open a session of an attempt RL
    dropped (simulation seed 800362)."""

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        client = await world.client("holder-2")
        ep = Ep("r-retired", 0)
        await client.open(ep, b"s0")
        assert await world.ckpt.retire([ep]) == [ep.capture_key]
        await _successor(world, "holder-2")
        client = await world.client("holder-2")
        with pytest.raises(RetiredAttemptError,
                           match=r"^holder-2: attempt r-retired was retired by RL \(every "
                                 r"attempt up to 0 of 'r-retired' is\); open the next "
                                 r"attempt instead, or forget this one first$"):
            await client.open(ep, b"s0")
        assert await client.sessions() == []
        await client.open(ep.next_attempt(), b"s0")  # RL's next attempt opens

    world.run(scenario())


def test_a_retire_while_a_successor_holder_starts_reaches_it(world: World) -> None:
    """A retire that comes while the coordinator is starting a holder goes to the
    holders known then; the new one, started with the marks of before, gets it once it
    answers, before it is known: the retired attempt is refused there too."""

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        (victim,) = [a for a in world.sim.live(HOLDER) if a.name == "holder-2"]
        world.sim.kill(victim)
        ep = Ep("r-retired-meanwhile", 3)
        retired: list[Any] = []

        def successor(target: SimActor) -> bool:
            return target.name == "holder-2" and target is not victim

        def retire_as_it_starts(target: SimActor, method: str, args: tuple[Any, ...]) -> None:
            if method == "info" and successor(target) and not retired:
                retired.append(world.sim.spawn(world.driver, world.ckpt.retire([ep])))

        # Its answer to the coordinator's first call takes a while: the retire is done
        # before the coordinator knows it.
        world.sim.message_delay = lambda target, method, reply: (
            0.5 if reply and method == "info" and successor(target) else 0.001)
        world.sim.on_deliver = retire_as_it_starts
        await world.ckpt.ensure_holders()
        assert len(retired) == 1 and await retired[0] == []
        client = await world.client("holder-2")
        with pytest.raises(RetiredAttemptError, match="every attempt up to 3 of"):
            await client.open(Ep("r-retired-meanwhile", 2), b"s0")
        assert await client.sessions() == []

    world.run(scenario())


def test_a_successor_holder_opens_an_attempt_rl_forgot(world: World) -> None:
    """RL retired an attempt, then forgot it: the coordinator keeps no mark of it (its
    marks do not grow with every rollout RL is done with), and a successor holder opens
    that attempt again, as the holder before it would have."""

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        ep = Ep("r-forgotten", 0)
        await world.ckpt.retire([ep])
        await world.ckpt.forget([ep])
        await _successor(world, "holder-1")
        client = await world.client("holder-1")
        await client.open(ep, b"s0")
        assert [s.episode for s in await client.sessions()] == [ep]

    world.run(scenario())


@pytest.fixture
def two_marks(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path, config=CONFIG.model_copy(update={"max_retired_marks": 2}))
    try:
        yield w
    finally:
        w.close()


def test_the_coordinator_keeps_no_more_retire_marks_than_a_holder(two_marks: World) -> None:
    """``max_retired_marks`` bounds the coordinator's marks as it bounds a holder's: the
    oldest go first, so a successor holder refuses the newest retired rollouts only."""
    world = two_marks

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        for k in range(3):
            await world.ckpt.retire([Ep(f"r{k}", 0)])
        await _successor(world, "holder-0")
        client = await world.client("holder-0")
        for k in (1, 2):
            with pytest.raises(RetiredAttemptError, match=f"attempt r{k} was retired"):
                await client.open(Ep(f"r{k}", 0), b"s0")
        await client.open(Ep("r0", 0), b"s0")  # its mark was the oldest: gone

    world.run(scenario())
