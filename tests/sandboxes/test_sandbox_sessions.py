"""Sessions that own sandbox directories, through the real driver, coordinator and
holders in-process (``actors.sim``): recorded at turn commit, snapshotted
incrementally into the root's blob store, restored byte for byte into a fresh job."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.cli.main import main
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.errors import (
    BlobCorruptedError,
    CheckpointPathBusyError,
    CheckpointPathError,
    SandboxError,
    StartupCheckError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.checkpoint_folder import environment_dir, folder_at
from nemo_ckpt.storage.claims import STALE_FACTOR, ClaimWatch
from nemo_ckpt.storage.manifest import FORMAT_VERSION
from nemo_ckpt.storage.snapshot_files import committed_snapshots, read_manifest
from nemo_ckpt.testing.data_plane import StaticCut
from nemo_ckpt.testing.toy_env import directory_listing
from nemo_ckpt.testing.virtual_time import EPOCH
from nemo_ckpt.transport import COORDINATOR
from nemo_ckpt.trees.blob_store import BlobStore, digest_of
from nemo_ckpt.trees.collection import collect_blobs, snapshot_refs
from tests.harness import World
from tests.trees.test_trees_and_blobs import same_content, sparse_file, swap_before_open

pytestmark = pytest.mark.timeout(60)


def _config(tmp_path: Path, **options: Any) -> CheckpointConfig:
    return CheckpointConfig(**{
        "namespace": "job", "drain_timeout_s": 1.0, "lease_s": 6.0, "phase_timeout_s": 3.0,
        "persist_timeout_s": 15.0, "turn_timeout_s": 20.0,
        "checkpoint_root": tmp_path / "ckpt", "sandbox_root": tmp_path / "sandboxes",
        **options})


def sandbox_job(tmp_path: Path, seed: int = 0, **options: Any) -> World:
    """One in-process job on two nodes whose sessions own directories under its
    sandbox root."""
    return World(tmp_path, nodes=2, config=_config(tmp_path, **options), seed=seed)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[World]:
    j = sandbox_job(tmp_path)
    try:
        yield j
    finally:
        j.close()


def _make_repo(where: Path) -> Path:
    (where / "src").mkdir(parents=True)
    (where / "src" / "main.py").write_text("print('v0')\n")
    (where / "README.md").write_text("# repo\n")
    (where / "build.sh").write_text("#!/bin/sh\nmake\n")
    (where / "build.sh").chmod(0o755)
    (where / "latest").symlink_to("src/main.py")
    return where


def _turn_edits(directory: Path, t: int) -> None:
    """What one toy turn does: create, edit, rename and delete files."""
    (directory / f"out-{t}.txt").write_text(f"output of turn {t}\n" * (t + 1))
    (directory / "src" / "main.py").write_text(f"print('v{t + 1}')\n")
    if t > 0:
        os.rename(directory / f"out-{t - 1}.txt", directory / f"kept-{t - 1}.txt")
    if t > 1:
        (directory / f"kept-{t - 2}.txt").unlink()


async def _open_with_directories(job: World, rollouts: int) -> tuple[dict[str, set[Ep]],
                                                                     dict[Ep, Path]]:
    await job.ckpt.ensure_holders()
    live: dict[str, set[Ep]] = {}
    dirs: dict[Ep, Path] = {}
    for instance in sorted(job.holders()):
        client = await job.client(instance)
        live[instance] = set()
        for k in range(rollouts):
            ep = Ep(f"{instance}-r{k}", 0)
            d = _make_repo(job.sandboxes / "work" / ep.capture_key)
            record = await client.open(ep, b"s0", directory=d)
            assert record.directory == str(d.resolve())
            live[instance].add(ep)
            dirs[ep] = d
    return live, dirs


async def _turns(job: World, dirs: dict[Ep, Path], first: int, count: int) -> None:
    for instance in sorted(job.holders()):
        client = await job.client(instance)
        for ep, d in dirs.items():
            if not ep.rollout_id.startswith(instance + "-"):
                continue
            for t in range(first, first + count):
                async with client.turn(ep) as turn:
                    assert turn.directory == d.resolve()
                    _turn_edits(d, t)
                    turn.complete(f"t{t}".encode(), f"s{t + 1}".encode())


def test_a_directory_is_restored_byte_for_byte_as_its_last_committed_turn_left_it(
        tmp_path: Path) -> None:
    job = sandbox_job(tmp_path)
    path = tmp_path / "ckpt" / "step-1"
    try:
        async def first_run() -> dict[Ep, dict[str, Any]]:
            live, dirs = await _open_with_directories(job, rollouts=2)
            await _turns(job, dirs, 0, 3)
            expected = {ep: directory_listing(d) for ep, d in dirs.items()}
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(live, set()))
            await _turns(job, dirs, 3, 2)  # after the snapshot: lost in the crash
            return expected

        expected = job.run(first_run())
    finally:
        job.close()
    shutil.rmtree(tmp_path / "sandboxes")  # the crash took the node's disk, cache and all

    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> None:
            async with fresh.ckpt.restored(path) as restored:
                assert len(restored.continued_attempts) == 4
            for instance, rollout_id, attempt in restored.continued_attempts:
                client = await fresh.client(instance)
                ep = Ep(rollout_id, attempt + 1)
                record = await client.get(ep)
                assert record.directory == str(fresh.sandboxes / ep.capture_key)
                assert directory_listing(Path(record.directory)) == expected[Ep(rollout_id, 0)]
                # The continued attempt records its directory from there on.
                async with client.turn(ep) as turn:
                    assert turn.directory is not None
                    (turn.directory / "after-restore").write_text("x")
                    turn.complete(b"t", b"s")

        fresh.run(restore())
        assert {h.current[0] for h in fresh.holders().values()} == {HolderState.RUNNING}
    finally:
        fresh.close()


def _snapshot_then_move(tmp_path: Path, written: Path, moved: Path
                        ) -> dict[Ep, dict[str, Any]]:
    """Snapshot two rollouts per holder with directories into ``written``, end the job
    and its node's sandboxes, and rename the snapshot's folder to ``moved``; each
    rollout's directory listing at the snapshot."""
    job = sandbox_job(tmp_path)
    try:
        async def first_run() -> dict[Ep, dict[str, Any]]:
            live, dirs = await _open_with_directories(job, rollouts=2)
            await _turns(job, dirs, 0, 2)
            async with job.ckpt.snapshot(written) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(live, set()))
            return {ep: directory_listing(d) for ep, d in dirs.items()}

        expected: dict[Ep, dict[str, Any]] = job.run(first_run())
    finally:
        job.close()
    shutil.rmtree(tmp_path / "sandboxes")
    moved.parent.mkdir(parents=True, exist_ok=True)
    written.rename(moved)
    return expected


