"""A job told to stop: a final snapshot whose commit parks every session (the holders
drop them, free their sandboxes and refuse new sessions and turns), through the real
driver, coordinator and holders in-process (``actors.sim``); a restore brings them back.
The same on real Ray with containers: tests/driver/test_preemption.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from nemo_ckpt.errors import JobStoppedError, SnapshotMismatchError
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.sandboxes.directories import PRIVATE_DIR
from nemo_ckpt.testing.data_plane import StaticCut
from tests.sandboxes.test_sandbox_sessions import (
    _make_repo,
    _open_with_directories,
    _turn_edits,
    _turns,
    sandbox_job,
)

pytestmark = pytest.mark.timeout(60)


def _cached_blobs(sandboxes: Path) -> list[Path]:
    """The blob files of every holder's node cache under the sandbox root."""
    return [p for p in (sandboxes / PRIVATE_DIR).rglob("blobs/**/*") if p.is_file()]


def test_a_stop_snapshot_parks_every_session_and_a_restore_brings_them_back(
        tmp_path: Path) -> None:
    job = sandbox_job(tmp_path)
    path = tmp_path / "ckpt" / "final"
    try:
        async def run() -> None:
            live, dirs = await _open_with_directories(job, rollouts=2)
            for d in dirs.values():  # large enough for the cache's files, not its memory
                (d / "data.bin").write_bytes(os.urandom(2 << 20))
            await _turns(job, dirs, 0, 2)
            assert _cached_blobs(job.sandboxes), "recorded directories fill the node cache"
            async with job.ckpt.final_snapshot(path) as snap:
                assert snap is not None and snap.captured_rollouts == 4
                await snap.check_against_cut(StaticCut(live, set()))
            assert (path / "environment" / "manifest.json").is_file()
            for name, holder in job.holders().items():
                assert await holder.sessions() == [], name
                assert len(holder._parts.sandboxes) == 0, name
                assert holder._parts.sandboxes.cache.memory_bytes == 0, name
                assert holder.current == (HolderState.STOPPED, None), name
            assert _cached_blobs(job.sandboxes) == [], "the node caches were swept"
            assert all(d.is_dir() for d in dirs.values()), "the workers' directories stay"
            instance = sorted(job.holders())[0]
            client = await job.client(instance)
            ep = sorted(live[instance])[0]
            with pytest.raises(JobStoppedError) as stopped:
                async with client.turn(ep):
                    raise AssertionError("a stopped holder runs no turn")
            assert "this job was stopped" in str(stopped.value)
            assert "restore from it" in str(stopped.value)
            with pytest.raises(JobStoppedError):
                await client.open(Ep("new-rollout", 0), b"s0")
            assert {h.state for h in await job.ckpt.holders()} == {HolderState.STOPPED}

            async with job.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 4
            for inst, rollout_id, attempt in restored.continued_attempts:
                c = await job.client(inst)
                nxt = Ep(rollout_id, attempt + 1)
                assert (await c.get(nxt)).turns == (b"t0", b"t1")
                async with c.turn(nxt) as turn:
                    turn.complete(b"t2", b"s3")
            assert {h.state for h in await job.ckpt.holders()} == {HolderState.RUNNING}

        job.run(run())
    finally:
        job.close()


def test_a_stop_snapshot_that_is_refused_parks_nothing(tmp_path: Path) -> None:
    job = sandbox_job(tmp_path)
    try:
        async def run() -> None:
            live, dirs = await _open_with_directories(job, rollouts=1)
            await _turns(job, dirs, 0, 1)
            wrong = StaticCut({i: set() for i in live}, set())  # RL expects none of them
            with pytest.raises(SnapshotMismatchError):
                async with job.ckpt.final_snapshot(tmp_path / "ckpt" / "final") as snap:
                    assert snap is not None
                    await snap.check_against_cut(wrong)
            assert not (tmp_path / "ckpt" / "final" / "environment" / "manifest.json").exists()
            await _turns(job, dirs, 1, 1)  # every session runs on
            for holder in job.holders().values():
                assert len(await holder.sessions()) == 1
                assert holder.current == (HolderState.RUNNING, None)

        job.run(run())
    finally:
        job.close()


