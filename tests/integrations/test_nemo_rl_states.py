"""States NeMo RL's own ledger produces that the integration holds on (issue 52, points
1 to 6 of "the integration holds on each state"), shown on the rewritten double
(``nemo_ckpt.testing.nemo_rl``), which produces them as NeMo RL's ledger does."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.errors import BackendUnavailableError, UnmappedOwnerError
from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from nemo_ckpt.testing.nemo_rl import (
    PublishedGroups,
    RecoveryGranularity,
    RolloutAttemptStatus,
    RolloutRecoveryLedgerWithRetirements,
    publish_group,
)
from tests.harness import World
from tests.integrations.test_nemo_rl import OWNERS, Job

pytestmark = pytest.mark.timeout(60)


class _WithoutGroups:
    """A ledger that cannot list its groups (``groups()`` is not part of what the
    integration requires): the integration cannot foresee what it abandons."""

    def __init__(self, ledger: Any) -> None:
        self._ledger = ledger

    def __getattr__(self, name: str) -> Any:
        if name == "groups":
            raise AttributeError(name)
        return getattr(self._ledger, name)


def _env(job: Job, **kwargs: Any) -> NemoRlEnvironmentCheckpoint:
    ledger = kwargs.pop("ledger", lambda: job.ledger)
    return NemoRlEnvironmentCheckpoint(job.world.ckpt, ledger=ledger,
                                       staging=job.staging.list_keys,
                                       owners=kwargs.pop("owners", OWNERS), **kwargs)


async def _held(world: World, instance: str) -> set[str]:
    return {r.episode.rollout_id for r in await (await world.client(instance)).sessions()}


async def _prompt_group_beside_a_sibling_group(job: Job, path: Path
                                               ) -> tuple[list[Ep], list[Ep]]:
    """A turn each of g1 (two siblings, PROMPT_GROUP granularity) and g2 (one), both
    on tools/replica-0 at TURN level, snapshotted at ``path``; then the job restarts."""
    await job.world.ckpt.ensure_holders()
    whole = await job.dispatch("g1", "tools/replica-0",
                               granularity=RecoveryGranularity.PROMPT_GROUP)
    single = await job.dispatch("g2", "tools/replica-0", generations=1)
    for ep in (*whole, *single):
        await job.turn("tools/replica-0", ep, 0)
    await job.snapshot(path)
    await job.restart()
    return whole, single


def test_a_restore_with_a_prompt_group_granularity_turn_level_group_succeeds_and_retires_it(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """Point 1: the ledger abandons such a group whole and refused its sessions: the
    restore failed whole with its ValueError."""
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> None:
        whole, single = await _prompt_group_beside_a_sibling_group(job, path)
        with caplog.at_level(logging.INFO, logger="nemo_ckpt"):
            async with job.env.restored(path) as restored:
                async with job.barrier.checkpoint() as cut:
                    plan = await job.env.prepare_for_restart(cut, restored)
        # g2 continues; g1 starts over whole, and its restored sessions are retired.
        assert plan.restored_gym_episodes == {("tools/replica-0", single[0].rollout_id, 0)}
        assert plan.abandoned == {("tools/replica-0", ep.rollout_id, 0) for ep in whole}
        assert {r for _, r, _ in plan.dropped} == {ep.rollout_id for ep in whole}
        assert [s.current_attempt.status for s in job.ledger.get_group("g1").siblings] == [
            RolloutAttemptStatus.ABANDONED] * 2
        assert await _held(world, "holder-0") == {single[0].rollout_id}
        named = [r.getMessage() for r in caplog.records if "abandons" in r.getMessage()]
        assert len(named) == 1 and all(ep.rollout_id in named[0] for ep in whole)

    world.run(scenario())


def test_a_restored_episode_the_ledger_refuses_is_retired_and_named_and_the_rest_continue(
        world: World) -> None:
    """Point 1, where the integration cannot foresee the abandonment (a ledger without
    ``groups()``): the ledger's refusal no longer fails the restore; its changes stand."""
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> None:
        whole, single = await _prompt_group_beside_a_sibling_group(job, path)
        env = _env(job, ledger=lambda: _WithoutGroups(job.ledger))
        async with env.restored(path) as restored:
            async with job.barrier.checkpoint() as cut:
                plan = await env.prepare_for_restart(cut, restored)
        assert plan.restored_gym_episodes == {("tools/replica-0", single[0].rollout_id, 0)}
        assert plan.abandoned == {("tools/replica-0", ep.rollout_id, 0) for ep in whole}
        assert plan.keep_staging_keys == {f"{single[0].capture_key}/row0"}
        sibling = job.ledger.get_group("g2").siblings[0].current_attempt
        assert (sibling.status, sibling.gym_attempt) == (RolloutAttemptStatus.RESERVED, 1)
        assert await _held(world, "holder-0") == {single[0].rollout_id}

    world.run(scenario())


