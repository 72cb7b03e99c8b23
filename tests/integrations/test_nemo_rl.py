"""NeMo RL's ledger, barrier, cut and staging partition (the test double in
``nemo_ckpt.testing.nemo_rl``) through ``nemo_ckpt.integrations.nemo_rl``, on the
in-process job (``tests.harness``): the seed's call order with NeMo RL's own cut, the
check's scope, the restore's hand-over to ``prepare_for_restart``, deadlines and the
classes of errors."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.errors import (
    BackendUnavailableError,
    SnapshotMismatchError,
    StagingListingError,
    StagingListingTimeoutError,
)
from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from nemo_ckpt.testing.nemo_rl import (
    DataPlaneCheckpointBarrier,
    RecoveryGranularity,
    RecoveryTargetLevel,
    RolloutAttemptStatus,
    RolloutRecoveryLedger,
    RolloutRecoveryLedgerWithRetirements,
    StagingPartition,
)
from tests.harness import World

pytestmark = pytest.mark.timeout(60)

OWNERS = {"tools/replica-0": "holder-0", "tools/replica-1": "holder-1",
          "tools/replica-2": "holder-1"}


class Job:
    """A NeMo RL job on the in-process world: its ledger, barrier and staging
    partition, and Gym's workers turning rollouts on their owners' holders."""

    def __init__(self, world: World, ledger: RolloutRecoveryLedger | None = None) -> None:
        self.world = world
        self.ledger = RolloutRecoveryLedger() if ledger is None else ledger
        self.barrier = DataPlaneCheckpointBarrier()
        self.staging = StagingPartition()
        self.env = NemoRlEnvironmentCheckpoint(
            world.ckpt, ledger=lambda: self.ledger, staging=self.staging.list_keys,
            owners=OWNERS)

    async def dispatch(self, group: str, owner: str, generations: int = 2,
                       level: RecoveryTargetLevel = RecoveryTargetLevel.TURN,
                       granularity: RecoveryGranularity = RecoveryGranularity.SIBLING
                       ) -> list[Ep]:
        async with self.barrier.mutation() as cut:
            prompt = len(self.ledger) + 1
            record = self.ledger.reserve_group(
                cut, group_id=group, prompt_id=str(prompt), prompt_payload={"idx": prompt},
                expected_generations=generations, target_step=1, start_weight_version=0,
                recovery_granularity=granularity, restore_level=level)
            self.ledger.mark_group_dispatched(cut, group, gym_instance_id=owner)
        client = await self.world.client(OWNERS[owner])
        eps = [Ep(*record.gym_episode(i)) for i in range(generations)]
        for ep in eps:
            await client.open(ep, b"s0")
        return eps

    async def turn(self, owner: str, ep: Ep, n: int) -> None:
        """One turn: its staging row written inside the turn, before it commits."""
        client = await self.world.client(OWNERS[owner])
        async with client.turn(ep) as turn:
            key = f"{ep.capture_key}/row{n}"
            async with self.barrier.mutation() as cut:
                self.staging.put(cut, key, b"tokens")
            turn.complete(f"t{n}".encode(), f"s{n + 1}".encode(), [key])

    async def seal(self, owner: str, group: str, index: int, ep: Ep) -> None:
        """Gym finished the sibling: its session closed, RL seals its rows itself."""
        client = await self.world.client(OWNERS[owner])
        record = await client.close(ep)
        keys = sorted({k for k in record.staging_keys})
        async with self.barrier.mutation() as cut:
            gate = self.ledger.get_group(group).gate_rollout_id(index)
            self.ledger.mark_sibling_sealed(
                cut, group, generation_index=index, gate_rollout_id=gate,
                receipt={"rollout_id": gate,
                         "manifest": [{"staging_key": k} for k in keys]},
                reward=1.0, mask_sample=False)

    async def load(self) -> None:
        """The job restarted: RL's ledger and staging as last saved, each group's prompt
        bound again from the dataset, as NeMo RL's controller does after a load."""
        ledger_state, staging_state = self.saved
        self.ledger = type(self.ledger)()
        self.staging = StagingPartition()
        self.staging.rows = dict(staging_state)
        async with self.barrier.mutation("recovery_restore") as cut:
            self.ledger.load_state_dict(cut, ledger_state)
            for record in self.ledger.groups():
                prompt = int(record.prompt_id)
                self.ledger.bind_runtime_prompt(cut, record.group_id, {"idx": prompt})

    async def restart(self) -> None:
        """The job crashes (its actors with it); a new one starts holders and loads RL's
        ledger and staging as last saved (``load``)."""
        self.world.ckpt.shutdown()
        await self.world.ckpt.ensure_holders()
        await self.load()

    async def snapshot(self, path: Path, **kwargs: Any) -> dict[str, Any]:
        """The seed's call order, verbatim, with NeMo RL's cut; RL's half saved too."""
        async with self.env.snapshot(path, **kwargs) as snapshot:
            async with self.barrier.checkpoint() as cut:
                if snapshot is not None:
                    await snapshot.check_against_cut(cut)
                self.saved = (self.ledger.state_dict(), dict(self.staging.rows))
        assert snapshot is not None
        return snapshot.metrics(0.0)


