"""A job told to stop keeps its rollouts (``nemo_ckpt.Preemption`` around the job's body,
``RolloutCheckpointManager.final_snapshot``), on the in-process job (``tests.harness``)
under virtual time with NeMo RL's test double: a stop, a node's drain, and a deadline the
final snapshot cannot meet; and a real SIGTERM to this process on a real event loop. The
same on real Ray, a child job sent SIGTERM and a node drained with Ray's CLI:
tests/test_preemption_demo.py."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from nemo_ckpt import Preemption
from nemo_ckpt.errors import JobStoppedError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from tests.harness import World
from tests.test_rollout_manager import OWNERS, Job

pytestmark = pytest.mark.timeout(90)


async def _run_until_stopped(job: Job, eps: dict[str, Ep], turns: dict[Ep, int],
                             trigger: asyncio.Future[None]) -> None:
    """The job's body: every rollout takes turns until the job stops; ``trigger`` fires
    once each has taken two turns past the periodic snapshot."""
    async def rollout(owner: str, ep: Ep) -> None:
        while True:
            await job.turn(owner, ep, turns[ep])
            turns[ep] += 1
            if all(n >= 4 for n in turns.values()) and not trigger.done():
                trigger.set_result(None)

    await asyncio.gather(*(rollout(owner, ep) for owner, ep in eps.items()))


def test_a_stop_takes_a_final_snapshot_that_keeps_every_committed_turn_and_exits_143(
        rooted_world: World) -> None:
    job = Job(rooted_world, rooted_world.root / "ckpt")
    turns: dict[Ep, int] = {}

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        eps = {owner: await job.rollout(f"g-{owner}", owner, 2) for owner in OWNERS}
        turns.update({ep: 2 for ep in eps.values()})
        periodic = await job.manager.snapshot()
        assert periodic is not None
        fired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # The virtual loop polls no file, so no signal reaches it: the handler's call.
        async with job.manager.preemption(deadline_s=20.0) as preemption:
            fired.add_done_callback(lambda _: preemption.stop("signal SIGTERM", 143))
            await _run_until_stopped(job, eps, turns, fired)
        raise AssertionError(f"the body returned: {preemption.reason}")

    with pytest.raises(SystemExit) as exited:
        rooted_world.run(scenario())
    assert exited.value.code == 128 + signal.SIGTERM

    async def after() -> None:
        latest = await job.manager.latest()
        assert latest is not None and latest.path.endswith(".partial") is False
        for holder in rooted_world.holders().values():
            assert holder.current == (HolderState.STOPPED, None)
            assert await holder.sessions() == []
        client = await rooted_world.client(OWNERS["replica-0"])
        with pytest.raises(JobStoppedError):
            await client.open(Ep("after-the-stop", 0), b"")
        # RL's half was saved by the same hook: the restore continues every rollout at
        # the turn it had committed when the signal came, nothing lost.
        restored = await job.manager.restore()
        assert restored is not None and restored.path == latest.path
        live = {r.episode.rollout_id: r for h in rooted_world.holders().values()
                for r in await h.sessions()}
        assert sorted(live) == sorted(ep.rollout_id for ep in turns)
        for ep, n in turns.items():
            assert live[ep.rollout_id].episode.attempt == ep.attempt + 1
            assert len(live[ep.rollout_id].turns) == n, ep

    rooted_world.run(after())


def test_a_drain_of_a_node_hosting_a_holder_stops_the_job_as_sigterm_does(
        rooted_world: World) -> None:
    job = Job(rooted_world, rooted_world.root / "ckpt")

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        eps = {owner: await job.rollout(f"g-{owner}", owner, 1) for owner in OWNERS}
        turns = {ep: 1 for ep in eps.values()}
        node = next(h.node_id for h in await rooted_world.ckpt.holders()
                    if h.instance_id == OWNERS["replica-1"])
        fired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fired.add_done_callback(lambda _: rooted_world.sim.draining.add(node))
        async with job.manager.preemption(deadline_s=20.0) as preemption:
            await _run_until_stopped(job, eps, turns, fired)
        raise AssertionError(f"the body returned: {preemption.reason}")

    with pytest.raises(SystemExit) as exited:
        rooted_world.run(scenario())
    assert exited.value.code == 143
    assert {h.current[0] for h in rooted_world.holders().values()} == {HolderState.STOPPED}


def test_a_final_snapshot_that_misses_its_deadline_leaves_the_last_committed_one(
        rooted_world: World, caplog: pytest.LogCaptureFixture) -> None:
    job = Job(rooted_world, rooted_world.root / "ckpt")
    taken: list[str] = []

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        eps = {owner: await job.rollout(f"g-{owner}", owner, 1) for owner in OWNERS}
        periodic = await job.manager.snapshot()
        assert periodic is not None
        taken.append(periodic.path)
        for delays in rooted_world.holder_delays().values():
            delays.set("capture", 30.0)  # the capture cannot end in time
        async with job.manager.preemption(deadline_s=5.0) as preemption:
            preemption.stop("signal SIGTERM", 143)
            await asyncio.gather(*(job.turn(owner, ep, 1) for owner, ep in eps.items()))
            await asyncio.sleep(60)
        raise AssertionError("the body was not cancelled")

    with caplog.at_level(logging.ERROR, logger="nemo_ckpt"), pytest.raises(SystemExit) as exited:
        rooted_world.run(scenario())
    assert exited.value.code == 143
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1 and "within 5s and was aborted" in lines[0] \
        and "last committed snapshot is untouched" in lines[0], lines
    assert "pause_capture failed on 3 holders" in lines[0]  # the phase's own deadline

    async def after() -> None:
        latest = await job.manager.latest()
        assert latest is not None and latest.path == taken[0]
        holders = rooted_world.holders()
        for instance in OWNERS.values():  # aborted: nothing parked
            assert holders[instance].current == (HolderState.RUNNING, None)
            assert len(await holders[instance].sessions()) == 1

    rooted_world.run(after())


def test_a_real_sigterm_runs_the_final_snapshot_within_its_deadline_then_exits_143() -> None:
    calls: list[float] = []
    before = signal.getsignal(signal.SIGTERM)

    async def final(seconds: float) -> None:
        calls.append(seconds)

    async def body() -> None:
        async with Preemption(final, deadline_s=7.0):
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        raise AssertionError("the body was not cancelled")

    with pytest.raises(SystemExit) as exited:
        asyncio.run(body())
    assert exited.value.code == 143
    assert len(calls) == 1 and 0 < calls[0] <= 7.0
    assert signal.getsignal(signal.SIGTERM) == before, "the handler before is back"


def test_a_job_not_told_to_stop_ends_as_its_body_does() -> None:
    async def final(seconds: float) -> None:
        raise AssertionError("no final snapshot without a stop")

    async def body() -> str:
        async with Preemption(final, deadline_s=5.0) as p:
            assert not p.requested.is_set()
        return "done"

    assert asyncio.run(body()) == "done"
