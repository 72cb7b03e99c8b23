"""Trainer and rollouts in step through a stop: the manager's final snapshot saves the
trainer's checkpoint through the job's ``save_trainer_checkpoint`` inside its barrier
section and is anchored to the step it returns, so ``restore_mode="trainer_checkpoint"``
restores the stop's snapshot with it. Without the hook, or with one that raises or runs
over, the final snapshot commits anchored to nothing, one line says why, and a restore
by the newest trainer step saved takes that step's anchor and names what it drops. On
the in-process job under virtual time with NeMo RL's test double."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt import ManagedSnapshot, TrainerCheckpoint
from nemo_ckpt.errors import SnapshotNotFoundError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.manager.stop_anchor import anchor_at_stop, hook_budget_s
from tests.harness import World
from tests.manager.test_rollout_manager import Job

pytestmark = pytest.mark.timeout(90)

BY_STEP = {"restore_mode": "trainer_checkpoint"}


def test_a_stop_with_save_trainer_checkpoint_restores_to_the_stops_anchor(
        rooted_world: World, caplog: pytest.LogCaptureFixture) -> None:
    root = rooted_world.root / "ckpt"
    job = Job(rooted_world, root, settings=BY_STEP)
    given: list[float] = []
    turns: dict[Ep, int] = {}

    async def save_trainer(within_s: float) -> TrainerCheckpoint:
        given.append(within_s)
        await asyncio.sleep(1.0)  # the trainer's write
        return TrainerCheckpoint(5, "trainer/step-5")

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        ep = await job.rollout("g0", "replica-0", 2)
        await job.manager.snapshot_at_trainer_checkpoint(4)
        await job.manager.trainer_checkpoint_saved(4)
        turns[ep] = 2
        async with job.manager.preemption(deadline_s=20.0, exit_by_deadline=False,
                                          save_trainer_checkpoint=save_trainer) as stop:
            while turns[ep] < 5:
                await job.turn("replica-0", ep, turns[ep])
                turns[ep] += 1
            stop.stop("signal SIGTERM", 143)
            await asyncio.sleep(3600)
        raise AssertionError("the body returned")

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"), \
            pytest.raises(SystemExit) as exited:
        rooted_world.run(scenario())
    assert exited.value.code == 128 + signal.SIGTERM
    # The hook had its share of the final snapshot's 17 s (20 less the exit margin).
    assert len(given) == 1 and 0 < given[0] <= 17.0 * 0.75, given
    said = [r.getMessage() for r in caplog.records if "final snapshot committed" in
            r.getMessage()]
    assert len(said) == 1 and ", anchored to trainer step 5;" in said[0], said

    async def after() -> tuple[ManagedSnapshot, Any, Any]:
        final = (await job.manager.snapshots())[0]
        fresh = Job(rooted_world, root, settings=BY_STEP)
        handover = await fresh.manager.restore(trainer_step=5)
        live = await (await rooted_world.client("holder-0")).get(next(iter(turns)).next_attempt())
        return final, handover, live

    final, handover, live = rooted_world.run(after())
    assert (final.final, final.anchor_step, final.trainer_checkpoint,
            final.unanchored_why) == (True, 5, "trainer/step-5", None)
    assert handover.snapshot == final and handover.passed_over == ()
    assert [c.turns for c in handover.continued] == [5] and len(live.turns) == 5


def stop_scenario(world: World, job: Job, hook: Any) -> Any:
    """Turns, an anchored snapshot at trainer step 4 (saved), more turns, a periodic
    snapshot, more turns, then a final snapshot with ``hook``; a fresh job's restore by
    trainer step 4 after it."""

    async def scenario() -> tuple[list[Any], Any, Any]:
        await world.ckpt.ensure_holders()
        ep = await job.rollout("g0", "replica-0", 2)
        anchored = await job.manager.snapshot_at_trainer_checkpoint(4)
        await job.manager.trainer_checkpoint_saved(4)
        await job.turn("replica-0", ep, 2)
        periodic = await job.manager.snapshot()
        await job.turn("replica-0", ep, 3)
        final = await job.manager.final_snapshot(20.0, save_trainer_checkpoint=hook)
        fresh = Job(world, job.manager.config.root, settings=BY_STEP)
        with pytest.raises(SnapshotNotFoundError) as refused:
            await fresh.manager.restore(trainer_step=5)
        handover = await fresh.manager.restore(trainer_step=4)
        return [anchored, periodic, final], handover, refused.value

    return world.run(scenario())


async def raises(within_s: float) -> int:
    raise OSError("No space left on device: trainer/step-5")


async def runs_over(within_s: float) -> int:
    await asyncio.sleep(within_s + 60.0)
    return 5


async def answers_nonsense(within_s: float) -> Any:
    return "trainer/step-5"


@pytest.mark.parametrize(("hook", "why"), [
    (None, r"no save_trainer_checkpoint was given to the manager"),
    (raises, r"save_trainer_checkpoint raised OSError: No space left on device: "
             r"trainer/step-5"),
    (runs_over, r"save_trainer_checkpoint did not return within its [\d.]+s \(cancelled; "
                r"a checkpoint it began is not anchored\)"),
    (answers_nonsense, r"save_trainer_checkpoint returned 'trainer/step-5', not the "
                       r"trainer step it saved \(an int >= 0, or a TrainerCheckpoint\)"),
], ids=["no-hook", "raises", "runs-over", "not-a-step"])
def test_a_stop_without_a_trainer_checkpoint_restores_the_newest_anchor_and_names_the_drop(
        rooted_world: World, caplog: pytest.LogCaptureFixture, hook: Any, why: str) -> None:
    job = Job(rooted_world, rooted_world.root / "ckpt", settings=BY_STEP)
    with caplog.at_level(logging.INFO, logger="nemo_ckpt"):
        taken, handover, refused = stop_scenario(rooted_world, job, hook)
    anchored, periodic, final = taken
    # The final snapshot committed all the same, anchored to nothing, saying why.
    assert (final.final, final.anchor_step) == (True, None)
    assert final.unanchored_why is not None
    assert re.fullmatch(why, final.unanchored_why), final.unanchored_why
    errors = [r.getMessage() for r in caplog.records
              if r.levelno == logging.ERROR and r.name.startswith("nemo_ckpt")]
    if hook is None:
        assert errors == []  # a job that restores `latest` needs no hook: no error
    else:
        assert errors == [
            f"final snapshot: no trainer checkpoint anchors it: {final.unanchored_why}. It "
            f"commits all the same; restore_mode='trainer_checkpoint' restores the snapshot "
            f"anchored to the newest trainer checkpoint saved, and drops this one's rollouts"]
    # Asked for a step no snapshot anchors, the restore refuses, saying what the stop did.
    assert str(refused).startswith(
        f"no environment snapshot at {rooted_world.root / 'ckpt'}: ")
    assert (f"anchored to trainer step 5 (anchored steps: [4]); the stop's final snapshot "
            f"{Path(final.path).name} is anchored to no trainer step: "
            f"{final.unanchored_why}; restore another trainer checkpoint") in str(refused)
    # By the newest trainer step saved: that step's anchor, and what it drops, named.
    assert handover.snapshot.path == anchored.path
    assert [s.path for s in handover.passed_over] == [final.path, periodic.path]
    assert handover.dropped == (
        f"restoring {anchored.path}, anchored to trainer step 4: 2 newer rollout "
        f"snapshot(s) are not restored, and the rollouts' progress they hold is dropped: "
        f"{Path(final.path).name} (the stop's final snapshot, anchored to no trainer step: "
        f"{final.unanchored_why}); {Path(periodic.path).name} (periodic)")
    warned = [r for r in caplog.records if r.getMessage() == handover.dropped]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert [c.turns for c in handover.continued] == [2]  # as trainer step 4 had them


def test_a_hook_whose_share_of_the_deadline_has_passed_is_not_called(
        caplog: pytest.LogCaptureFixture) -> None:
    called: list[float] = []

    async def save_trainer(within_s: float) -> int:
        called.append(within_s)
        return 5

    # A final snapshot of 8 s begun 7 s ago: its hook's share (6 s) passed 1 s ago.
    budget = hook_budget_s(8.0, started=100.0, now=107.0)
    with caplog.at_level(logging.ERROR, logger="nemo_ckpt"):
        anchor = asyncio.run(anchor_at_stop(save_trainer, budget))
    assert called == [] and (anchor.step, anchor.path) == (None, None)
    assert anchor.unanchored_why == ("save_trainer_checkpoint was not called: the final "
                                     "snapshot's share for it had passed (1s ago) before "
                                     "RL's half was saved")
    assert [r.getMessage() for r in caplog.records] == [
        f"final snapshot: no trainer checkpoint anchors it: {anchor.unanchored_why}. It "
        f"commits all the same; restore_mode='trainer_checkpoint' restores the snapshot "
        f"anchored to the newest trainer checkpoint saved, and drops this one's rollouts"]