def test_a_snapshot_with_rollouts_mid_turn_sealed_and_of_other_groups_commits(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> dict[str, Any]:
        await world.ckpt.ensure_holders()
        turn_level = await job.dispatch("g1", "tools/replica-0")
        other = await job.dispatch("g2", "tools/replica-1", level=RecoveryTargetLevel.SIBLING)
        for n in range(2):
            for ep in turn_level:
                await job.turn("tools/replica-0", ep, n)
            await job.turn("tools/replica-1", other[0], n)
        await job.seal("tools/replica-0", "g1", 1, turn_level[1])
        return await job.snapshot(path)

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
        metrics = world.run(scenario())
    assert (environment_dir(path) / "manifest.json").exists()
    # g1's open sibling is checked; g2's sessions are RL's to start over.
    assert metrics["captured_rollouts"] == 3
    assert metrics["outside_scope_rollouts"] == 2
    # The sealed sibling's rows stay in staging until trained: not orphans.
    assert metrics["orphan_staging_rows"] == 0
    assert "orphan" not in caplog.text and "staging row" not in caplog.text


def test_a_turn_level_session_at_an_attempt_rl_does_not_expect_fails_the_snapshot(
        world: World) -> None:
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0", generations=1)
        client = await world.client("holder-0")
        await client.close(eps[0])
        await client.open(eps[0].next_attempt(), b"s0")  # RL still expects attempt 0
        await job.snapshot(path)

    with pytest.raises(SnapshotMismatchError, match="wrong_attempt"):
        world.run(scenario())
    assert not (environment_dir(path) / "manifest.json").exists()


def test_a_restore_continues_turn_level_rollouts_on_their_owners_and_drops_the_rest(
        world: World) -> None:
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        g1 = await job.dispatch("g1", "tools/replica-0")
        g3 = await job.dispatch("g3", "tools/replica-2", generations=1)
        other = await job.dispatch("g2", "tools/replica-1", level=RecoveryTargetLevel.SIBLING)
        for n in range(2):
            for ep in g1:
                await job.turn("tools/replica-0", ep, n)
            await job.turn("tools/replica-2", g3[0], n)
            await job.turn("tools/replica-1", other[0], n)
        await job.seal("tools/replica-0", "g1", 1, g1[1])
        await job.snapshot(path)
        # The job crashes; a new one loads RL's ledger and staging, then restores.
        await job.restart()
        async with job.env.restored(path) as restored:
            async with job.barrier.checkpoint() as cut:
                plan = await job.env.prepare_for_restart(cut, restored)
                cleared = job.staging.keep_only(cut, plan.keep_staging_keys)
        assert restored.continued_attempts == {
            ("tools/replica-0", g1[0].rollout_id, 0), ("tools/replica-2", g3[0].rollout_id, 0)}
        assert plan.restored_gym_episodes == restored.continued_attempts
        assert {(i, r) for i, r, _ in plan.dropped} == {("holder-1", ep.rollout_id)
                                                        for ep in other}
        # RL keeps the continued sessions' rows and the sealed sibling's; clears g2's.
        assert plan.keep_staging_keys == {f"{g1[0].capture_key}/row0",
                                          f"{g1[0].capture_key}/row1",
                                          f"{g1[1].capture_key}/row0",
                                          f"{g1[1].capture_key}/row1",
                                          f"{g3[0].capture_key}/row0",
                                          f"{g3[0].capture_key}/row1"}
        assert cleared == {f"{other[0].capture_key}/row{n}" for n in range(2)}
        # The ledger continues g1's open sibling as Gym's next attempt, on its owner.
        sibling = job.ledger.get_group("g1").siblings[0].current_attempt
        assert (sibling.status, sibling.gym_attempt) == (RolloutAttemptStatus.RESERVED, 1)
        async with job.barrier.mutation() as cut:
            job.ledger.mark_group_dispatched(cut, "g1", generation_indices=[0],
                                             gym_instance_id="tools/replica-0")
        # Gym continues it from its last saved turn; g2's sessions are gone.
        client = await world.client("holder-0")
        record = await client.get(g1[0].next_attempt())
        assert record.turns == (b"t0", b"t1")
        await job.turn("tools/replica-0", g1[0].next_attempt(), 2)
        held = {r.episode.rollout_id for r in await (await world.client("holder-1")).sessions()}
        assert held == {g3[0].rollout_id}

    world.run(scenario())


def test_a_restore_onto_one_replica_fewer_starts_the_vanished_owners_rollouts_over(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """Case 15 of issue 50: the ledger raised a bare RuntimeError at every such restore."""
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        g1 = await job.dispatch("g1", "tools/replica-0", generations=1)
        g3 = await job.dispatch("g3", "tools/replica-2", generations=1)
        for n in range(2):
            await job.turn("tools/replica-0", g1[0], n)
            await job.turn("tools/replica-2", g3[0], n)
        await job.snapshot(path)
        # The job crashes; the new one runs one Gym replica fewer: tools/replica-2 is gone.
        await job.restart()
        fewer = {o: i for o, i in OWNERS.items() if o != "tools/replica-2"}
        env = NemoRlEnvironmentCheckpoint(world.ckpt, ledger=lambda: job.ledger,
                                          staging=job.staging.list_keys, owners=fewer)
        with caplog.at_level(logging.WARNING, logger="nemo_ckpt"):
            async with env.restored(path) as restored:
                async with job.barrier.checkpoint() as cut:
                    plan = await env.prepare_for_restart(cut, restored)
                    cleared = job.staging.keep_only(cut, plan.keep_staging_keys)
        # The other owner's rollout continues; the vanished owner's is named, not handed.
        assert restored.continued_attempts == {("tools/replica-0", g1[0].rollout_id, 0)}
        assert plan.vanished == {("tools/replica-2", g3[0].rollout_id, 0)}
        assert ("holder-1", g3[0].rollout_id, 0) in plan.dropped
        warned = [r.getMessage() for r in caplog.records if "no longer names" in
                  r.getMessage()]
        assert len(warned) == 1
        assert "tools/replica-2" in warned[0] and g3[0].rollout_id in warned[0]
        assert cleared == {f"{g3[0].capture_key}/row{n}" for n in range(2)}
        # RL's ledger starts it over (abandoned; a fresh attempt goes to a live owner)...
        g3_attempt = job.ledger.get_group("g3").siblings[0].current_attempt
        assert g3_attempt.status is RolloutAttemptStatus.ABANDONED
        # ... and its restored session was retired once the restore went live.
        assert await (await world.client("holder-1")).sessions() == []
        async with job.barrier.mutation() as cut:
            job.ledger.prepare_incomplete_retry(cut, "g3")
            job.ledger.mark_group_dispatched(cut, "g3", gym_instance_id="tools/replica-0")
            job.ledger.mark_group_dispatched(cut, "g1", generation_indices=[0],
                                             gym_instance_id="tools/replica-0")
        client = await world.client("holder-0")
        record = await client.get(g1[0].next_attempt())
        assert record.turns == (b"t0", b"t1")
        await job.turn("tools/replica-0", g1[0].next_attempt(), 2)
        restarted = Ep(*job.ledger.get_group("g3").gym_episode(0))
        await client.open(restarted, b"s0")
        # The next snapshot, with the owners the job has, commits.
        job.env = env
        metrics = await job.snapshot(world.path("step-2"))
        assert metrics["captured_rollouts"] == 2

    world.run(scenario())


def test_a_snapshot_and_a_restore_with_a_deadline_log_no_tracing_context_error(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """Case 14 of issue 50: the driver's span was entered in ``asyncio.wait_for``'s task
    and left in the caller's; OpenTelemetry logged "Failed to detach context" each time."""
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> tuple[Ep, frozenset[tuple[str, str, int]]]:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0", generations=1)
        await job.turn("tools/replica-0", eps[0], 0)
        await job.snapshot(path, timeout_s=30.0)
        await job.restart()
        async with job.env.restored(path, timeout_s=30.0) as restored:
            async with job.barrier.checkpoint() as cut:
                await job.env.prepare_for_restart(cut, restored)
        return eps[0], frozenset(restored.continued_attempts)

    with caplog.at_level(logging.DEBUG):
        ep, continued = world.run(scenario())
    assert continued == {("tools/replica-0", ep.rollout_id, 0)}
    assert "Failed to detach context" not in caplog.text
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]


def test_dropped_episodes_are_named_at_a_snapshot_and_retired_by_retire_dropped(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    # A ledger newer than schema 4's first: it queues the Gym episodes it drops.
    job = Job(world, RolloutRecoveryLedgerWithRetirements())
    ledger = job.ledger
    assert isinstance(ledger, RolloutRecoveryLedgerWithRetirements)

    async def scenario() -> frozenset[tuple[str, str, int]]:
        await world.ckpt.ensure_holders()
        eps = await job.dispatch("g1", "tools/replica-0")
        async with job.barrier.mutation() as cut:
            job.ledger.abandon_unsealed(cut, "g1")
        with caplog.at_level(logging.INFO, logger="nemo_ckpt"):
            metrics = await job.snapshot(world.path("step-1"))
        assert metrics["outside_scope_rollouts"] == 2
        retired = await job.env.retire_dropped()
        sent: dict[str, list[tuple[str, int]]] = {}
        for owner, rollout_id, attempt in retired:
            sent.setdefault(owner, []).append((rollout_id, attempt))
        ledger.mark_gym_retired(sent)
        assert await (await world.client("holder-0")).sessions() == []
        assert {r for _, r, _ in retired} == {ep.rollout_id for ep in eps}
        return retired

    retired = world.run(scenario())
    assert {o for o, _, _ in retired} == {"tools/replica-0"}
    assert "of episodes RL dropped are not retired yet" in caplog.text
    assert ledger.gym_checkpoint_retirements({"tools/replica-0"}) == {
        "tools/replica-0": ()}


def test_a_staging_listing_past_the_callers_deadline_is_transient_and_commits_nothing(
        world: World) -> None:
    job = Job(world)
    path = world.path("step-1")

    async def hang() -> frozenset[str]:
        await asyncio.sleep(30)
        return frozenset()

    job.env = NemoRlEnvironmentCheckpoint(world.ckpt, ledger=lambda: job.ledger,
                                          staging=hang, owners=OWNERS)

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        await job.dispatch("g1", "tools/replica-0")
        await job.snapshot(path, timeout_s=2.0)

    with pytest.raises(StagingListingTimeoutError, match="missed the snapshot's deadline") \
            as caught:
        world.run(scenario())
    assert job.env.is_unavailable(caught.value)
    assert not (environment_dir(path) / "manifest.json").exists()


def test_a_failing_staging_listing_is_not_transient(world: World) -> None:
    job = Job(world)

    async def broken() -> frozenset[str]:
        raise KeyError("partition gone")

    job.env = NemoRlEnvironmentCheckpoint(world.ckpt, ledger=lambda: job.ledger,
                                          staging=broken, owners=OWNERS)

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        await job.dispatch("g1", "tools/replica-0")
        await job.snapshot(world.path("step-1"))

    with pytest.raises(StagingListingError, match="partition gone") as caught:
        world.run(scenario())
    assert not job.env.is_unavailable(caught.value)


def test_a_pause_past_the_callers_deadline_aborts_and_is_transient(world: World) -> None:
    job = Job(world)
    path = world.path("step-1")

    async def scenario() -> None:
        await world.ckpt.ensure_holders()
        await job.dispatch("g1", "tools/replica-0")
        for delays in world.holder_delays().values():
            delays.set("pause", 5.0)
        try:
            await job.snapshot(path, timeout_s=1.0)
        finally:
            for delays in world.holder_delays().values():
                delays.set("pause", 0)

    with pytest.raises(BackendUnavailableError, match="deadline of 1.0s") as caught:
        world.run(scenario())
    assert job.env.is_unavailable(caught.value)
    assert not (environment_dir(path) / "manifest.json").exists()
    world.run(asyncio.sleep(10))  # the aborted pause ends; turns run again
    world.run(job.turn("tools/replica-0", Ep(*job.ledger.get_group("g1").gym_episode(0)), 0))


def test_construction_names_each_missing_method_of_the_ledger(world: World) -> None:
    class OldLedger:
        def expected_staging_keys(self) -> set[str]:
            return set()

    with pytest.raises(TypeError, match="has no gym_checkpoint_inventory, prepare_for_restart"):
        NemoRlEnvironmentCheckpoint(world.ckpt, ledger=OldLedger(),
                                    staging=StagingPartition().list_keys, owners=OWNERS)
    with pytest.raises(TypeError, match="staging= must be an async callable"):
        NemoRlEnvironmentCheckpoint(world.ckpt, ledger=RolloutRecoveryLedger(),
                                    staging=frozenset(), owners=OWNERS)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="owners= must map each RL owner id"):
        NemoRlEnvironmentCheckpoint(world.ckpt, ledger=RolloutRecoveryLedger(),
                                    staging=StagingPartition().list_keys, owners={})


def test_importing_the_integration_imports_no_nemo_rl_and_no_ray() -> None:
    import subprocess
    import sys

    code = ("import sys, nemo_ckpt.integrations.nemo_rl, nemo_ckpt.testing.nemo_rl; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'nemo_rl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
