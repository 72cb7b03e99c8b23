"""The driver releases the holders itself as a snapshot's block exits, beside its commit
(``nemo_ckpt.driver.holder_handles``): the gates open one hop sooner than by the coordinator's
release, which still follows. In-process, on virtual time (``tests.harness``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_ckpt.driver.holder_handles import HolderHandles
from nemo_ckpt.driver.snapshot_operation import SnapshotOperation
from nemo_ckpt.errors import SnapshotMismatchError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.protocol.coordinator_api import SnapshotBegun
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
        live = await world.populate()  # its ensure_holders lets the driver learn them
        direct = await _seconds_paused_after_the_block(world, live, world.path("a"))
        monkeypatch.setattr(SnapshotOperation, "_release_holders",
                            lambda self, begun: 0)
        via_coordinator = await _seconds_paused_after_the_block(world, live,
                                                                world.path("a"))
        return direct, via_coordinator

    direct, via_coordinator = world.run(scenario())
    assert direct < 0.05
    assert via_coordinator >= COMMIT_TRAVELS_S


def test_a_restarted_holder_is_released_through_its_new_incarnation_once_looked_up(
        world: World) -> None:
    """No release is sent before the handles are known; a holder set the coordinator
    names anew (here: a holder restarted) is looked up again, and meanwhile the old
    handles serve (the dead incarnation's reaches nobody)."""
    transport = world.sim.transport(world.driver, world.config)
    handles = HolderHandles(lambda: transport)
    sent: list[tuple[str, int]] = []
    world.sim.on_send = lambda caller, callee, method, args: (
        sent.append((callee.name, callee.serial)) if method == "release" else None)

    def begun(holder_set: str) -> SnapshotBegun:
        return SnapshotBegun("snap", ("holder-0", "holder-1", "holder-2"), (), (), 0.0,
                             holder_set)

    async def scenario() -> tuple[int, int]:
        await world.ckpt.ensure_holders()
        counts = []
        handles.prepare(begun("set-a"))
        counts.append(handles.release(begun("set-a")))  # not looked up yet
        await asyncio.sleep(0.1)
        counts.append(handles.release(begun("set-a")))
        old = next(a for a in world.sim.live(HOLDER) if a.name == "holder-0")
        world.sim.kill(old)
        await world.ckpt.ensure_holders()  # a new holder-0 on the same node
        new = next(a for a in world.sim.live(HOLDER) if a.name == "holder-0")
        handles.prepare(begun("set-b"))
        counts.append(handles.release(begun("set-b")))  # the old handles meanwhile
        await asyncio.sleep(0.1)
        counts.append(handles.release(begun("set-b")))
        assert counts == [0, 3, 3, 3]
        return old.serial, new.serial

    old, new = world.run(scenario())
    # The last instance first: the coordinator releases in instance order.
    assert [name for name, _ in sent[:3]] == ["holder-2", "holder-1", "holder-0"]
    assert [serial for name, serial in sent if name == "holder-0"] == [old, old, new]


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
