"""A job told to stop keeps its rollouts (``nemo_ckpt.Preemption`` around the job's body,
``RolloutCheckpointManager.final_snapshot``), on the in-process job (``tests.harness``)
under virtual time with NeMo RL's test double: a stop, a node's drain, and a deadline the
final snapshot cannot meet; and a real SIGTERM to this process on a real event loop. The
same on real Ray, a child job sent SIGTERM and a node drained with Ray's CLI:
tests/examples/test_preemption_demo.py."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_ckpt import Preemption
from nemo_ckpt.driver.preemption import StopBudget, drain_deadline
from nemo_ckpt.errors import JobStoppedError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from tests.harness import World
from tests.manager.test_rollout_manager import OWNERS, Job

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
        async with job.manager.preemption(deadline_s=20.0,
                                          exit_by_deadline=False) as preemption:
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
        restored = await job.restarted().manager.restore()
        assert restored is not None and restored.path == latest.path
        live = {r.episode.rollout_id: r for h in rooted_world.holders().values()
                for r in await h.sessions()}
        assert sorted(live) == sorted(ep.rollout_id for ep in turns)
        for ep, n in turns.items():
            assert live[ep.rollout_id].episode.attempt == ep.attempt + 1
            assert len(live[ep.rollout_id].turns) == n, ep

    rooted_world.run(after())


def test_a_stop_while_every_rollout_is_mid_turn_keeps_each_ones_committed_turns(
        rooted_world: World) -> None:
    """Issue 50, row 9: with 2.5 s tool calls and a 6 s deadline, every rollout was still
    mid-turn at the final snapshot's drain, none was captured, and the stop commit (the
    newest snapshot) continued 0 of 3, each of which had 2 turns committed before the
    signal. A stop snapshot captures a session mid-turn as of its last committed turn."""
    job = Job(rooted_world, rooted_world.root / "ckpt")
    turns: dict[Ep, int] = {}
    at_stop: dict[Ep, int] = {}

    async def slow_turn(owner: str, ep: Ep) -> None:
        client = await rooted_world.client(OWNERS[owner])
        async with client.turn(ep) as turn:
            n = turn.turn_count
            await asyncio.sleep(2.5)  # the tool call
            key = f"{ep.capture_key}/row{n}"
            async with job.barrier.mutation() as cut:
                job.rl.staging.put(cut, key, b"tokens")
            turn.complete(f"t{n}".encode(), f"s{n + 1}".encode(), [key])
        turns[ep] += 1

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        rollouts = {f"g{k}": f"replica-{k % 2}" for k in range(3)}
        eps = {await job.rollout(group, owner, 0): owner for group, owner in rollouts.items()}
        turns.update({ep: 0 for ep in eps})
        async with job.manager.preemption(deadline_s=6.0,
                                          exit_by_deadline=False) as preemption:
            async def rollout(ep: Ep) -> None:
                while True:
                    await slow_turn(eps[ep], ep)
                    if all(n >= 2 for n in turns.values()) and not at_stop:
                        at_stop.update(turns)
                        preemption.stop("signal SIGTERM", 143)

            await asyncio.gather(*(rollout(ep) for ep in eps))
        raise AssertionError(f"the body returned: {preemption.reason}")

    with pytest.raises(SystemExit) as exited:
        rooted_world.run(scenario())
    assert exited.value.code == 143
    assert sorted(at_stop.values()) == [2, 2, 2]

    async def after() -> None:
        latest = await job.manager.latest()
        assert latest is not None
        restored = await job.restarted().manager.restore()
        assert restored is not None and restored.path == latest.path  # the final one
        live = {r.episode.rollout_id: r for h in rooted_world.holders().values()
                for r in await h.sessions()}
        assert sorted(live) == sorted(ep.rollout_id for ep in at_stop), "3 of 3 continue"
        for ep, n in at_stop.items():
            got = live[ep.rollout_id]
            assert got.episode.attempt == ep.attempt + 1
            # Every turn whose commit succeeded, the 2 before the signal among them; a
            # commit that came after the capture was refused.
            assert len(got.turns) == turns[ep] >= n, (ep, len(got.turns), turns[ep])
            assert list(got.turns) == [f"t{k}".encode() for k in range(len(got.turns))]

    rooted_world.run(after())


def test_a_drain_of_a_node_hosting_a_holder_stops_the_job_as_sigterm_does_by_its_deadline(
        rooted_world: World, caplog: pytest.LogCaptureFixture) -> None:
    job = Job(rooted_world, rooted_world.root / "ckpt")
    stopped: list[Preemption] = []

    async def scenario() -> None:
        await rooted_world.ckpt.ensure_holders()
        eps = {owner: await job.rollout(f"g-{owner}", owner, 1) for owner in OWNERS}
        turns = {ep: 1 for ep in eps.values()}
        node = next(h.node_id for h in await rooted_world.ckpt.holders()
                    if h.instance_id == OWNERS["replica-1"])
        fired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # The cluster gives the drain a deadline 8 s away (wall clock), sooner than the
        # job's 20 s grace: the final snapshot is held to it (issue 50, row 13).
        fired.add_done_callback(
            lambda _: rooted_world.sim.draining.update({node: time.time() + 8.0}))
        async with job.manager.preemption(deadline_s=20.0,
                                          exit_by_deadline=False) as preemption:
            stopped.append(preemption)
            await _run_until_stopped(job, eps, turns, fired)
        raise AssertionError(f"the body returned: {preemption.reason}")

    with caplog.at_level(logging.WARNING, logger="nemo_ckpt"), \
            pytest.raises(SystemExit) as exited:
        rooted_world.run(scenario())
    assert exited.value.code == 143
    assert {h.current[0] for h in rooted_world.holders().values()} == {HolderState.STOPPED}
    budget = stopped[0].budget
    assert budget is not None and 7.0 < budget.deadline_s <= 8.0, budget
    said = [r.getMessage() for r in caplog.records if "taking the final snapshot" in
            r.getMessage()]
    assert len(said) == 1 and "the drain's deadline" in said[0] \
        and f"within {budget.snapshot_s:.3g}s" in said[0], said


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
        async with job.manager.preemption(deadline_s=5.0, exit_margin_s=0.5,
                                          exit_by_deadline=False) as preemption:
            preemption.stop("signal SIGTERM", 143)
            await asyncio.gather(*(job.turn(owner, ep, 1) for owner, ep in eps.items()))
            await asyncio.sleep(60)
        raise AssertionError("the body was not cancelled")

    with caplog.at_level(logging.ERROR, logger="nemo_ckpt"), pytest.raises(SystemExit) as exited:
        rooted_world.run(scenario())
    assert exited.value.code == 143
    lines = [r.getMessage() for r in caplog.records
             if r.levelno == logging.ERROR and r.name.startswith("nemo_ckpt")]
    assert len(lines) == 1 and "within 4.5s and was aborted" in lines[0] \
        and "last committed snapshot is untouched" in lines[0], lines
    assert "begin_snapshot failed on 3 holders" in lines[0]  # the phase's own deadline

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
        async with Preemption(final, deadline_s=7.0, exit_by_deadline=False):
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
        raise AssertionError("the body was not cancelled")

    with pytest.raises(SystemExit) as exited:
        asyncio.run(body())
    assert exited.value.code == 143
    assert len(calls) == 1 and 0 < calls[0] <= 7.0 - 3.0  # the exit margin kept
    assert signal.getsignal(signal.SIGTERM) == before, "the handler before is back"


def test_the_signal_handlers_there_before_the_block_are_back_after_it() -> None:
    """Issue 50, row 10: Ray's SIGTERM handler (here one of the test's) was left at the
    OS default, so a later SIGTERM killed the driver with -15 and left Ray running."""
    seen: list[int] = []

    def ours(signum: int, frame: object) -> None:
        seen.append(signum)

    async def final(seconds: float) -> None:
        del seconds

    async def quiet() -> None:
        async with Preemption(final, deadline_s=5.0, exit_by_deadline=False):
            pass

    async def stopped() -> None:
        async with Preemption(final, deadline_s=5.0, exit_by_deadline=False) as p:
            p.stop("signal SIGTERM", 143)
            await asyncio.sleep(30)

    old_term = signal.signal(signal.SIGTERM, ours)
    old_int = signal.getsignal(signal.SIGINT)
    try:
        asyncio.run(quiet())
        assert signal.getsignal(signal.SIGTERM) is ours
        assert signal.getsignal(signal.SIGINT) is old_int
        with pytest.raises(SystemExit):
            asyncio.run(stopped())
        assert signal.getsignal(signal.SIGTERM) is ours
        assert signal.getsignal(signal.SIGINT) is old_int
        os.kill(os.getpid(), signal.SIGTERM)  # reaches the handler there before
        for _ in range(100):
            if seen:
                break
            time.sleep(0.01)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old_term)


def test_a_stop_budget_leaves_the_exit_its_measured_margin_and_ends_before_the_kill() -> None:
    """Issue 50, row 11: of a 10 s grace, 10% was kept for an exit whose Ray shutdown
    took 2-3 s, and the process ended at 11.3-12.5 s (SIGKILL: 137)."""
    ten = StopBudget(10.0)
    assert ten.margin_s == 3.0  # EXIT_MARGIN_S: Ray's shutdown as measured
    assert ten.snapshot_s == 7.0
    assert ten.abort_s == 0.75  # an abort's answer, out of the margin
    assert ten.exit_s == 9.5  # a process still running then ends itself
    assert ten.snapshot_s + ten.abort_s < ten.exit_s < ten.deadline_s
    assert ten.deadline_s - (ten.snapshot_s + ten.abort_s) >= 2.0  # a shutdown's 2 s fit
    short = StopBudget(4.0)  # a short grace keeps half for the snapshot
    assert (short.margin_s, short.snapshot_s, short.exit_s) == (2.0, 2.0, 3.8)
    assert StopBudget(30.0, exit_margin_s=6.0).snapshot_s == 24.0
    assert StopBudget(10.0, exit_margin_s=0.0).snapshot_s == 10.0


def test_a_process_whose_shutdown_outlasts_the_grace_still_exits_143_before_it(
        tmp_path: Path) -> None:
    """A final snapshot that never ends, then a shutdown that would take an hour (as
    Ray's took longer than its margin): the process ends itself before the deadline
    with the signal's status, not by the scheduler's SIGKILL."""
    script = tmp_path / "job.py"
    script.write_text("""
import asyncio, sys, time
from nemo_ckpt import Preemption

async def final(seconds):
    await asyncio.sleep(3600)  # a final snapshot that never ends

async def main():
    async with Preemption(final, deadline_s=6.0, exit_margin_s=2.0):
        print("ready", flush=True)
        await asyncio.sleep(3600)

try:
    asyncio.run(main())
except SystemExit:
    time.sleep(3600)  # a shutdown that outlasts the grace
    raise
""")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGTERM)
        try:
            status = child.wait(timeout=6.0)  # the grace: the scheduler kills then
        except subprocess.TimeoutExpired:
            status = None
    finally:
        if child.poll() is None:
            child.kill()
        _, err = child.communicate()
    assert status == 143, err[-2000:]
    assert "exiting with status 143 now" in err, err[-2000:]


def test_a_drain_deadline_sooner_than_the_grace_is_the_deadline() -> None:
    """Issue 50, row 13: the drain's deadline (Ray's GCS: ms since the epoch, 0 for
    none) read on the driver's wall clock; the job's grace when none is sooner."""
    now = 1_000_000.0
    left, why = drain_deadline(25.0, [now + 30.0, None, now + 12.5], now)
    assert left == 12.5 and why == "the drain's deadline (12.5s away)"
    assert drain_deadline(25.0, [None, None], now) == (
        25.0, "the job's grace period (25s)")
    left, why = drain_deadline(25.0, [now + 40.0], now)
    assert left == 25.0 and "before the drain's deadline" in why
    # One already past on this clock (another host's clock ahead, or seen late) says
    # nothing reliable: the grace stands, and the reason names the offset.
    left, why = drain_deadline(25.0, [now - 2.0], now)
    assert left == 25.0 and "2.0s past on this host's clock" in why


def test_a_job_not_told_to_stop_ends_as_its_body_does() -> None:
    async def final(seconds: float) -> None:
        raise AssertionError("no final snapshot without a stop")

    async def body() -> str:
        async with Preemption(final, deadline_s=5.0) as p:
            assert not p.requested.is_set()
        return "done"

    assert asyncio.run(body()) == "done"