def test_retire_dropped_retires_an_abandoned_groups_sessions_with_a_schema_4_ledger(
        world: World) -> None:
    """Point 2: schema 4 has no retirement queue; retire_dropped retired nothing."""
    job = Job(world)  # the schema-4 ledger: no retirement queue

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0")
        kept = await job.dispatch("g2", "tools/replica-0", generations=1)
        async with job.barrier.mutation() as cut:
            job.ledger.abandon_unsealed(cut, "g1")
        retired = await job.env.retire_dropped()
        assert retired == {("tools/replica-0", ep.rollout_id, 0) for ep in eps}
        assert await _held(world, "holder-0") == {kept[0].rollout_id}
        # RL retries the group: the fresh attempts run; nothing is retired twice.
        async with job.barrier.mutation() as cut:
            job.ledger.prepare_incomplete_retry(cut, "g1")
            job.ledger.mark_group_dispatched(cut, "g1", gym_instance_id="tools/replica-0")
        record = job.ledger.get_group("g1")
        fresh = [Ep(*record.gym_episode(i)) for i in range(2)]
        client = await world.client("holder-0")
        for ep in fresh:
            await client.open(ep, b"s0")
        assert await job.env.retire_dropped() == frozenset()
        await job.turn("tools/replica-0", fresh[0], 0)
        assert await _held(world, "holder-0") == {kept[0].rollout_id,
                                                  *(ep.rollout_id for ep in fresh)}

    world.run(scenario())


def test_retire_dropped_retires_a_discarded_groups_sessions_with_a_schema_4_ledger(
        world: World) -> None:
    """Point 2: a group that left the ledger (discard_group) while Gym held it."""
    job = Job(world)

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0")
        await job.snapshot(world.path("step-1"))  # the integration sees g1 held
        async with job.barrier.mutation() as cut:
            job.ledger.discard_group(cut, "g1")
        retired = await job.env.retire_dropped()
        assert retired == {("tools/replica-0", ep.rollout_id, 0) for ep in eps}
        assert await _held(world, "holder-0") == set()

    world.run(scenario())


def test_retire_dropped_acknowledges_the_ledgers_retirement_queue(world: World) -> None:
    """Point 2, with a newer ledger's queue: retired, then ``mark_gym_retired``."""
    job = Job(world, RolloutRecoveryLedgerWithRetirements())
    ledger = job.ledger
    assert isinstance(ledger, RolloutRecoveryLedgerWithRetirements)

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0")
        async with job.barrier.mutation() as cut:
            job.ledger.discard_group(cut, "g1")
        retired = await job.env.retire_dropped()
        assert retired == {("tools/replica-0", ep.rollout_id, 0) for ep in eps}
        assert await _held(world, "holder-0") == set()

    world.run(scenario())
    assert ledger.gym_checkpoint_retirements({"tools/replica-0"}) == {"tools/replica-0": ()}


def _published_job(world: World) -> tuple[Job, PublishedGroups]:
    job = Job(world)
    published = PublishedGroups()
    job.env = _env(job, retained=published.staging_keys)
    return job, published


async def _publish_g1(job: Job, published: PublishedGroups) -> list[Ep]:
    eps = await job.dispatch("g1", "tools/replica-0")
    for index, ep in enumerate(eps):
        await job.turn("tools/replica-0", ep, 0)
        await job.seal("tools/replica-0", "g1", index, ep)
    async with job.barrier.mutation() as cut:
        publish_group(cut, job.ledger, published, "g1")
    return eps


