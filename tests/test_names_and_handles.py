"""Handles that outlive the actor they named (issue 29): a worker's ``SessionClient``
finds its instance's current holder by name after the one it held died. In-process,
under virtual time, as ``tests/test_reliability.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.transport import HOLDER
from tests.test_reliability import World

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


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