def test_a_snapshot_with_directories_restores_after_its_folder_is_renamed_in_its_parent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt" / "step-3"
    expected = _snapshot_then_move(tmp_path, tmp_path / "ckpt" / "tmp-step-3", path)
    assert main(["verify", str(path)]) == 0
    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> dict[Ep, dict[str, Any]]:
            async with fresh.ckpt.restored(path) as restored:
                continued = restored.continued_attempts
            got = {}
            for instance, rollout_id, attempt in continued:
                record = await (await fresh.client(instance)).get(Ep(rollout_id, attempt + 1))
                assert record.directory is not None
                got[Ep(rollout_id, attempt)] = directory_listing(Path(record.directory))
            return got

        assert fresh.run(restore()) == expected
    finally:
        fresh.close()


def test_a_snapshot_with_directories_moved_to_another_depth_is_refused_saying_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt" / "step-3"
    _snapshot_then_move(tmp_path, tmp_path / "ckpt" / "tmp" / "step-3", path)
    why = (f"snapshot {path} has sandbox directories, whose files are in its checkpoint "
           f"root's blob store, 2 level(s) above the folder it was written to; there is no "
           f"blob store at {tmp_path / 'blobs'}, so the snapshot was moved to another depth "
           f"below its root. Move it back to a folder 2 level(s) below the root (renaming "
           f"it within its parent folder is supported)")
    capsys.readouterr()
    assert main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"has 1 problem(s); a restore from it would be refused:\n  - {why}\n" in err
    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> None:
            async with fresh.ckpt.restored(path):
                pass

        with pytest.raises(CheckpointPathError) as refused:
            fresh.run(restore())
        assert str(refused.value) == why
        assert {h.current[0] for h in fresh.holders().values()} <= {HolderState.RUNNING}
    finally:
        fresh.close()


def test_a_later_snapshot_writes_only_the_files_that_changed(job: World, tmp_path: Path) -> None:
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=3)
        big = b"x" * 200_000
        for d in dirs.values():
            (d / "data.bin").write_bytes(big)  # the same big file in every sandbox
        await _turns(job, dirs, 0, 1)
        cut = StaticCut(live, set())
        async with job.ckpt.snapshot(tmp_path / "ckpt" / "a") as snap:
            assert snap is not None
            await snap.check_against_cut(cut)
        first = read_manifest(tmp_path / "ckpt" / "a")
        ep, d = next(iter(dirs.items()))
        client = await job.client(ep.rollout_id.split("-r")[0])
        async with client.turn(ep) as turn:
            (d / "README.md").write_text("# changed\n")
            turn.complete(b"t", b"s")
        async with job.ckpt.snapshot(tmp_path / "ckpt" / "b") as snap:
            assert snap is not None
            await snap.check_against_cut(cut)
        second = read_manifest(tmp_path / "ckpt" / "b")
        assert first.format_version == second.format_version == FORMAT_VERSION
        assert first.blob_store == "../blobs"
        new1 = sum(s.trees.new_blob_bytes for s in first.shards if s.trees)
        new2 = sum(s.trees.new_blob_bytes for s in second.shards if s.trees)
        # The big file went once for all six sandboxes; the second snapshot wrote the
        # changed file and the trees that changed (one per turn's sandbox), no big file.
        assert len(big) < new1 < 2 * len(big)
        assert 0 < new2 < 20_000
        store = BlobStore(str(tmp_path / "ckpt" / "blobs"), folder_at)
        assert sum(len(Path(store.describe(x)).read_bytes()) for x in store.digests()) \
            == new1 + new2

    job.run(scenario())


