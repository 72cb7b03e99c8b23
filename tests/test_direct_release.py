"""The driver releases the holders itself as a snapshot's block exits, beside its commit
(``nemo_ckpt.holder_handles``): the gates open one hop sooner than by the coordinator's
release, which still follows. In-process, on virtual time (``tests.harness``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_ckpt import RayEnvironmentCheckpoint
from nemo_ckpt.coordinator_api import SnapshotBegun
from nemo_ckpt.errors import SnapshotMismatchError
from nemo_ckpt.holder_handles import HolderHandles
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.transport import HOLDER, Actor, Runtime
from tests.harness import World, cut_of

pytestmark = pytest.mark.timeout(60)

COMMIT_TRAVELS_S = 0.5  # the driver's commit to the coordinator, on a slow link


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    w.sim.message_delay = lambda target, method, reply: (
        COMMIT_TRAVELS_S if method == "commit_snapshot" and not reply else 0.001)
    yield w
    w.close()


async def _seconds_paused_after_the_block(world: World, live: dict[str, list[Ep]],
                                          path: Path) -> float:
    """One snapshot whose block waits a little; returns how long after the block ended
    the last holder's gate opened."""
    ended: list[float] = []

    async def block() -> None:
        await asyncio.sleep(0.1)
        ended.append(world.sim.loop.time())

    snapshot = world.sim.spawn(world.driver, world.snapshot(path, live, block))
    while not ended or set(world.states().values()) != {HolderState.RUNNING}:
        await asyncio.sleep(0.001)
    opened = world.sim.loop.time()
    await snapshot
    return opened - ended[0]


def test_the_driver_releases_the_holders_one_hop_before_the_coordinator(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> tuple[float, float]:
        live = await world.populate()
        await _seconds_paused_after_the_block(world, live, world.path("a"))  # handles
        direct = await _seconds_paused_after_the_block(world, live, world.path("a"))
        monkeypatch.setattr(RayEnvironmentCheckpoint, "_release_holders",
                            lambda self, begun: 0)
        via_coordinator = await _seconds_paused_after_the_block(world, live,
                                                                world.path("a"))
        return direct, via_coordinator

    direct, via_coordinator = world.run(scenario())
    assert direct < 0.05
    assert via_coordinator >= COMMIT_TRAVELS_S


def test_the_first_snapshot_and_a_changed_holder_set_wait_for_the_handles(
        world: World) -> None:
    """Handles are looked up in the background: no release is sent before they are
    known, and a holder set the coordinator names anew (a holder restarted, added or
    lost) drops the old set's handles until its own are looked up."""
    transport = world.sim.transport(world.driver, world.config)
    handles = HolderHandles(lambda: transport)
    sent: list[tuple[str, str]] = []
    world.sim.on_send = lambda caller, callee, method, args: (
        sent.append((callee.name, args[0])) if method == "release" else None)

    def begun(snapshot_id: str, holder_set: str) -> SnapshotBegun:
        return SnapshotBegun(snapshot_id, ("holder-0", "holder-1", "holder-2"), (), (),
                             0.0, holder_set)

    async def scenario() -> list[int]:
        await world.populate()
        counts = []
        handles.prepare(begun("snap-1", "set-a"))
        counts.append(handles.release(begun("snap-1", "set-a")))  # not looked up yet
        await asyncio.sleep(0.1)
        counts.append(handles.release(begun("snap-1", "set-a")))
        handles.prepare(begun("snap-2", "set-b"))
        counts.append(handles.release(begun("snap-2", "set-a")))  # another set's name
        counts.append(handles.release(begun("snap-2", "set-b")))
        return counts

    assert world.run(scenario()) == [0, 3, 0, 0]
    # The last instance first: the coordinator releases in instance order.
    assert sent == [("holder-2", "snap-1"), ("holder-1", "snap-1"), ("holder-0", "snap-1")]


def test_a_snapshot_that_fails_its_check_releases_no_holder_before_its_abort(
        world: World) -> None:
    sent: list[str] = []
    world.sim.on_send = lambda caller, callee, method, args: (
        sent.append(method) if caller is world.driver and callee.kind == HOLDER else None)

    async def scenario() -> None:
        live = await world.populate()
        await world.snapshot(world.path("a"), live, lambda: asyncio.sleep(0.1))
        assert sent.count("release") == 3  # its handles were looked up in its block
        wrong = {**live, "holder-0": live["holder-0"][:1]}
        with pytest.raises(SnapshotMismatchError):
            async with world.ckpt.snapshot(world.path("a")) as snap:
                assert snap is not None
                await snap.check_against_cut(cut_of(wrong))

    world.run(scenario())
    assert sent.count("release") == 3  # only the committed snapshot's



class _Names:
    """A transport as the lookup and the release use it: names to handles, blocking
    work on a thread, and the messages sent."""

    def __init__(self) -> None:
        self.runtime = Runtime()
        self.sent: list[tuple[str, str, tuple[object, ...]]] = []

    def holder(self, instance_id: str) -> Actor:
        return Actor(HOLDER, instance_id, None)

    def send(self, actor: Actor, method: str, *args: object) -> None:
        self.sent.append((actor.name, method, args))


def test_a_lookup_cut_short_by_its_event_loop_ending_is_made_again() -> None:
    """A driver whose snapshots each run in an ``asyncio.run`` of their own: the loop
    that started a lookup may end before it finishes, and the next snapshot looks again."""
    names = _Names()
    handles = HolderHandles(lambda: names)  # type: ignore[arg-type, return-value]
    begun = SnapshotBegun("snap-1", ("holder-0",), (), (), 0.0, "set-a")

    async def start() -> None:
        handles.prepare(begun)  # asyncio.run cancels the lookup as it ends

    async def again() -> int:
        handles.prepare(begun)
        await asyncio.sleep(0.2)
        return handles.release(begun)

    asyncio.run(start())
    assert asyncio.run(again()) == 1
    assert names.sent == [("holder-0", "release", ("snap-1",))]
