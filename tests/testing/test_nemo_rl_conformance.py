"""The NeMo RL conformance suite (``nemo_ckpt.testing.nemo_rl_conformance``) on our
double of NeMo RL's objects, on the in-process world: what a NeMo RL team runs on its
own ledger, barrier and staging partition (issue 52)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.testing.nemo_rl import RolloutRecoveryLedgerWithRetirements
from nemo_ckpt.testing.nemo_rl_conformance import (
    ConformanceCase,
    NemoRlFactories,
    conformance_cases,
)
from tests.harness import World

pytestmark = pytest.mark.timeout(60)

FACTORIES = NemoRlFactories(ledger_with_retirements=RolloutRecoveryLedgerWithRetirements)


class SimBackend:
    """``ConformanceBackend`` on the in-process world (``tests.harness``)."""

    instances = ("holder-0", "holder-1")

    def __init__(self, world: World) -> None:
        self.world = world
        self.checkpoint = world.ckpt

    async def client(self, instance: str) -> Any:
        return await self.world.client(instance)

    async def crash(self) -> None:
        self.world.ckpt.shutdown()
        await self.world.ckpt.ensure_holders()

    def path(self, name: str) -> Path:
        return self.world.path(name)


def test_the_suite_runs_every_scenario_and_each_retirement_case_both_ways() -> None:
    names = [case.name for case in conformance_cases(FACTORIES)]
    assert len(names) == len(set(names)) == 11
    assert sum(name.endswith("_with_the_retirement_queue") for name in names) == 2
    assert len(conformance_cases(NemoRlFactories())) == 9


@pytest.mark.parametrize("case", conformance_cases(FACTORIES), ids=str)
def test_our_double_passes_the_nemo_rl_conformance_case(world: World,
                                                        case: ConformanceCase) -> None:
    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        await case.run(SimBackend(world))

    world.run(scenario())
