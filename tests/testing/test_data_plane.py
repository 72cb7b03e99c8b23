"""The reference data plane: its barrier, its ledger, and its save and restore.

Most tests drive ``ReferenceDataPlane`` in this process (fast and precise); the last
ones drive the Ray actor on the session cluster through ``DataPlaneBarrier``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.cut import DataPlaneMutationCut, check_capture_against_cut
from nemo_ckpt.errors import SnapshotMismatchError, StaleCutError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.interfaces import RestoredEnvironmentRollouts
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.testing import (
    DATA_PLANE_FILE,
    CutInProgressError,
    DataPlaneBarrier,
    DataPlaneFileError,
    DataPlaneRestoreError,
    LedgerError,
    ReferenceDataPlane,
    RolloutStatus,
    start_data_plane,
    trajectory_result,
)

pytestmark = pytest.mark.timeout(30)


def plane(latency: float = 0.0) -> tuple[ReferenceDataPlane, DataPlaneBarrier]:
    dp = ReferenceDataPlane(mutation_latency_s=latency)
    return dp, DataPlaneBarrier(dp)


async def finished_soon(task: asyncio.Future[Any], seconds: float = 0.2) -> bool:
    await asyncio.wait({task}, timeout=seconds)
    return task.done()


# --- the barrier --------------------------------------------------------------------------


async def test_mutations_wait_while_a_cut_is_open_and_land_after_it_exits() -> None:
    dp, barrier = plane()
    await dp.dispatch("r1", "holder-0")
    async with barrier.checkpoint() as cut:
        write = asyncio.ensure_future(dp.write_staging("r1/t0000", {"tokens": [1, 2]}))
        dispatch = asyncio.ensure_future(dp.dispatch("r2", "holder-1"))
        assert not await finished_soon(write) and not await finished_soon(dispatch)
        assert cut.staging_keys() == frozenset()
        assert cut.expected_episodes() == {"holder-0": frozenset({Ep("r1", 0)})}
    await asyncio.wait_for(asyncio.gather(write, dispatch), 2)
    assert await dp.staging_rows() == {"r1/t0000": {"tokens": [1, 2]}}
    assert [r.rollout_id for r in await dp.ledger()] == ["r1", "r2"]


async def test_the_cut_waits_for_mutations_in_flight_and_includes_them() -> None:
    dp, barrier = plane(latency=0.3)
    await dp.dispatch("r1", "holder-0")
    write = asyncio.ensure_future(dp.write_staging("r1/t0000", {"tokens": [7]}))
    await asyncio.sleep(0.05)  # the write passed the barrier and is in flight
    assert not write.done()  # still in flight as the cut is asked for (latency 0.3 s)
    async with barrier.checkpoint() as cut:
        assert write.done(), "the cut was taken while a mutation was still in flight"
        assert cut.staging_keys() == frozenset({"r1/t0000"})
        assert cut.rows_written == 1


async def test_the_cut_dies_when_the_section_exits(tmp_path: Path) -> None:
    dp, barrier = plane()
    await dp.dispatch("r1", "holder-0")
    async with barrier.checkpoint() as cut:
        cut.require_live()
        assert isinstance(cut, DataPlaneMutationCut)
    for read in (cut.require_live, cut.expected_episodes, cut.staging_keys):
        with pytest.raises(StaleCutError, match="stale"):
            read()
    with pytest.raises(StaleCutError, match="stale"):
        await barrier.save(cut, tmp_path)
    with pytest.raises(StaleCutError, match="not open"):
        await dp.save(cut.cut_id, str(tmp_path))  # the actor side refuses it too
    assert not (tmp_path / DATA_PLANE_FILE).exists()


async def test_the_cut_dies_and_mutations_resume_when_the_section_raises() -> None:
    dp, barrier = plane()
    with pytest.raises(RuntimeError, match="boom"):
        async with barrier.checkpoint() as cut:
            raise RuntimeError("boom")
    with pytest.raises(StaleCutError, match="stale"):
        cut.require_live()
    await asyncio.wait_for(dp.dispatch("r1", "holder-0"), 1)


async def test_one_cut_at_a_time() -> None:
    dp, barrier = plane()
    async with barrier.checkpoint():
        with pytest.raises(CutInProgressError, match="one cut at a time"):
            async with barrier.checkpoint():
                pass
        with pytest.raises(CutInProgressError, match="already has cut-"):
            await dp.restore("/nowhere", RestoredEnvironmentRollouts())
    async with barrier.checkpoint() as again:  # the next one, after the exit, is fine
        again.require_live()


async def test_the_cut_expects_dispatched_attempts_only_and_feeds_the_real_check() -> None:
    dp, barrier = plane()
    a = await dp.dispatch("a", "holder-0")
    b = await dp.dispatch("b", "holder-1")
    await dp.write_staging("a/t0000", {"t": 0})
    await dp.write_staging("b/t0000", {"t": 0})
    await dp.finish(b, [{"turn": 0}], ["b/t0000"])
    async with barrier.checkpoint() as cut:
        assert cut.expected_episodes() == {"holder-0": frozenset({a})}
        assert cut.staging_keys() == frozenset({"a/t0000"})  # b's row moved into its trajectory
        result = check_capture_against_cut(cut, {"holder-0": {a: frozenset({"a/t0000"})}})
        assert result.not_held == frozenset() and result.orphan_staging_keys == frozenset()
        with pytest.raises(SnapshotMismatchError, match="unexpected_episode"):
            check_capture_against_cut(cut, {"holder-1": {b: frozenset()}})


# --- the ledger ---------------------------------------------------------------------------


async def test_finish_refuses_a_stale_attempt_and_missing_rows() -> None:
    dp, _ = plane()
    ep = await dp.dispatch("r", "holder-0")
    with pytest.raises(LedgerError, match="not in the data plane"):
        await dp.finish(ep, [{"turn": 0}], ["r/t0000"])
    with pytest.raises(LedgerError, match="stale attempt"):
        await dp.finish(Ep("r", 3), [], [])
    with pytest.raises(LedgerError, match="only an abandoned rollout"):
        await dp.dispatch("r", "holder-1")
    await dp.abandon(ep)
    assert await dp.dispatch("r", "holder-1") == Ep("r", 1)
    (row,) = await dp.ledger()
    assert (row.attempt, row.instance_id, row.earlier_attempts) == (
        1, "holder-1", ((0, "holder-0", "abandoned"),))


# --- save and restore ---------------------------------------------------------------------


async def _saved_plane(path: Path) -> None:
    """A data plane at a cut: c continued-to-be, s to start over, f finished, orphan rows."""
    dp, barrier = plane()
    c = await dp.dispatch("c", "holder-0")
    s = await dp.dispatch("s", "holder-1")
    f = await dp.dispatch("f", "holder-1")
    await dp.write_staging("c/t0000", {"turn": 0})
    await dp.write_staging("c/t0001", {"turn": 1})
    await dp.write_staging("s/t0000", {"turn": 0})       # s's turn never committed
    await dp.write_staging("f/t0000", {"turn": 0, "x": 1.5})
    await dp.finish(f, [{"turn": 0, "reward": 1.0}], ["f/t0000"])
    del c, s
    async with barrier.checkpoint() as cut:
        written = await barrier.save(cut, path)
    assert written == path / DATA_PLANE_FILE


async def test_save_writes_one_json_file_atomically_and_never_pickle(tmp_path: Path) -> None:
    await _saved_plane(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [DATA_PLANE_FILE]  # no temp left
    data = json.loads((tmp_path / DATA_PLANE_FILE).read_text())
    assert (data["format"], data["version"], data["rows_written"]) == (
        "nemo-ckpt-reference-data-plane", 1, 4)
    assert sorted(data["staging"]) == ["c/t0000", "c/t0001", "s/t0000"]
    assert [t["rollout_id"] for t in data["finished"]] == ["f"]


async def test_restore_continues_exactly_the_restored_attempts_and_clears_orphans(
        tmp_path: Path) -> None:
    await _saved_plane(tmp_path)
    dp, barrier = plane()
    restored = RestoredEnvironmentRollouts(
        continued_attempts=frozenset({("holder-0", "c", 0)}),
        staging_keys=frozenset({"c/t0000", "c/t0001"}))
    report = await barrier.restore(tmp_path, restored)

    # Continued as the next attempt on its instance, as the environment restored it.
    assert report.continued == (("holder-0", Ep("c", 1)),)
    # Every other unfinished rollout starts over: abandoned, then dispatched afresh.
    assert report.restarted == ("s",)
    assert report.finished == ("f",)
    assert report.orphans_cleared == 1
    ledger = {r.rollout_id: r for r in await dp.ledger()}
    assert (ledger["c"].attempt, ledger["c"].status) == (1, RolloutStatus.DISPATCHED)
    assert ledger["c"].earlier_attempts == ((0, "holder-0", "continued"),)
    assert ledger["s"].status is RolloutStatus.ABANDONED
    assert await dp.dispatch("s", "holder-2") == Ep("s", 1)
    assert sorted(await dp.staging_rows()) == ["c/t0000", "c/t0001"]
    trajectory = (await dp.trajectories())["f"]
    assert trajectory.steps == (({"turn": 0, "reward": 1.0},), ({"turn": 0, "x": 1.5},))
    assert (await dp.stats()).rows_written == 4

    # The restored rollout then finishes with the rows its earlier attempt wrote.
    await dp.write_staging("c-a1/t0002", {"turn": 2})
    done = await dp.finish(Ep("c", 1), [{"t": 0}, {"t": 1}, {"t": 2}],
                           ["c/t0000", "c/t0001", "c-a1/t0002"])
    assert [r["turn"] for r in done.rows] == [0, 1, 2]
    async with barrier.checkpoint() as cut:
        assert cut.expected_episodes() == {"holder-2": frozenset({Ep("s", 1)})}


async def test_restore_records_a_result_handed_back_and_only_acknowledges_one_it_has(
        tmp_path: Path) -> None:
    await _saved_plane(tmp_path)
    dp, barrier = plane()
    # s finished after its one row, its result only with the backend at the cut; f was
    # recorded before the cut (its row moved out of staging), not yet acknowledged.
    results = (
        FinishedRollout("holder-1", Ep("s", 0), trajectory_result([{"turn": 0}], ["s/t0000"])),
        FinishedRollout("holder-1", Ep("f", 0), trajectory_result([{"x": 1}], ["f/t0000"])))
    restored = RestoredEnvironmentRollouts(
        continued_attempts=frozenset({("holder-0", "c", 0)}),
        staging_keys=frozenset({"c/t0000", "c/t0001", "s/t0000", "f/t0000"}))
    report = await barrier.restore(tmp_path, restored, results)

    assert report.recorded == ("s",) and report.restarted == () and report.finished == ("f",)
    ledger = {r.rollout_id: r for r in await dp.ledger()}
    assert ledger["s"].status is RolloutStatus.FINISHED
    trajectories = await dp.trajectories()
    assert trajectories["s"].steps == (({"turn": 0},), ({"turn": 0},))
    assert trajectories["f"].steps[0] == ({"turn": 0, "reward": 1.0},)  # the one recorded
    assert sorted(await dp.staging_rows()) == ["c/t0000", "c/t0001"]  # s's row moved out


async def test_restore_refuses_a_result_of_an_attempt_the_ledger_does_not_have(
        tmp_path: Path) -> None:
    await _saved_plane(tmp_path)
    dp, barrier = plane()
    stale = FinishedRollout("holder-1", Ep("s", 3), trajectory_result([], []))
    with pytest.raises(DataPlaneRestoreError,
                       match="holder-1/s-a3: a finished result, but the ledger has attempt 0"):
        await barrier.restore(tmp_path, RestoredEnvironmentRollouts(), (stale,))
    assert await dp.ledger() == []


async def test_restore_refuses_halves_from_different_cuts_and_changes_nothing(
        tmp_path: Path) -> None:
    await _saved_plane(tmp_path)
    dp, barrier = plane()
    await dp.dispatch("live", "holder-0")
    wrong = RestoredEnvironmentRollouts(
        continued_attempts=frozenset({("holder-0", "c", 1), ("holder-1", "f", 0),
                                      ("holder-0", "ghost", 0)}),
        staging_keys=frozenset({"c/t0000", "missing-row"}))
    with pytest.raises(DataPlaneRestoreError, match="does not match") as info:
        await barrier.restore(tmp_path, wrong)
    message = str(info.value)
    for expected in ("c attempt 1", "f attempt 0", "ghost", "missing-row", "4 problem(s)"):
        assert expected in message
    assert [r.rollout_id for r in await dp.ledger()] == ["live"]
    await asyncio.wait_for(dp.dispatch("next", "holder-0"), 1)  # not left frozen


async def test_restore_names_a_missing_or_corrupt_file(tmp_path: Path) -> None:
    dp, barrier = plane()
    with pytest.raises(DataPlaneFileError, match="no data-plane state"):
        await barrier.restore(tmp_path, RestoredEnvironmentRollouts())
    (tmp_path / DATA_PLANE_FILE).write_text('{"format": "something else"}')
    with pytest.raises(DataPlaneFileError, match="not a valid data-plane file"):
        await barrier.restore(tmp_path, RestoredEnvironmentRollouts())


# --- importing without Ray ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_nemo_ckpt_testing_imports_ray_only_when_an_actor_class_is_asked_for() -> None:
    # A fresh interpreter: this one has imported Ray already.
    script = (
        "import sys\n"
        "import nemo_ckpt.testing, nemo_ckpt.testing.virtual_time, actors.sim\n"
        "from nemo_ckpt.testing import ReferenceDataPlane, StaticCut, reference_trajectory\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
        "from nemo_ckpt.testing import DataPlaneActor\n"
        "print('ray' in sys.modules, type(DataPlaneActor).__name__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "True ActorClass(ReferenceDataPlane)"]


# --- the Ray actor ------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_the_actor_holds_a_remote_write_back_until_the_cut_exits(
        cluster: Any, tmp_path: Path) -> None:
    import ray

    dp = start_data_plane()
    try:
        barrier = DataPlaneBarrier(dp)
        ep = await dp.dispatch.remote("r", "holder-0")
        async with barrier.checkpoint() as cut:
            write = asyncio.ensure_future(_awaited(dp.write_staging.remote("r/t0000", [1])))
            assert not await finished_soon(write, 0.5)
            assert cut.expected_episodes() == {"holder-0": frozenset({ep})}
            await barrier.save(cut, tmp_path)
            # The actor's own error class, not Ray's wrapper.
            with pytest.raises(CutInProgressError, match="one cut at a time"):
                async with barrier.checkpoint():
                    pass
        await asyncio.wait_for(write, 5)
        assert (await dp.stats.remote()).rows_written == 1
        assert json.loads((tmp_path / DATA_PLANE_FILE).read_text())["staging"] == {}
    finally:
        ray.kill(dp)


async def _awaited(ref: Any) -> Any:
    return await ref
