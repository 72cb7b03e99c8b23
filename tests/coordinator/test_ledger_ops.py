"""RL's ledger operations (``retire``, ``forget``) on every holder
(``actors/coordinator/ledger.py``)."""

from __future__ import annotations

import pytest

from actors.sim import SimActor
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from tests.harness import World

pytestmark = pytest.mark.timeout(60)


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
