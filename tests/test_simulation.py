"""The deterministic simulation itself: a seed replays exactly, and the invariants catch
the bugs they are there for (a check that cannot fail proves nothing). The 10,000
schedules run in ``make test`` as their own step (``python -m tests.simulation``)."""

from __future__ import annotations

import asyncio
import io
import os
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from actors.session_holder import SessionHolder
from nemo_ckpt.ray_checkpoint import RayEnvironmentCheckpoint, RaySnapshot
from nemo_ckpt.testing.sim import SimActor, SimWorld
from tests import simulation

pytestmark = pytest.mark.timeout(300)


def test_a_seed_replays_exactly() -> None:
    for seed in (3, 26, 574):
        first = simulation.run_one(seed, tracing=True)
        again = simulation.run_one(seed, tracing=True)
        assert first.trace == again.trace and first.trace
        assert (first.violations, first.faults) == (again.violations, again.faults)


def test_holders_that_ignore_aborts_are_caught_and_the_seed_printed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def ignore(self: SessionHolder, operation_id: str) -> None:
        del self, operation_id

    monkeypatch.setattr(SessionHolder, "abort", ignore)
    out = io.StringIO()
    with redirect_stdout(out):
        code = simulation.main(["--schedules", "120", "--jobs", "1"])
    text = out.getvalue()
    assert code == 1
    assert re.search(r"case (2|3) holders left paused by a .*: first at seed \d+", text)
    seed = int(re.search(r"replay: \.venv/bin/python -m tests\.simulation --replay (\d+)",
                         text).group(1))  # type: ignore[union-attr]
    assert simulation.run_one(seed).violations  # the printed seed shows it again


def test_a_snapshot_committed_despite_its_failed_check_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    original = RaySnapshot.check_against_cut

    async def forgetful(self: RaySnapshot, cut: object) -> None:
        try:
            await original(self, cut)  # type: ignore[arg-type]
        finally:
            self.refused = None  # the bug of case 10: a caught refusal is forgotten

    monkeypatch.setattr(RaySnapshot, "check_against_cut", forgetful)
    # ... and the later guard that refuses a snapshot no passing check vouched for.
    monkeypatch.setattr(RayEnvironmentCheckpoint, "_unchecked", lambda *args: None)
    total, _, bad = simulation.run_many(0, 150, jobs=1)
    cases = {simulation.case_of(v) for r in bad for v in r.violations}
    assert "10 refused snapshot committed" in cases


def _blocking_world() -> tuple[SimWorld, SimActor]:
    world = SimWorld(seed=7, nodes=1)
    actor = world.new_actor("worker", "w", "node-0")
    return world, actor


def test_blocking_work_outlives_its_cancelled_caller(tmp_path: Path) -> None:
    world, actor = _blocking_world()
    runtime = world.runtime(actor)
    target = tmp_path / "written"

    async def main() -> None:
        caller = world.spawn(actor, runtime.run_blocking(target.write_bytes, b"done"))
        await asyncio.sleep(0)
        caller.cancel()  # before the thread got to it
        await asyncio.sleep(1.0)
        assert caller.cancelled()

    world.loop.run_until_complete(main())
    world.loop.close()
    assert target.read_bytes() == b"done"
    assert [name for _, _, name, _, _ in world.io_log] == ["write_bytes"]


def test_a_call_that_blocks_for_ever_is_reported_and_unblocked(tmp_path: Path) -> None:
    world, actor = _blocking_world()
    runtime = world.runtime(actor)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    world.fifos.append(str(fifo))
    reports: list[tuple[str, str, str]] = []
    world.on_blocked = lambda a, name, where: reports.append((a.name, name, where))

    def read_all(path: Path) -> bytes:
        return path.read_bytes()  # opening a FIFO with no writer waits for one

    result = world.loop.run_until_complete(world.spawn(actor, runtime.run_blocking(
        read_all, fifo)))
    world.loop.close()
    assert result == b""
    assert len(reports) == 1 and reports[0][:2] == ("w", "read_all")
    assert "opening a FIFO" in reports[0][2]


def test_every_process_reads_its_own_clocks() -> None:
    world = SimWorld(seed=11, nodes=2)
    world.clock_skew_s, world.clock_rate = 3600.0, 0.1
    a, b = world.new_actor("holder", "a", "node-0"), world.new_actor("holder", "b", "node-1")
    clock_a, clock_b = world.runtime(a).clock, world.runtime(b).clock
    start = (clock_a.wall(), clock_b.wall(), clock_a.monotonic(), clock_b.monotonic())
    world.loop.advance(100.0)
    wall_a, wall_b = clock_a.wall() - start[0], clock_b.wall() - start[1]
    assert abs(start[0] - start[1]) > 1.0  # steady offsets differ
    assert 90.0 <= wall_a <= 110.0 and 90.0 <= wall_b <= 110.0 and wall_a != wall_b
    assert clock_a.monotonic() - start[2] == pytest.approx(wall_a)  # one rate, both clocks
    world.loop.close()
