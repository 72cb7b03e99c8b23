"""``manager.restore()`` hands over as data (``RestoreHandover``): the rollouts that
continue with the episode to take the next turn on, their owner, instance and turns
restored; those that start over and why; the rows kept; the newer snapshots passed
over. On the in-process job with NeMo RL's test double, and ``hand_over`` pure."""

from __future__ import annotations

import logging
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt import (
    ContinuedRollout,
    ManagedSnapshot,
    RestartedRollout,
    RestoredEnvironmentRollouts,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.manager.restoring import hand_over
from nemo_ckpt.storage.shards import RolloutIndexEntry
from nemo_ckpt.testing.nemo_rl import RecoveryGranularity
from tests.harness import World
from tests.manager.test_rollout_manager import Job, damage_a_shard

pytestmark = pytest.mark.timeout(90)


def test_restore_returns_each_continued_rollouts_episode_owner_instance_and_turns(
        rooted_world: World) -> None:
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root)

    async def scenario() -> tuple[Any, dict[str, Ep], Any]:
        await rooted_world.ckpt.ensure_holders()
        eps = {"g0": await job.rollout("g0", "replica-0", 2),
               "g1": await job.rollout("g1", "replica-1", 3)}
        taken = await job.manager.snapshot()
        handover = await (await job.crashed()).manager.restore()
        assert handover is not None
        # The worker takes its next turn on the episode handed over, where it says.
        first = handover.continued_by_id()[eps["g1"].rollout_id]
        record = await (await rooted_world.client(first.instance_id)).get(first.episode)
        assert len(record.turns) == first.turns
        return taken, eps, handover

    taken, eps, handover = rooted_world.run(scenario())
    assert handover.snapshot == taken and handover.path == taken.path
    assert handover.continued == (
        ContinuedRollout(eps["g0"].rollout_id, 1, "replica-0", "holder-0", 2),
        ContinuedRollout(eps["g1"].rollout_id, 1, "replica-1", "holder-1", 3))
    assert handover.continued[0].episode == eps["g0"].next_attempt()
    assert handover.restarted == ()
    assert handover.kept_staging_keys == {f"{eps['g0'].capture_key}/row{n}" for n in range(2)} \
        | {f"{eps['g1'].capture_key}/row{n}" for n in range(3)}
    assert (handover.passed_over, handover.dropped) == ((), None)
    with pytest.raises(FrozenInstanceError):
        handover.continued = ()  # type: ignore[misc]


def test_a_prompt_group_groups_rollout_starts_over_as_abandoned_with_its_group(
        rooted_world: World) -> None:
    """NeMo RL's ledger abandons a PROMPT_GROUP-granularity group whole at a restore: its
    captured rollout is handed over as starting over for that reason, not as one RL
    merely did not continue, and its session is retired."""
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root)

    async def scenario() -> tuple[dict[str, Ep], Any, list[Any]]:
        await rooted_world.ckpt.ensure_holders()
        eps = {"g0": await job.rollout("g0", "replica-0", 2),
               "g1": await job.rollout("g1", "replica-1", 1,
                                       RecoveryGranularity.PROMPT_GROUP)}
        await job.manager.snapshot()
        handover = await (await job.crashed()).manager.restore()
        held = await (await rooted_world.client("holder-1")).sessions()
        return eps, handover, held

    eps, handover, held = rooted_world.run(scenario())
    abandoned = eps["g1"]
    assert [c.rollout_id for c in handover.continued] == [eps["g0"].rollout_id]
    assert handover.restarted == (
        RestartedRollout(abandoned.rollout_id, 0, "holder-1", "abandoned_by_rl_group"),)
    assert handover.restarted[0].why == (
        "captured, but RL's ledger abandons its whole group at the restore (PROMPT_GROUP "
        "granularity): the group starts over and this session was retired")
    assert held == []


def test_latest_passes_over_a_damaged_newer_snapshot_and_the_hand_over_names_it(
        rooted_world: World, caplog: pytest.LogCaptureFixture) -> None:
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root)

    async def scenario() -> tuple[Any, Any, Any]:
        await rooted_world.ckpt.ensure_holders()
        _, older, newer = await job.two_snapshots("g0")
        damage_a_shard(newer)
        return older, newer, await (await job.crashed()).manager.restore()

    with caplog.at_level(logging.INFO, logger="nemo_ckpt"):
        older, newer, handover = rooted_world.run(scenario())
    assert handover.snapshot.path == older.path
    assert [s.path for s in handover.passed_over] == [newer.path]
    assert handover.dropped == (
        f"restoring {older.path}: 1 newer rollout snapshot(s) are not restored, and the "
        f"rollouts' progress they hold is dropped: {Path(newer.path).name} (periodic)")
    assert handover.dropped in caplog.text
    assert [c.turns for c in handover.continued] == [1]


SNAP = ManagedSnapshot(3, "/ckpt/rollout-3", None, None)


def entry(instance: str, rid: str, attempt: int, turns: int) -> RolloutIndexEntry:
    return RolloutIndexEntry(instance, rid, attempt, turns, [], "shard-0")


@dataclass(frozen=True)
class Plan:
    restored_gym_episodes: frozenset[tuple[str, str, int]]
    keep_staging_keys: frozenset[str]
    dropped: frozenset[tuple[str, str, int]] = frozenset()
    vanished: frozenset[tuple[str, str, int]] = frozenset()
    abandoned: frozenset[tuple[str, str, int]] = frozenset()


def test_the_hand_over_names_why_each_other_rollout_starts_over() -> None:
    captured = [entry("holder-0", "r-kept", 0, 4), entry("holder-0", "r-dropped", 1, 2),
                entry("holder-1", "r-gone", 0, 5), entry("holder-0", "r-group", 0, 3)]
    plan = Plan(frozenset({("tools/0", "r-kept", 0)}), frozenset({"r-kept/row0"}),
                dropped=frozenset({("holder-0", "r-dropped", 1), ("holder-1", "r-gone", 0),
                                   ("holder-0", "r-group", 0)}),
                vanished=frozenset({("tools/9", "r-gone", 0)}),
                abandoned=frozenset({("tools/0", "r-group", 0)}))
    handover = hand_over(SNAP, RestoredEnvironmentRollouts(), plan, captured,
                         {"tools/0": "holder-0"}, (), None)
    assert handover.continued == (ContinuedRollout("r-kept", 1, "tools/0", "holder-0", 4),)
    assert handover.restarted == (
        RestartedRollout("r-dropped", 1, "holder-0", "not_continued_by_rl"),
        RestartedRollout("r-gone", 0, "tools/9", "owner_gone"),
        RestartedRollout("r-group", 0, "holder-0", "abandoned_by_rl_group"))
    assert handover.restarted[1].why == ("RL's ledger gives it to an owner this job no "
                                         "longer has (owners=)")
    assert handover.kept_staging_keys == {"r-kept/row0"}


def test_without_rls_plan_the_hand_over_is_what_the_environment_restored() -> None:
    restored = RestoredEnvironmentRollouts(
        continued_attempts=frozenset({("holder-1", "r1", 0)}), staging_keys=frozenset({"k"}))
    handover = hand_over(SNAP, restored, None, [entry("holder-1", "r1", 0, 6)], None, (), None)
    assert handover.continued == (ContinuedRollout("r1", 1, "holder-1", "holder-1", 6),)
    assert (handover.restarted, handover.kept_staging_keys) == ((), frozenset({"k"}))