def test_a_turn_that_leaves_a_fifo_is_refused_and_records_nothing(job: World) -> None:
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        ep, d = next(iter(dirs.items()))
        client = await job.client(ep.rollout_id.split("-r")[0])
        with pytest.raises(SandboxError, match=r"pipe, a FIFO"):
            async with client.turn(ep) as turn:
                os.mkfifo(d / "pipe")
                turn.complete(b"t", b"s1")
        record = await client.get(ep)
        assert record.turns == () and record.state == b"s0"
        (d / "pipe").unlink()
        async with client.turn(ep) as turn:  # the session is not stuck mid-turn
            turn.complete(b"t", b"s1")
        assert (await client.get(ep)).state == b"s1"

    job.run(scenario())


def test_a_directory_outside_the_sandbox_root_is_refused(job: World, tmp_path: Path) -> None:
    async def scenario() -> None:
        await job.ckpt.ensure_holders()
        client = await job.client(sorted(job.holders())[0])
        outside = _make_repo(tmp_path / "elsewhere")
        with pytest.raises(SandboxError, match="is not inside sandbox_root"):
            await client.open(Ep("r", 0), b"", directory=outside)
        (job.sandboxes / "escape").symlink_to(outside)  # a link out does not get in
        with pytest.raises(SandboxError, match="is not inside sandbox_root"):
            await client.open(Ep("r", 0), b"", directory=job.sandboxes / "escape")
        assert await client.sessions() == []

    job.run(scenario())


def test_a_damaged_blob_refuses_the_restore_and_nothing_goes_live(tmp_path: Path) -> None:
    job = sandbox_job(tmp_path)
    path = tmp_path / "ckpt" / "step-1"
    try:
        async def first_run() -> None:
            live, dirs = await _open_with_directories(job, rollouts=1)
            await _turns(job, dirs, 0, 1)
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(live, set()))

        job.run(first_run())
    finally:
        job.close()
    store = BlobStore(str(tmp_path / "ckpt" / "blobs"), folder_at)
    readme = next(x for x in store.digests()
                  if Path(store.describe(x)).read_bytes() == b"# repo\n")
    Path(store.describe(readme)).write_bytes(b"# REPO\n")
    shutil.rmtree(tmp_path / "sandboxes")  # a new node: nothing cached
    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> None:
            with pytest.raises(BlobCorruptedError, match="does not match its digest"):
                async with fresh.ckpt.restored(path):
                    pass
            for instance in fresh.holders():
                assert await (await fresh.client(instance)).sessions() == []

        fresh.run(restore())
        leftover = [p.name for p in fresh.sandboxes.iterdir() if p.name != ".nemo-ckpt"]
        assert leftover == []  # no half-made directory is left where a session would be
    finally:
        fresh.close()


