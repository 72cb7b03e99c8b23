"""Every call the driver makes ends by its deadline (issue 56, case 2): a coordinator
that is alive to Ray but never answers (a loaded machine) ends neither a snapshot's
commit nor the abort after it. In-process, under virtual time (``tests.harness``)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from nemo_ckpt.transport import COORDINATOR
from tests.harness import CONFIG, World, cut_of

pytestmark = pytest.mark.timeout(60)

# The driver's deadlines under the harness's config (CoordinatorLink.deadline_s).
ABORT_S = CONFIG.lease_s + CONFIG.phase_timeout_s  # the time Ray may take to tell a death
BEGIN_S = CONFIG.drain_timeout_s + 2 * CONFIG.phase_timeout_s + ABORT_S
COMMIT_S = CONFIG.persist_timeout_s + 2 * CONFIG.phase_timeout_s + ABORT_S


def hang_coordinator(world: World, seconds: float) -> None:
    """The coordinator stops answering for ``seconds``; Ray never declares it dead."""
    world.sim.stall(world.sim.live(COORDINATOR), seconds, math.inf)


def test_a_commit_the_coordinator_never_answers_ends_by_its_deadline_as_outcome_unknown(
        world: World) -> None:
    path = world.path("ckpt")
    sent: list[str] = []
    block_end: list[float] = []

    async def scenario() -> None:
        live = await world.populate()

        async def block() -> None:
            hang_coordinator(world, 10_000.0)
            world.sim.on_send = lambda caller, callee, method, args: sent.append(method)
            block_end.append(world.sim.loop.time())

        with pytest.raises(BackendUnavailableError) as raised:
            await world.snapshot(path, live, block)
        ended = world.sim.loop.time() - block_end[0]
        assert ended <= COMMIT_S + ABORT_S + 0.5, ended
        error = raised.value
        assert "got no answer by its deadline" in str(error)
        assert "may still commit" in str(error) and "Retry it" in str(error)
        assert error.timed_out and world.ckpt.is_unavailable(error)
        calls = [m for m in sent if m != "renew"]  # the lease's renewals, beside them
        assert calls[:1] == ["commit_snapshot"] and "abort" in calls
        assert not (environment_dir(path) / "manifest.json").exists()

    world.run(scenario())


def test_a_begin_the_coordinator_never_answers_fails_by_its_deadline_and_its_abort_lands(
        world: World) -> None:
    """The abort is sent at once, not behind the stuck begin or an attach: once the
    coordinator runs again it takes both, and no holder stays paused for the snapshot
    nor any claim of it stays in the folder."""
    path = world.path("ckpt")
    sent: list[str] = []

    async def scenario() -> None:
        live = await world.populate()
        hang_coordinator(world, 120.0)
        world.sim.on_send = lambda caller, callee, method, args: sent.append(method)
        began = world.sim.loop.time()
        with pytest.raises(BackendUnavailableError,
                           match=rf"did not finish begin_snapshot within {BEGIN_S:.1f}s"):
            await world.snapshot(path, live)
        assert world.sim.loop.time() - began <= BEGIN_S + ABORT_S + 0.5
        calls = [m for m in sent if m != "renew"]  # the lease's renewals, beside them
        assert calls[:2] == ["begin_snapshot", "abort"]
        await asyncio.sleep(120.0 + CONFIG.lease_s)  # the coordinator ran both, late
        assert set(world.states().values()) == {HolderState.RUNNING}
        folder = environment_dir(path)
        assert not folder.exists() or sorted(p.name for p in folder.iterdir()) == []
        await world.snapshot(path, live)  # and the next snapshot commits
        assert (environment_dir(path) / "manifest.json").exists()

    world.run(scenario())


def test_an_attach_that_answers_late_leaves_its_call_only_what_is_left_of_the_deadline(
        world: World) -> None:
    """A driver's first call is attached first; the attach spends the call's deadline,
    it has none of its own. A coordinator that answered a fresh driver's attach late and
    then never answered its ``begin_snapshot`` let the snapshot run the whole deadline
    twice before failing (simulation seed 700400: 32.2 s against 25)."""
    path = world.path("ckpt")
    late = BEGIN_S - 2.0

    async def scenario() -> None:
        live = await world.populate()
        fresh = world.checkpoint(world.sim.new_actor("driver", "driver-2", "node-0"),
                                 CONFIG)
        hang_coordinator(world, late)  # the attach is answered as this ends
        world.on_deliver("begin_snapshot", lambda coordinator: hang_coordinator(world, 120.0),
                         kind=COORDINATOR)
        began = world.sim.loop.time()
        with pytest.raises(BackendUnavailableError, match="did not finish begin_snapshot"):
            async with fresh.snapshot(path) as snap:
                if snap is not None:
                    await snap.check_against_cut(cut_of(live))
        assert world.sim.loop.time() - began <= BEGIN_S + ABORT_S + 0.5
        assert not (environment_dir(path) / "manifest.json").exists()

    world.run(scenario())


def test_a_begin_whose_coordinator_dies_and_whose_successor_hangs_ends_by_its_deadline(
        world: World) -> None:
    """The attempt that goes on to a dead coordinator's successor has what is left of
    the call's deadline, not a whole one: the deadline holds the margin for a death
    already. Given a new one, a begin whose coordinator was declared dead mid-call and
    whose successor then never answered took 31.5 s with its abort, against 25
    (simulation seed 1100396)."""
    path = world.path("ckpt")
    seen: list[str] = []

    async def scenario() -> None:
        live = await world.populate()
        first = world.sim.live(COORDINATOR)

        def hook(target: Any, method: str, args: tuple[Any, ...]) -> None:
            if target.kind != COORDINATOR or method not in ("begin_snapshot", "attach"):
                return
            if method == "begin_snapshot" and not seen:
                seen.append("death")  # declared dead 3.5 s in, as Ray does a stalled one
                world.sim.stall([target], 5.7, 3.5)
            elif method == "attach" and target not in first and "hang" not in seen:
                seen.append("hang")  # the successor takes the attach, never answers
                hang_coordinator(world, 120.0)

        world.sim.on_deliver = hook
        began = world.sim.loop.time()
        with pytest.raises(BackendUnavailableError, match="did not finish attach"):
            await world.snapshot(path, live)
        assert seen == ["death", "hang"]
        assert world.sim.loop.time() - began <= BEGIN_S + ABORT_S + 0.5
        assert not (environment_dir(path) / "manifest.json").exists()

    world.run(scenario())