def test_a_published_groups_staging_rows_are_not_orphans_at_a_snapshot(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """Point 3: a published group has left the ledger while its rows stay staged until
    trained; they were reported as orphans."""
    job, published = _published_job(world)

    async def scenario() -> dict[str, Any]:
        await world.ckpt.ensure_holders()
        running = await job.dispatch("g2", "tools/replica-0", generations=1)
        await job.turn("tools/replica-0", running[0], 0)
        await _publish_g1(job, published)
        return await job.snapshot(world.path("step-1"))

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
        metrics = world.run(scenario())
    assert published.staging_keys() <= set(job.staging.rows)  # still to be trained
    assert metrics["orphan_staging_rows"] == 0
    assert "orphan" not in caplog.text


def test_a_restore_keeps_a_published_groups_staging_rows(world: World) -> None:
    """Point 3: ``RestartPlan.keep_staging_keys`` left them out, so a caller clearing
    what is not kept deleted rows still to be trained."""
    job, published = _published_job(world)
    path = world.path("step-1")

    async def scenario() -> frozenset[str]:
        await world.ckpt.ensure_holders()
        running = await job.dispatch("g2", "tools/replica-0", generations=1)
        await job.turn("tools/replica-0", running[0], 0)
        await _publish_g1(job, published)
        await job.snapshot(path)
        await job.restart()
        async with job.env.restored(path) as restored:
            async with job.barrier.checkpoint() as cut:
                plan = await job.env.prepare_for_restart(cut, restored)
                return job.staging.keep_only(cut, plan.keep_staging_keys)

    cleared = world.run(scenario())
    assert cleared == frozenset()
    assert published.staging_keys() and published.staging_keys() <= set(job.staging.rows)


class _Wire:
    """Gym's replies on their way to RL: a rollout finished in the environment (its
    session closed) that RL has not sealed yet. ``drain`` seals them, as NeMo RL's
    controller drains its on-wire Gym replies."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.replies: list[tuple[str, int, Ep, tuple[str, ...]]] = []
        self.hang = False

    async def finish(self, group: str, index: int, ep: Ep) -> None:
        record = await (await self.job.world.client(OWNERS["tools/replica-0"])).close(ep)
        self.replies.append((group, index, ep, tuple(sorted(record.staging_keys))))

    async def drain(self) -> None:
        if self.hang:
            await asyncio.sleep(3600)
        while self.replies:
            group, index, ep, keys = self.replies.pop(0)
            async with self.job.barrier.mutation() as cut:
                gate = self.job.ledger.get_group(group).gate_rollout_id(index)
                self.job.ledger.mark_sibling_sealed(
                    cut, group, generation_index=index, gate_rollout_id=gate,
                    receipt={"rollout_id": gate,
                             "manifest": [{"staging_key": k} for k in keys]},
                    reward=1.0, mask_sample=False)


def test_a_rollout_finished_but_not_sealed_at_the_snapshot_is_not_run_again(
        world: World) -> None:
    """Point 4: Gym finished it, RL had not sealed it at the cut; a restore abandoned
    it and it ran again. The snapshot now awaits RL's drain before the cut."""
    job = Job(world)
    wire = _Wire(job)
    job.env = _env(job, drain=wire.drain)
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0")
        for ep in eps:
            await job.turn("tools/replica-0", ep, 0)
        await wire.finish("g1", 0, eps[0])
        await job.snapshot(path)
        await job.restart()
        async with job.env.restored(path) as restored:
            async with job.barrier.checkpoint() as cut:
                plan = await job.env.prepare_for_restart(cut, restored)
        siblings = job.ledger.get_group("g1").siblings
        assert siblings[0].current_attempt.status is RolloutAttemptStatus.SEALED
        assert siblings[0].current_attempt.staging_keys == [f"{eps[0].capture_key}/row0"]
        assert plan.restored_gym_episodes == {("tools/replica-0", eps[1].rollout_id, 0)}
        assert f"{eps[0].capture_key}/row0" in plan.keep_staging_keys

    world.run(scenario())


def test_a_drain_past_the_snapshots_deadline_aborts_it_and_is_transient(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """Point 4's wait is bounded by the snapshot's deadline, and (point 5) no
    deadline logs OpenTelemetry's "Failed to detach context"."""
    job = Job(world)
    wire = _Wire(job)
    wire.hang = True
    job.env = _env(job, drain=wire.drain)
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        await job.dispatch("g1", "tools/replica-0")
        await job.snapshot(path, timeout_s=2.0)

    with caplog.at_level(logging.DEBUG), \
            pytest.raises(BackendUnavailableError,
                          match="RL's drain of finished rollouts .* deadline of 2.0s") as caught:
        world.run(scenario())
    assert job.env.is_unavailable(caught.value)
    assert not (environment_dir(path) / "manifest.json").exists()
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert "Failed to detach context" not in caplog.text


def test_a_restore_past_its_deadline_logs_no_tracing_context_error(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """Point 5: a restore whose preparation misses the caller's deadline."""
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0", generations=1)
        await job.turn("tools/replica-0", eps[0], 0)
        await job.snapshot(path, timeout_s=30.0)
        await job.restart()
        for delays in world.holder_delays().values():
            delays.set("prepare_restore", 5.0)
        async with job.env.restored(path, timeout_s=1.0):
            raise AssertionError("the restore must not go live past its deadline")

    with caplog.at_level(logging.DEBUG), \
            pytest.raises(BackendUnavailableError, match="deadline of 1.0s"):
        world.run(scenario())
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]


@pytest.mark.parametrize("groups", [True, False], ids=["ledger_lists_groups", "no_groups"])
def test_an_owner_missing_from_owners_fails_with_our_error_naming_the_fix(
        world: World, groups: bool) -> None:
    """Point 6: the ledger's RuntimeError came first, and ours was never seen."""
    job = Job(world)
    fewer = {o: i for o, i in OWNERS.items() if o != "tools/replica-2"}
    job.env = _env(job, owners=fewer, ledger=(lambda: job.ledger) if groups
                   else (lambda: _WithoutGroups(job.ledger)))
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        await job.dispatch("g1", "tools/replica-2", generations=1)
        await job.snapshot(path)

    with pytest.raises(UnmappedOwnerError, match="'?tools/replica-2'?.*add each RL owner id "
                                                 "to owners=") if groups else \
            pytest.raises(UnmappedOwnerError, match="add each RL owner id to owners="):
        world.run(scenario())
    assert not (environment_dir(path) / "manifest.json").exists()