def test_a_turn_in_flight_at_a_stop_is_captured_as_of_its_last_commit_and_runs_again(
        tmp_path: Path) -> None:
    """Issue 50, row 9: a session still mid-turn at a stop snapshot's drain deadline was
    not captured, so the final snapshot (the newest) lost every turn it had committed.
    Now it is captured as of its last committed turn: its directory as that turn left
    it, its staging rows only (the row its turn in flight wrote is an orphan); the late
    commit is refused, and after the restore the turn runs again."""
    job = sandbox_job(tmp_path)
    path = tmp_path / "ckpt" / "final"
    try:
        async def run() -> None:
            await job.ckpt.ensure_holders()
            instance = sorted(job.holders())[0]
            client = await job.client(instance)
            idle, busy = Ep("idle", 0), Ep("busy", 0)
            await client.open(idle, b"s0")
            work = _make_repo(job.sandboxes / "work" / "busy")
            await client.open(busy, b"s0", directory=work)
            async with client.turn(busy) as turn:
                _turn_edits(work, 0)
                turn.complete(b"t0", b"s1", ["busy/row0"])
            entered = asyncio.Event()
            release = asyncio.Event()

            async def slow_turn() -> None:
                async with client.turn(busy) as turn:
                    _turn_edits(work, 1)  # the directory changes mid-turn
                    entered.set()
                    await release.wait()
                    turn.complete(b"late", b"s2", ["busy/row1"])

            task = asyncio.ensure_future(slow_turn())
            await entered.wait()
            live = {i: set() for i in job.holders()}
            live[instance] = {idle, busy}
            cut = StaticCut(live, {"busy/row0", "busy/row1"})  # row1: the turn's, uncommitted
            async with job.ckpt.final_snapshot(path, drain_timeout_s=0.2) as snap:
                assert snap is not None
                assert snap.captured_rollouts == 2 and snap.restarted_rollouts == 0
                await snap.check_against_cut(cut)
                release.set()  # its commit comes while the snapshot is open: it waits
                await asyncio.sleep(0.5)
                assert not task.done()
            with pytest.raises(JobStoppedError):  # parked: it never counted
                await task
            async with job.ckpt.restored(path) as restored:
                assert {(i, r) for i, r, _ in restored.continued_attempts} \
                    == {(instance, "idle"), (instance, "busy")}
                assert restored.staging_keys == frozenset({"busy/row0"})
            again = await client.get(busy.next_attempt())
            assert again.turns == (b"t0",) and again.state == b"s1"
            assert again.directory is not None
            back = Path(again.directory)
            assert (back / "out-0.txt").read_text() == "output of turn 0\n"
            assert (back / "src" / "main.py").read_text() == "print('v1')\n"
            assert not (back / "out-1.txt").exists(), "the turn in flight's change is not kept"
            async with client.turn(busy.next_attempt()) as turn:  # the turn runs again
                turn.complete(b"t1", b"s2", ["busy-a1/row1"])

        job.run(run())
    finally:
        job.close()


def test_a_turn_in_flight_at_a_stop_snapshot_that_fails_commits_once_it_is_aborted(
        tmp_path: Path) -> None:
    """The other end of the wait above: a stop snapshot refused by RL's cut parks
    nothing, and the turn it captured in flight commits as after any failed snapshot."""
    job = sandbox_job(tmp_path)
    try:
        async def run() -> None:
            await job.ckpt.ensure_holders()
            instance = sorted(job.holders())[0]
            client = await job.client(instance)
            busy = Ep("busy", 0)
            await client.open(busy, b"s0")
            entered = asyncio.Event()
            release = asyncio.Event()

            async def slow_turn() -> None:
                async with client.turn(busy) as turn:
                    entered.set()
                    await release.wait()
                    turn.complete(b"t0", b"s1")

            task = asyncio.ensure_future(slow_turn())
            await entered.wait()
            wrong = StaticCut({i: set() for i in job.holders()}, set())
            with pytest.raises(SnapshotMismatchError):
                async with job.ckpt.final_snapshot(tmp_path / "ckpt" / "final",
                                                   drain_timeout_s=0.2) as snap:
                    assert snap is not None and snap.captured_rollouts == 1
                    release.set()
                    await asyncio.sleep(0.5)
                    assert not task.done()
                    await snap.check_against_cut(wrong)
            await task  # committed once the snapshot was aborted
            assert (await client.get(busy)).turns == (b"t0",)
            assert job.holders()[instance].current == (HolderState.RUNNING, None)

        job.run(run())
    finally:
        job.close()