def test_sandboxes_need_a_checkpoint_root_and_snapshots_below_it(job: World,
                                                                  tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sandbox_root needs checkpoint_root"):
        CheckpointConfig(sandbox_root=tmp_path / "s")

    async def scenario() -> None:
        await job.ckpt.ensure_holders()
        with pytest.raises(CheckpointPathError,
                           match="is not below CheckpointConfig.checkpoint_root"):
            async with job.ckpt.snapshot(tmp_path / "elsewhere"):
                pass
        assert not environment_dir(tmp_path / "elsewhere").exists() or not any(
            environment_dir(tmp_path / "elsewhere").iterdir())

    job.run(scenario())


# --- collection ---------------------------------------------------------------------------


def _coordinator(job: World) -> Any:
    return job.sim.live(COORDINATOR)[0].obj


def _store(tmp_path: Path) -> BlobStore:
    return BlobStore(str(tmp_path / "ckpt" / "blobs"), folder_at)


def _referenced(tmp_path: Path) -> set[bytes]:
    store = _store(tmp_path)
    return set().union(*(snapshot_refs(p, store)
                         for p in committed_snapshots(tmp_path / "ckpt")))


def test_a_commit_collects_the_blobs_only_a_replaced_snapshot_referenced(
        job: World, tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "latest"

    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        cut = StaticCut(live, set())
        ep, d = next(iter(dirs.items()))
        client = await job.client(ep.rollout_id.split("-r")[0])
        async with client.turn(ep) as turn:
            (d / "scratch.log").write_text("only in the first snapshot\n")
            turn.complete(b"t", b"s")
        async with job.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(cut)
        scratch = digest_of(b"only in the first snapshot\n")
        assert scratch in _store(tmp_path).digests()
        async with client.turn(ep) as turn:
            (d / "scratch.log").unlink()
            turn.complete(b"t", b"s")
        async with job.ckpt.snapshot(path) as snap:  # replaces the first at that path
            assert snap is not None
            await snap.check_against_cut(cut)
        report = await _coordinator(job).collection_done()
        assert report is not None and report.removed >= 2  # the log and its tree
        present = _store(tmp_path).digests()
        assert scratch not in present
        assert present == _referenced(tmp_path)

    job.run(scenario())


def test_collection_is_refused_while_a_snapshot_holds_the_store(job: World,
                                                                tmp_path: Path) -> None:
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)

        async def block() -> None:
            with pytest.raises(CheckpointPathBusyError, match="in use by snapshot"):
                collect_blobs(tmp_path / "ckpt", clock=lambda: EPOCH + job.sim.loop.time())

        async with job.ckpt.snapshot(tmp_path / "ckpt" / "a") as snap:
            assert snap is not None
            await snap.check_against_cut(StaticCut(live, set()))
            await block()

    job.run(scenario())


def test_collection_racing_turns_and_commits_never_removes_a_referenced_blob(
        job: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector thread loops against the store (real concurrency, real files) while
    the job runs turns that change files and commits snapshots at two alternating
    paths, each commit replacing the one before at its path (and the coordinator
    collecting after it, racing the thread)."""
    stop = threading.Event()
    removed: list[int] = []  # by the thread and by the coordinator's collections
    errors: list[BaseException] = []
    remove = BlobStore.remove

    def counted(self: BlobStore, digests: Any) -> None:
        digests = list(digests)
        remove(self, digests)
        removed.append(len(digests))

    monkeypatch.setattr(BlobStore, "remove", counted)

    def collector() -> None:
        while not stop.is_set():
            try:
                collect_blobs(tmp_path / "ckpt", clock=lambda: EPOCH + job.sim.loop.time())
            except CheckpointPathBusyError:
                pass
            except BaseException as exc:  # a failure the test reports, not a hang
                errors.append(exc)
                return

    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=2)
        cut = StaticCut(live, set())
        thread = threading.Thread(target=collector, daemon=True)
        thread.start()
        try:
            for round_ in range(12):
                await _turns(job, dirs, round_, 1)
                async with job.ckpt.snapshot(tmp_path / "ckpt" / f"p{round_ % 2}") as snap:
                    assert snap is not None
                    await snap.check_against_cut(cut)
                # Every committed snapshot's blobs are in the store, whatever ran.
                store = _store(tmp_path)
                for p in committed_snapshots(tmp_path / "ckpt"):
                    assert store.missing(snapshot_refs(p, store)) == set(), (round_, p)
        finally:
            stop.set()
            thread.join(timeout=30)
        assert not errors, errors
        assert sum(removed) > 0  # the collections did remove replaced snapshots' blobs

    job.run(scenario())
    # And the latest snapshot restores byte for byte (every file verified).
    verify = [verify_snapshot(p) for p in committed_snapshots(tmp_path / "ckpt")]
    assert all(v.ok for v in verify), [v.problems for v in verify]


def test_nemo_ckpt_gc_removes_unreferenced_blobs_and_says_what(job: World, tmp_path: Path,
                                                               capsys: Any) -> None:
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        async with job.ckpt.snapshot(tmp_path / "ckpt" / "a") as snap:
            assert snap is not None
            await snap.check_against_cut(StaticCut(live, set()))
        await _coordinator(job).collection_done()

    job.run(scenario())
    store = _store(tmp_path)
    stray = tmp_path / "stray"
    stray.write_bytes(b"nobody references this")
    store.put(digest_of(b"nobody references this"), stray)
    kept = len(store.digests()) - 1
    assert main(["gc", str(tmp_path / "ckpt"), "--dry-run"]) == 0
    assert f"would remove 1 unreferenced blob(s), kept {kept}" in capsys.readouterr().out
    assert len(store.digests()) == kept + 1
    assert main(["gc", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "1 committed snapshot(s)" in out and "removed 1 unreferenced blob(s) (22 B)" in out
    assert len(store.digests()) == kept
    store.claims.hold("snap-x", "other-job", ttl_s=60)
    assert main(["gc", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert "in use by snapshot(s) ['snap-x']" in err
    assert "run gc again later, or with --wait SECONDS" in err


def test_a_gc_whose_clock_is_far_ahead_removes_no_blob_a_running_snapshot_relies_on(
        job: World, tmp_path: Path, capsys: Any) -> None:
    """Issue 23, case 1: the blobs of an unchanged sandbox were written by an older
    snapshot that retention removed; the running snapshot found them present and wrote
    no copy. A gc on a host whose clock runs 13 s ahead of the coordinator's (over two
    leases) must not take the snapshot's hold as over."""
    root = tmp_path / "ckpt"
    old, new = root / "old", root / "new"

    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        cut = StaticCut(live, set())
        async with job.ckpt.snapshot(old) as snap:
            assert snap is not None
            await snap.check_against_cut(cut)
        await _coordinator(job).collection_done()
        async with job.ckpt.snapshot(new) as snap:
            assert snap is not None
            await snap.check_against_cut(cut)
            while not any("-trees" in p.name for p in environment_dir(new).iterdir()):
                await asyncio.sleep(0.1)  # the holders persisted: they found every blob
            shutil.rmtree(old)  # retention drops the older snapshot
            ahead = 2 * job.config.lease_s + 1
            with pytest.raises(CheckpointPathBusyError, match=r"in use by snapshot\(s\)"):
                collect_blobs(root, clock=lambda: EPOCH + job.sim.loop.time() + ahead)
            assert main(["gc", str(root)]) == 1
            assert "in use by snapshot(s)" in capsys.readouterr().err

    job.run(scenario())
    store = _store(tmp_path)
    assert store.missing(snapshot_refs(str(new), store)) == set()
    assert verify_snapshot(new).ok
    assert main(["verify", str(new)]) == 0


def test_gc_told_to_wait_collects_once_a_dead_snapshots_hold_is_seen_unchanged_for_its_ttl(
        job: World, tmp_path: Path) -> None:
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        async with job.ckpt.snapshot(tmp_path / "ckpt" / "a") as snap:
            assert snap is not None
            await snap.check_against_cut(StaticCut(live, set()))
        await _coordinator(job).collection_done()

    job.run(scenario())
    store = _store(tmp_path)
    stray = digest_of(b"nobody references this")
    store.put(stray, b"nobody references this")
    store.claims.hold("snap-dead", "a-job-that-died", ttl_s=60)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(CheckpointPathBusyError, match="gave up after waiting 30s"):
        collect_blobs(tmp_path / "ckpt", clock=lambda: now[0], sleep=sleep, wait_s=30)
    assert stray in store.digests()
    now[0] = 0.0
    report = collect_blobs(tmp_path / "ckpt", clock=lambda: now[0], sleep=sleep, wait_s=100)
    assert report.removed == 1 and stray not in store.digests()
    assert 60 * STALE_FACTOR <= now[0] < 60 * STALE_FACTOR + 2


def test_gc_told_to_wait_never_collects_under_a_hold_that_is_renewed(
        job: World, tmp_path: Path) -> None:
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        async with job.ckpt.snapshot(tmp_path / "ckpt" / "a") as snap:
            assert snap is not None
            await snap.check_against_cut(StaticCut(live, set()))
        await _coordinator(job).collection_done()

    job.run(scenario())
    store = _store(tmp_path)
    stray = digest_of(b"nobody references this")
    store.put(stray, b"nobody references this")
    now = [0.0]

    def sleep(seconds: float) -> None:  # meanwhile the snapshot renews its hold
        now[0] += seconds
        store.claims.hold("snap-live", "a-job-that-runs", ttl_s=10)

    store.claims.hold("snap-live", "a-job-that-runs", ttl_s=10)
    with pytest.raises(CheckpointPathBusyError, match="snap-live"):
        collect_blobs(tmp_path / "ckpt", clock=lambda: now[0], sleep=sleep, wait_s=300)
    assert stray in store.digests()


# --- the CLI ------------------------------------------------------------------------------


def test_the_cli_shows_checks_and_diffs_each_sessions_directory(job: World, tmp_path: Path,
                                                                capsys: Any) -> None:
    a, b = tmp_path / "ckpt" / "a", tmp_path / "ckpt" / "b"

    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        cut = StaticCut(live, set())
        await _turns(job, dirs, 0, 1)
        async with job.ckpt.snapshot(a) as snap:
            assert snap is not None
            await snap.check_against_cut(cut)
        await _turns(job, dirs, 1, 1)  # renames out-0, adds out-1, edits main.py
        async with job.ckpt.snapshot(b) as snap:
            assert snap is not None
            await snap.check_against_cut(cut)
        await _coordinator(job).collection_done()

    job.run(scenario())
    assert main(["inspect", str(b)]) == 0
    out = capsys.readouterr().out
    assert "directories  2; this snapshot wrote" in out
    assert "FILES  DIR BYTES  NEW BYTES" in out
    assert main(["inspect", str(b), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    d = summary["instances"][0]["rollouts"][0]["directory"]
    # README.md, build.sh, src/main.py, out-1.txt, kept-0.txt; the link is not a file.
    assert d["files"] == 5 and d["error"] is None
    # Both sandboxes ran the same edits: their new content was written once, for one.
    new = [r["directory"]["new_bytes"] for i in summary["instances"] for r in i["rollouts"]]
    assert sorted(new)[0] == 0 < sorted(new)[1]
    assert summary["sandboxes"]["directories"] == 2

    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "directory of holder-0-r0: 2 added, 1 removed, 1 changed" in out
    assert "  + kept-0.txt" in out and "  + out-1.txt" in out
    assert "  - out-0.txt" in out and "  ~ src/main.py" in out

    assert main(["verify", str(b)]) == 0
    assert "every tree and file blob read and hashed" in capsys.readouterr().out
    store = _store(tmp_path)
    main_py = digest_of(b"print('v2')\n")
    Path(store.describe(main_py)).write_bytes(b"print('v9')\n")
    assert main(["verify", str(b)]) == 1
    err = capsys.readouterr().err
    assert "directory of holder-0-r0, src/main.py: blob" in err
    assert "does not match its digest" in err


def test_a_collection_this_coordinator_left_does_not_hold_up_the_next_snapshot(
        job: World, tmp_path: Path) -> None:
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        coordinator = _coordinator(job)
        store = _store(tmp_path)
        # What a collection of this coordinator that ended without its release leaves.
        store.claims.begin_collection(coordinator.collector_name, ttl_s=3600, watch=ClaimWatch())
        started = job.sim.loop.time()
        async with job.ckpt.snapshot(tmp_path / "ckpt" / "a") as snap:
            assert snap is not None
            await snap.check_against_cut(StaticCut(live, set()))
        assert job.sim.loop.time() - started < 10  # not the claim's hour
        assert store.claims.live_collection(ClaimWatch()) is None
        assert read_manifest(tmp_path / "ckpt" / "a").blob_store == "../blobs"

    job.run(scenario())


def test_a_collection_a_predecessor_coordinator_left_is_waited_out_not_dropped(
        tmp_path: Path) -> None:
    """Issue 29, case 1: the predecessor Ray declared dead may run again and go on
    removing blobs; its claim is another incarnation's, waited out as a dead
    collector's (its ttl, seen unchanged), never dropped under it."""
    job = sandbox_job(tmp_path, persist_timeout_s=120.0)
    try:
        async def scenario() -> None:
            live, dirs = await _open_with_directories(job, rollouts=1)
            store = _store(tmp_path)
            predecessor = f"{_coordinator(job)._owner}#older"
            store.claims.begin_collection(predecessor, ttl_s=30.0, watch=ClaimWatch())
            claim = store.claims.live_collection(ClaimWatch())
            async with job.ckpt.snapshot(tmp_path / "ckpt" / "a") as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(live, set()))
                assert store.claims.live_collection(ClaimWatch()) == claim  # not dropped
            # The holders waited it out (the wait itself, on their clocks:
            # tests/storage/test_disk_format.py, ..._waits_out_a_dead_collectors_claim_...).
            assert read_manifest(tmp_path / "ckpt" / "a").blob_store == "../blobs"
            assert store.claims.live_collection(ClaimWatch()) == claim

        job.run(scenario())
    finally:
        job.close()


def test_check_startup_refuses_a_sandbox_root_a_holder_cannot_write(tmp_path: Path) -> None:
    job = sandbox_job(tmp_path)
    try:
        job.sandboxes.rmdir()
        job.sandboxes.write_text("a file where the sandbox root should be")

        async def scenario() -> None:
            with pytest.raises(StartupCheckError) as error:
                await job.ckpt.check_startup()
            for inst in ("holder-0", "holder-1"):
                assert f"{inst} cannot write its cache under sandbox_root" in str(error.value)

        job.run(scenario())
    finally:
        job.close()


def test_jobs_sharing_a_sandbox_root_keep_their_node_caches_apart(tmp_path: Path) -> None:
    from actors.holder.sandboxes import Sandboxes

    root = tmp_path / "sandboxes"
    big = os.urandom(2 << 20)  # past the in-memory tier: kept in a file of the cache
    boxes = {}
    for ns in ("job-a", "job-b"):
        d = root / ns / "r0"
        d.mkdir(parents=True)
        (d / "data.bin").write_bytes(big)
        (d / f"only-{ns}").write_text(ns)
        boxes[ns] = Sandboxes("holder-0", str(root), str(tmp_path / "ckpt" / "blobs"), ns)
        boxes[ns].install("r0", d, boxes[ns].record(d, None))
    a, b = boxes["job-a"], boxes["job-b"]
    b.drop("r0")  # job B's session ends and its holder sweeps its cache
    assert b.sweep() > 0 and not b.cache.has(digest_of(big))
    assert a.cache.has(digest_of(big)) and a.cache.path(digest_of(big)).exists()
    assert a.cache.directory != b.cache.directory


def test_a_new_holder_removes_what_an_earlier_holder_of_its_instance_left(
        tmp_path: Path) -> None:
    from actors.holder.sandboxes import Sandboxes

    root = tmp_path / "sandboxes"
    d = root / "r0"
    d.mkdir(parents=True)
    (d / "data.bin").write_bytes(os.urandom(2 << 20))
    dead = Sandboxes("holder-0", str(root), None, "job")
    dead.record(d, None)
    left = sorted(p.name for p in dead.cache.directory.iterdir())
    staging = dead.cache.directory.parent / "restore-r1" / "r0-a1"
    staging.mkdir(parents=True)  # a restore killed while it materialized
    assert len(left) == 1
    fresh = Sandboxes("holder-0", str(root), None, "job")
    assert list(fresh.cache.directory.iterdir()) == [] and not staging.parent.exists()
    assert (d / "data.bin").exists()  # the session's own directory is the worker's


# --- a hostile sandbox ------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_a_fifo_swapped_in_during_a_commit_refuses_the_turn_at_once_and_the_sweep_still_runs(
        job: World, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        ep, d = next(iter(dirs.items()))
        instance = ep.rollout_id.split("-r")[0]
        client = await job.client(instance)
        boxes = job.holders()[instance]._parts.sandboxes
        old, extra = os.urandom(2 << 20), os.urandom(2 << 20)  # kept in the cache's files
        for t, content in enumerate((old, os.urandom(2 << 20))):
            async with client.turn(ep) as turn:
                (d / "data.bin").write_bytes(content)
                turn.complete(f"t{t}".encode(), f"s{t + 1}".encode())
        assert boxes.cache.has(digest_of(old))  # unreferenced now, not swept yet

        def swap() -> None:
            (d / "README.md").unlink()
            os.mkfifo(d / "README.md")  # no writer: a blocking open would wait for ever

        done = swap_before_open(monkeypatch, "README.md", swap)
        with pytest.raises(SandboxError, match=r"README.md, a FIFO that replaced a file"):
            async with client.turn(ep) as turn:
                (d / "extra.bin").write_bytes(extra)
                (d / "README.md").write_text("# edited\n")  # read at the commit
                turn.complete(b"t2", b"s3")
        assert done
        record = await client.get(ep)
        assert (record.turns, record.state) == ((b"t0", b"t1"), b"s2")
        assert boxes.scans_in_flight == 0
        await asyncio.sleep(2.0)  # the holder's watchdog sweeps the node cache
        assert not boxes.cache.has(digest_of(old))
        assert not boxes.cache.has(digest_of(extra))  # kept by the refused scan, if read
        (d / "README.md").unlink()
        async with client.turn(ep) as turn:  # the session is not stuck mid-turn
            turn.complete(b"t2", b"s3")
        assert (await client.get(ep)).state == b"s3"

    job.run(scenario())


def test_a_turn_past_a_configured_sandbox_limit_is_refused_naming_it(tmp_path: Path) -> None:
    job = sandbox_job(tmp_path, sandbox_max_file_bytes=1000)
    try:
        async def scenario() -> None:
            live, dirs = await _open_with_directories(job, rollouts=1)
            ep, d = next(iter(dirs.items()))
            client = await job.client(ep.rollout_id.split("-r")[0])
            with pytest.raises(SandboxError, match=r"model.bin, 1001 bytes to store, more "
                                                   r"than sandbox_max_file_bytes \(1000\)"):
                async with client.turn(ep) as turn:
                    (d / "model.bin").write_bytes(b"w" * 1001)
                    turn.complete(b"t", b"s1")
            assert (await client.get(ep)).state == b"s0"

        job.run(scenario())
    finally:
        job.close()


def test_a_sparse_file_is_snapshotted_and_restored_with_its_holes_and_no_setuid_bit(
        tmp_path: Path) -> None:
    job = sandbox_job(tmp_path)
    path = tmp_path / "ckpt" / "step-1"
    try:
        async def first_run() -> Ep:
            live, dirs = await _open_with_directories(job, rollouts=1)
            ep, d = next(iter(dirs.items()))
            client = await job.client(ep.rollout_id.split("-r")[0])
            async with client.turn(ep) as turn:
                sparse_file(d / "disk.img", 1 << 30, {4096: b"data" * 1000,
                                                       900 << 20: b"more" * 1000})
                (d / "build.sh").chmod(0o4755)
                turn.complete(b"t", b"s1")
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(live, set()))
            return ep

        ep = job.run(first_run())
    finally:
        job.close()
    stored = sum(Path(_store(tmp_path).describe(x)).stat().st_size
                 for x in _store(tmp_path).digests())
    assert stored < 1 << 20  # the data extents, not the GiB of holes
    original = tmp_path / "original.img"
    os.rename(tmp_path / "sandboxes" / "work" / ep.capture_key / "disk.img", original)
    shutil.rmtree(tmp_path / "sandboxes")
    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> Path:
            async with fresh.ckpt.restored(path):
                pass
            instance = ep.rollout_id.split("-r")[0]
            record = await (await fresh.client(instance)).get(Ep(ep.rollout_id, 1))
            assert record.directory is not None
            return Path(record.directory)

        restored = fresh.run(restore())
        image = restored / "disk.img"
        assert image.stat().st_size == 1 << 30 and image.stat().st_blocks * 512 < 1 << 20
        assert same_content(image, original)
        assert (restored / "build.sh").stat().st_mode & 0o7777 == 0o755
    finally:
        fresh.close()


def test_what_a_file_read_again_or_a_refused_scan_kept_is_swept_from_the_node_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from actors.holder.sandboxes import Sandboxes

    d = tmp_path / "sandboxes" / "r0"
    d.mkdir(parents=True)
    log = d / "log"
    log.write_bytes(os.urandom(2 << 20))  # kept in a file of the cache
    boxes = Sandboxes("holder-0", str(tmp_path / "sandboxes"), None, "job")
    real_store = boxes.cache.store
    appends = [1]  # a process appends while the first read runs

    def store(chunks: Any) -> tuple[bytes, int]:
        result = real_store(chunks)
        if appends[0]:
            appends[0] -= 1
            with open(log, "ab") as f:
                f.write(os.urandom(100))
        return result

    monkeypatch.setattr(boxes.cache, "store", store)
    cached = lambda: {p.name for p in boxes.cache.directory.iterdir()}  # noqa: E731
    boxes.install("r0", d, boxes.record(d, None))
    assert len(cached()) == 2  # the first read's content, and the one recorded
    assert boxes.sweep() == 1
    assert cached() == {digest_of(log.read_bytes()).hex()}
    appends[0] = 10  # now it changes at every read: the scan is refused
    with pytest.raises(SandboxError, match="changed each of the 3 times"):
        boxes.record(d, boxes.get("r0").recorded)  # type: ignore[union-attr]
    # Its first read found the recorded content; the next two, new content each.
    assert len(cached()) == 3
    assert boxes.sweep() == 2 and len(cached()) == 1  # only the live session's content


def test_a_hold_renewal_that_lands_after_its_snapshots_abort_is_removed(job: World) -> None:
    # The lease's renewal writes the snapshot's hold on the blob store again; this one is
    # slow, and the block raises meanwhile: the abort's release comes before the write
    # lands (simulation seed 2999). No hold may outlive its snapshot: it would refuse
    # every collection until its ttl.
    path = job.root / "ckpt" / "step-1"
    blobs = job.root / "ckpt" / "blobs"
    holds: list[float] = []

    def io_cost(name: str) -> float:
        if name == "hold":
            holds.append(job.sim.loop.time())
            return 3.0 if len(holds) > 1 else 0.002  # the renewals
        return 0.002

    async def scenario() -> None:
        live, _ = await _open_with_directories(job, rollouts=1)
        job.sim.io_cost = io_cost
        with pytest.raises(RuntimeError, match="the block fails"):
            async with job.ckpt.snapshot(path) as snap:
                assert snap is not None
                await snap.check_against_cut(StaticCut(live, set()))
                while len(holds) < 2:  # a renewal's write is under way
                    await asyncio.sleep(0.1)
                raise RuntimeError("the block fails")
        await asyncio.sleep(5.0)  # the renewal's write has landed
        assert len(holds) >= 2

    job.run(scenario())
    assert sorted(p.name for p in blobs.glob(".claim-*")) == []


def test_snapshots_taken_back_to_back_with_keep_last_keep_the_blob_store_bounded(
        job: World, tmp_path: Path) -> None:
    """Issue 56, case 3: each snapshot begins as soon as the last one committed, a turn
    between them writing a new file, and keep_last(root, 3) runs inside each block (its
    own collection refused: the snapshot holds the store). A collection walks the store
    slower than the next snapshot begins. The store holds what the three kept snapshots
    reference and a margin of about one snapshot's blobs, however many snapshots went
    (before: each next snapshot interrupted the collection, and the store grew by a
    snapshot's blobs each time)."""
    from nemo_ckpt.catalog.listing import keep_last

    root = tmp_path / "ckpt"
    slow = {"collect_quietly": 0.5}  # seconds: a collection over many files
    job.sim.io_cost = lambda name: slow.get(name, 0.002)
    counts: list[tuple[int, int]] = []  # (blobs in the store, blobs the kept ones reference)

    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        cut = StaticCut(live, set())
        for i in range(40):
            for ep, d in dirs.items():  # a turn writes a new file and drops the last one
                client = await job.client(ep.rollout_id.split("-r")[0])
                async with client.turn(ep) as turn:
                    (d / f"step-{i}.log").write_text(f"what step {i} wrote\n" * 50)
                    (d / f"step-{i - 1}.log").unlink(missing_ok=True)
                    turn.complete(b"t", b"s")
            async with job.ckpt.snapshot(root / f"step-{i:03d}") as snap:
                assert snap is not None
                await snap.check_against_cut(cut)
                retention = keep_last(root, 3)  # RL's retention, beside its save
                assert retention.collection is None  # refused: this snapshot holds it
            counts.append((len(_store(tmp_path).digests()), len(_referenced(tmp_path))))

    job.run(scenario())
    margin = max(referenced for _, referenced in counts)  # about a snapshot's blobs
    assert all(blobs <= referenced + margin for blobs, referenced in counts), counts


def test_a_collection_a_snapshot_interrupted_resumes_with_the_garbage_it_found(
        job: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 56, case 3: the garbage an interrupted collection found is kept by its
    caller (``pending``); the next collection removes what of it no committed snapshot
    references, without listing the store again: a blob a snapshot committed since
    references (its holder found it present and did not write it again) stays."""
    root, path = tmp_path / "ckpt", tmp_path / "ckpt" / "latest"
    orphans = {digest_of(f"orphan {i}\n".encode()): f"orphan {i}\n" for i in range(5)}
    clock = lambda: EPOCH + job.sim.loop.time()  # noqa: E731
    pending: set[bytes] = set()

    async def snapshot_with(cut: StaticCut, d: Path, client: Any, ep: Ep,
                            content: str | None) -> None:
        async with client.turn(ep) as turn:
            if content is not None:
                (d / "found.txt").write_text(content)
            turn.complete(b"t", b"s")
        async with job.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(cut)
        await _coordinator(job).collection_done()

    async def scenario() -> bytes:
        live, dirs = await _open_with_directories(job, rollouts=1)
        cut = StaticCut(live, set())
        ep, d = next(iter(dirs.items()))
        client = await job.client(ep.rollout_id.split("-r")[0])
        await snapshot_with(cut, d, client, ep, None)
        for digest, text in orphans.items():  # garbage: no snapshot references them
            _store(tmp_path).put(digest, text.encode())
        asked = [0]

        def stop_after_two() -> bool:
            asked[0] += 1
            return asked[0] > 3  # the snapshot's references read, then two removals

        first = collect_blobs(root, clock=clock, should_stop=stop_after_two, pending=pending)
        assert first.interrupted and first.removed == 2 and len(pending) == 3
        assert pending < set(orphans)
        again = sorted(pending)[0]  # a sandbox file with its content: the next snapshot
        await snapshot_with(cut, d, client, ep, orphans[again])  # references it
        assert again in _referenced(tmp_path)
        return again

    again = job.run(scenario())

    def no_listing(self: BlobStore) -> set[bytes]:
        raise AssertionError("a resumed collection listed the store")

    with monkeypatch.context() as m:
        m.setattr(BlobStore, "digests", no_listing)
        collect_blobs(root, clock=clock, pending=pending)
    assert pending == set()
    present = _store(tmp_path).digests()
    assert again in present
    assert present & set(orphans) == {again}
    assert present == _referenced(tmp_path)
