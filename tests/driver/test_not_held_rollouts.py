"""Rollouts RL expects that a snapshot does not hold: counted in its figures either way,
but a warning only for those lost since the checkpoint's previous snapshot held them (with
a node or a holder); one dispatched and not opened yet, a normal queue, is logged at DEBUG
(issue 36). In-process (``actors.sim``): the real driver, coordinator and holders."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.testing import StaticCut
from nemo_ckpt.transport import HOLDER
from tests.harness import World, cut_of

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[World]:
    j = World(tmp_path)
    try:
        yield j
    finally:
        j.close()


def cut_with_queued(live: dict[str, list[Ep]], queued: Ep) -> StaticCut:
    """RL's cut of ``live`` (after ``populate``) that also expects ``queued`` on holder-0,
    dispatched and not opened yet (so without staging rows)."""
    full = cut_of(live)
    return StaticCut({i: set(eps) | ({queued} if i == "holder-0" else set())
                      for i, eps in live.items()}, set(full.staging_keys()))


def lines(caplog: pytest.LogCaptureFixture, level: int, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "nemo_ckpt" and r.levelno == level and what in r.getMessage()]


def test_a_dispatched_rollout_not_opened_yet_is_counted_and_logged_at_debug_not_warned(
        job: World, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="nemo_ckpt")
    queued = Ep("queued", 0)

    async def scenario() -> list[float]:
        live = await job.populate()
        counts = []
        for step in (1, 2):  # the second has a previous snapshot, which did not hold it
            async with job.ckpt.snapshot(job.path(f"step-{step}")) as snap:
                assert snap is not None
                await snap.check_against_cut(cut_with_queued(live, queued))
            counts.append(snap.metrics(0.0)["not_held_rollouts"])
        return counts

    assert job.run(scenario()) == [1, 1]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    debug = lines(caplog, logging.DEBUG, "rollout(s) RL dispatched are not opened yet")
    assert len(debug) == 2 and all(line.endswith(": holder-0/queued") for line in debug)


def test_a_rollout_the_previous_snapshot_held_that_is_gone_now_is_warned_as_lost(
        job: World, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="nemo_ckpt")
    queued = Ep("queued", 0)

    async def scenario() -> float:
        live = await job.populate()
        await job.snapshot(job.path("step-1"), live)
        (victim,) = [a for a in job.sim.live(HOLDER) if a.name == "holder-1"]
        job.sim.kill(victim)  # its two sessions go with it
        await job.ckpt.ensure_holders()  # a new, empty holder-1
        caplog.clear()
        async with job.ckpt.snapshot(job.path("step-2")) as snap:
            assert snap is not None
            await snap.check_against_cut(cut_with_queued(live, queued))
        return snap.metrics(0.0)["not_held_rollouts"]

    assert job.run(scenario()) == 3
    (warning,) = lines(caplog, logging.WARNING, "previous snapshot or restore")
    assert "2 rollout(s) RL expects that were held at this job's previous snapshot or " \
           "restore are held no more (lost with a node or a holder)" in warning
    assert lines(caplog, logging.WARNING, "queued") == []
    assert warning.endswith(": holder-1/holder-1-r0, holder-1/holder-1-r1")
    (debug,) = lines(caplog, logging.DEBUG, "rollout(s) RL dispatched are not opened yet")
    assert debug.endswith("1 rollout(s) RL dispatched are not opened yet; they start over "
                          "after a crash: holder-0/queued")


def test_a_rollout_a_restore_made_live_that_is_gone_at_the_next_snapshot_is_warned_as_lost(
        job: World, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> list[Ep]:
        live = await job.populate()
        await job.snapshot(job.path("step-1"), live)
        job.ckpt.shutdown()  # the job's actors die; a restarted job restores
        await asyncio.sleep(10.0)  # until Ray has released their names
        async with job.ckpt.restored(job.path("step-1")) as restored:
            continued = {i: [Ep(r, a).next_attempt() for i2, r, a in
                             sorted(restored.continued_attempts) if i2 == i] for i in live}
        (victim,) = [a for a in job.sim.live(HOLDER) if a.name == "holder-2"]
        job.sim.kill(victim)
        await job.ckpt.ensure_holders()
        caplog.clear()
        async with job.ckpt.snapshot(job.path("step-2")) as snap:
            assert snap is not None
            await snap.check_against_cut(StaticCut(
                {i: set(eps) for i, eps in continued.items()},
                set(cut_of(live).staging_keys())))
        return continued["holder-2"]

    lost = job.run(scenario())
    (warning,) = lines(caplog, logging.WARNING, "previous snapshot or restore")
    assert warning.endswith(": " + ", ".join(f"holder-2/{ep.capture_key}" for ep in lost))
