"""States NeMo RL's own ledger produces that the integration does not hold on yet
(issue 52, points 1 to 3), shown on the rewritten double (``nemo_ckpt.testing.nemo_rl``),
which now produces them as NeMo RL's ledger does. Each is a strict xfail naming its point
of the issue: it fails today the way NeMo RL's ledger makes the integration fail, and
passes once the integration holds."""

from __future__ import annotations

import pytest

from nemo_ckpt.testing.nemo_rl import (
    PublishedGroups,
    RecoveryGranularity,
    RolloutAttemptStatus,
    publish_group,
)
from tests.harness import World
from tests.integrations.test_nemo_rl import Job

pytestmark = pytest.mark.timeout(60)


@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "issue 52 point 1: a turn-level group of PROMPT_GROUP granularity is in the inventory, "
    "its sessions are handed to prepare_for_restart, and the ledger abandons it whole and "
    "raises 'Gym restored episodes are not owned by dispatched turn-level rollouts': the "
    "restore fails whole"))
def test_a_restore_with_a_prompt_group_granularity_turn_level_group_succeeds_and_retires_it(
        world: World) -> None:
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        whole = await job.dispatch("g1", "tools/replica-0",
                                   granularity=RecoveryGranularity.PROMPT_GROUP)
        single = await job.dispatch("g2", "tools/replica-0", generations=1)
        for ep in (*whole, *single):
            await job.turn("tools/replica-0", ep, 0)
        await job.snapshot(path)
        world.ckpt.shutdown()
        await world.ckpt.ensure_holders()
        await job.load()
        async with job.env.restored(path) as restored:
            async with job.barrier.checkpoint() as cut:
                plan = await job.env.prepare_for_restart(cut, restored)
        # g2 continues; g1 starts over whole, and its restored sessions are retired.
        assert plan.restored_gym_episodes == {("tools/replica-0", single[0].rollout_id, 0)}
        assert [s.current_attempt.status for s in job.ledger.get_group("g1").siblings] == [
            RolloutAttemptStatus.ABANDONED] * 2
        held = {r.episode.rollout_id for r in await (await world.client("holder-0")).sessions()}
        assert held == {single[0].rollout_id}

    world.run(scenario())


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "issue 52 point 2: schema 4 has no gym_checkpoint_retirements, so retire_dropped() "
    "retires nothing and an abandoned group's sessions stay on the holder"))
def test_retire_dropped_retires_an_abandoned_groups_sessions_with_a_schema_4_ledger(
        world: World) -> None:
    job = Job(world)  # the schema-4 ledger: no retirement queue

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        await job.dispatch("g1", "tools/replica-0")
        async with job.barrier.mutation() as cut:
            job.ledger.abandon_unsealed(cut, "g1")
        await job.env.retire_dropped()
        assert await (await world.client("holder-0")).sessions() == []

    world.run(scenario())


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "issue 52 point 3: a published group has left the ledger (discard_group) while its "
    "staging rows stay until trained; the check reports them as orphans"))
def test_a_published_groups_staging_rows_are_not_orphans_at_a_snapshot(world: World) -> None:
    job = Job(world)
    published = PublishedGroups()

    async def scenario() -> dict[str, object]:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0")
        running = await job.dispatch("g2", "tools/replica-0", generations=1)
        await job.turn("tools/replica-0", running[0], 0)
        for index, ep in enumerate(eps):
            await job.turn("tools/replica-0", ep, 0)
            await job.seal("tools/replica-0", "g1", index, ep)
        async with job.barrier.mutation() as cut:
            publish_group(cut, job.ledger, published, "g1")
        return await job.snapshot(world.path("step-1"))

    metrics = world.run(scenario())
    assert published.staging_keys() <= set(job.staging.rows)  # still to be trained
    assert metrics["orphan_staging_rows"] == 0
