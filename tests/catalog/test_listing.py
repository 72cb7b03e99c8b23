"""Snapshots as a collection (``nemo_ckpt.catalog.listing``): listed newest first, the newest
that verifies found (and why newer ones were passed over), removed beside a running job,
the last N kept."""

from __future__ import annotations

import shutil
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from actors.coordinator.restore import Restores
from nemo_ckpt.catalog import listing as catalog
from nemo_ckpt.catalog.listing import keep_last, latest_snapshot, list_snapshots, remove_snapshot
from nemo_ckpt.catalog.verification import verify_snapshot
from nemo_ckpt.errors import CheckpointPathBusyError, CheckpointPathError, SnapshotNotFoundError
from nemo_ckpt.storage.checkpoint_folder import (
    environment_dir,
    environment_folder,
    prepare_environment_dir,
)
from nemo_ckpt.storage.claims import STALE_FACTOR, ClaimWatch, encode_claim
from nemo_ckpt.storage.commit_sequence import SEQUENCE_DIR, take_sequence
from nemo_ckpt.storage.local_folder import LocalFolder
from nemo_ckpt.storage.manifest import FORMAT_VERSION, encode_manifest
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.path_claims import claim_path, read_claims
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import read_snapshot, write_manifest
from nemo_ckpt.testing.data_plane import StaticCut
from nemo_ckpt.transport import COORDINATOR
from tests.harness import World
from tests.s3_server import BUCKET
from tests.sandboxes.test_sandbox_sessions import (
    _coordinator,
    _open_with_directories,
    _store,
    _turns,
    sandbox_job,
)
from tests.storage.test_disk_format import FakeClock, flip_middle_byte, manifest_path, session

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def snap(path: Path, snapshot_id: str, minute: int, rollouts: int = 1,
         sequence: int | None = None) -> Path:
    """A committed snapshot at ``path``, created ``minute`` minutes after T0: format 3,
    or format 6 numbered ``sequence``."""
    directory = prepare_environment_dir(path)
    shard = write_shard(directory, shard_file_name(snapshot_id, "holder-0"), "holder-0",
                        [session("holder-0", f"r{k}") for k in range(rollouts)])
    write_manifest(directory, encode_manifest(
        snapshot_id=snapshot_id, created_at=T0 + timedelta(minutes=minute),
        instances=["holder-0"], shards=[shard], restarted_rollouts=0, metrics={},
        sequence=sequence))
    return path


def first_shard(path: Path) -> Path:
    return next(environment_dir(path).glob("shard-*"))


@pytest.fixture
def three(tmp_path: Path) -> dict[str, Path]:
    """Three snapshots under one root, written out of their time order, one nested."""
    root = tmp_path / "ckpt"
    return {"mid": snap(root / "step-2", "s2", 2, rollouts=2),
            "old": snap(root / "step-1", "s1", 1),
            "new": snap(root / "runs" / "step-3", "s3", 3, rollouts=3)}


# --- listing and finding ------------------------------------------------------------------


def test_list_snapshots_gives_every_committed_snapshot_newest_first_with_its_facts(
        tmp_path: Path, three: dict[str, Path]) -> None:
    (tmp_path / "ckpt" / "not-a-snapshot").mkdir()
    prepare_environment_dir(tmp_path / "ckpt" / "interrupted")  # no manifest: not committed
    found = list_snapshots(tmp_path / "ckpt")
    assert [(s.path, s.snapshot_id, s.rollouts) for s in found] == [
        (str(three["new"]), "s3", 3), (str(three["mid"]), "s2", 2), (str(three["old"]), "s1", 1)]
    assert found[0].created_at == T0 + timedelta(minutes=3)
    assert found[0].format_version == FORMAT_VERSION
    assert found[0].instances == 1 and found[0].readable
    assert found[0].bytes == first_shard(three["new"]).stat().st_size


def test_latest_snapshot_skips_a_damaged_newest_snapshot_and_says_why(
        three: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flip_middle_byte(first_shard(three["new"]))
    latest = latest_snapshot(tmp_path / "ckpt")
    assert latest.path == str(three["mid"])
    (skipped,) = latest.skipped
    assert skipped.path == str(three["new"])
    assert "does not verify (1 problem(s))" in skipped.reason
    assert "its content changed" in skipped.reason
    assert f"skipped {three['new']}" in caplog.text
    # Without verifying, only the manifest is read: the damaged one is taken.
    assert latest_snapshot(tmp_path / "ckpt", verify=False).path == str(three["new"])


def test_a_snapshot_whose_manifest_does_not_read_is_listed_first_and_never_taken(
        three: dict[str, Path], tmp_path: Path) -> None:
    manifest_path(three["old"]).write_bytes(b"{not json")
    found = list_snapshots(tmp_path / "ckpt")
    assert found[0].path == str(three["old"]) and not found[0].readable
    assert found[0].snapshot_id is None and "is not valid JSON" in str(found[0].error)
    latest = latest_snapshot(tmp_path / "ckpt", verify=False)
    assert latest.path == str(three["new"])
    assert [s.path for s in latest.skipped] == [str(three["old"])]
    assert "its manifest does not read, so its age is unknown" in latest.skipped[0].reason


def test_latest_snapshot_of_a_root_without_snapshots_is_none(tmp_path: Path) -> None:
    latest = latest_snapshot(tmp_path)
    assert (latest.snapshot, latest.path, latest.skipped) == (None, None, ())


def test_a_root_that_is_not_a_folder_is_refused_not_taken_for_an_empty_one(
        tmp_path: Path, three: dict[str, Path]) -> None:
    (tmp_path / "a-file").write_text("")
    for wrong in (tmp_path / "ckpt-typo", tmp_path / "a-file"):
        for call in (list_snapshots, latest_snapshot, lambda root: keep_last(root, 1)):
            with pytest.raises(CheckpointPathError, match="is not a folder"):
                call(wrong)
    assert len(list_snapshots(tmp_path / "ckpt")) == 3


def test_snapshots_are_listed_by_their_commit_number_not_their_hosts_clocks(
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    snap(root / "a", "first", minute=180, sequence=1)
    snap(root / "b", "second", minute=0, sequence=2)  # its host's clock 3 hours behind
    snap(root / "old", "legacy", minute=500)  # an earlier release's: no number
    assert [s.snapshot_id for s in list_snapshots(root)] == ["second", "first", "legacy"]
    assert latest_snapshot(root).path == str(root / "b")


def test_a_coordinator_whose_clock_steps_back_between_two_commits_lists_the_second_first(
        tmp_path: Path) -> None:
    world = World(tmp_path)
    root = tmp_path / "ckpt"
    try:
        async def scenario() -> None:
            live = await world.populate()
            await world.snapshot(root / "a", live)
            for coordinator in world.sim.live(COORDINATOR):
                coordinator.wall_offset -= 3 * 3600.0
            await world.snapshot(root / "b", live)

        world.run(scenario())
    finally:
        world.close()
    first, second = read_snapshot(root / "a").manifest, read_snapshot(root / "b").manifest
    assert second.created_at < first.created_at  # the clock did step back
    assert (first.sequence, second.sequence, second.format_version) == (1, 2, 6)
    assert [s.path for s in list_snapshots(root)] == [str(root / "b"), str(root / "a")]


def test_a_commit_numbers_past_every_snapshot_there_when_the_numbers_folder_is_gone(
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    snap(root / "a", "numbered", minute=1, sequence=41)
    assert take_sequence(str(root)) == 42
    shutil.rmtree(root / SEQUENCE_DIR)
    snap(root / "b", "next", minute=2, sequence=42)
    assert take_sequence(str(root)) == 43


def test_only_the_newest_commit_numbers_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    numbers = [take_sequence(str(root)) for _ in range(40)]
    assert numbers == list(range(1, 41))
    kept = sorted(int(p.name) for p in (root / SEQUENCE_DIR).iterdir())
    assert kept[-1] == 40 and len(kept) <= 17
    assert list_snapshots(root) == []  # the numbers' folder is no snapshot


# --- removing -----------------------------------------------------------------------------


def test_remove_snapshot_removes_its_environment_half_and_leaves_the_others(
        tmp_path: Path, three: dict[str, Path]) -> None:
    rl_file = three["mid"] / "data_plane.json"  # RL's half of the checkpoint path
    rl_file.write_text("{}")
    report = remove_snapshot(three["mid"])
    assert report.snapshot_id == "s2"
    assert report.files[0] == "manifest.json" and len(report.files) == 2
    # The emptied environment/ goes too; RL's file beside it stays, and RL can then
    # remove its checkpoint folder as it made it.
    assert sorted(p.name for p in three["mid"].iterdir()) == ["data_plane.json"]
    assert rl_file.read_text() == "{}"
    assert [s.snapshot_id for s in list_snapshots(tmp_path / "ckpt")] == ["s3", "s1"]
    assert all(verify_snapshot(three[k]).ok for k in ("new", "old"))
    with pytest.raises(SnapshotNotFoundError, match="Nothing was removed"):
        remove_snapshot(three["mid"])


def test_a_damaged_snapshot_can_be_removed(tmp_path: Path, three: dict[str, Path]) -> None:
    manifest_path(three["old"]).write_bytes(b"{not json")
    report = remove_snapshot(three["old"])
    assert report.snapshot_id is None and len(report.files) == 2
    assert [s.snapshot_id for s in list_snapshots(tmp_path / "ckpt")] == ["s3", "s2"]


def _claim_as_snapshot(path: Path, operation: str = "snap-running", ttl_s: float = 30.0) -> None:
    claim_path(environment_folder(path), operation, "cluster/other-job", ClaimWatch(),
               ttl_s)


def test_a_removal_is_refused_while_a_snapshot_holds_the_folder_and_removes_nothing(
        three: dict[str, Path]) -> None:
    _claim_as_snapshot(three["mid"])
    before = sorted(p.name for p in environment_dir(three["mid"]).iterdir())
    with pytest.raises(CheckpointPathBusyError,
                       match="snap-running of cluster/other-job is in progress there"):
        remove_snapshot(three["mid"])
    assert sorted(p.name for p in environment_dir(three["mid"]).iterdir()) == before
    assert verify_snapshot(three["mid"]).ok


def test_a_removal_told_to_wait_goes_ahead_once_a_dead_snapshots_claim_is_seen_abandoned(
        three: dict[str, Path]) -> None:
    _claim_as_snapshot(three["mid"], ttl_s=10.0)
    clock = FakeClock(100.0)
    report = remove_snapshot(three["mid"], wait_s=STALE_FACTOR * 10.0 + 2, clock=clock,
                             sleep=clock.advance)
    assert report.snapshot_id == "s2" and clock.now >= 100.0 + STALE_FACTOR * 10.0
    with pytest.raises(SnapshotNotFoundError):
        read_snapshot(three["mid"])


def test_a_removal_racing_a_snapshots_claim_backs_off_and_nothing_is_lost(
        three: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Both read no claim, both write theirs: the removal sees the snapshot's and yields."""
    real = catalog.claim_path

    def and_a_snapshot_claims_too(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        # The snapshot read the folder before the removal's claim landed: it writes.
        data, _ = encode_claim("snap-running", "cluster/other-job", 30.0)
        environment_folder(three["mid"]).write_bytes(".claim-snap-running.json", data)

    monkeypatch.setattr(catalog, "claim_path", and_a_snapshot_claims_too)
    with pytest.raises(CheckpointPathBusyError, match="snap-running"):
        remove_snapshot(three["mid"])
    assert [c.operation for c in read_claims(environment_folder(three["mid"]))] == [
        "snap-running"]
    assert verify_snapshot(three["mid"]).ok


def test_a_snapshot_that_begins_during_a_removal_is_refused_not_robbed(
        three: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    refused: list[str] = []
    real = catalog.remove_unreferenced_files

    def a_snapshot_begins(*args: Any) -> list[str]:
        try:
            _claim_as_snapshot(three["mid"])
        except CheckpointPathBusyError as exc:
            refused.append(str(exc))
        return real(*args)

    monkeypatch.setattr(catalog, "remove_unreferenced_files", a_snapshot_begins)
    remove_snapshot(three["mid"])
    assert len(refused) == 1 and "is in use by remove-" in refused[0]
    assert "the snapshot there is being removed" in refused[0]
    assert read_claims(environment_folder(three["mid"])) == []


# --- keep_last ------------------------------------------------------------------------------


def test_keep_last_removes_all_but_the_newest_n(tmp_path: Path, three: dict[str, Path]) -> None:
    report = keep_last(tmp_path / "ckpt", 2)
    assert [s.snapshot_id for s in report.kept] == ["s3", "s2"]
    assert [r.snapshot_id for r in report.removed] == ["s1"] and report.refused == {}
    assert [s.snapshot_id for s in list_snapshots(tmp_path / "ckpt")] == ["s3", "s2"]


def test_keep_last_counts_only_snapshots_that_verify_so_damage_never_costs_the_good_ones(
        tmp_path: Path, three: dict[str, Path]) -> None:
    flip_middle_byte(first_shard(three["new"]))
    report = keep_last(tmp_path / "ckpt", 1, verify=True)
    assert [s.snapshot_id for s in report.kept] == ["s3", "s2"]  # damaged s3 kept, for a look
    assert [r.snapshot_id for r in report.removed] == ["s1"]
    assert latest_snapshot(tmp_path / "ckpt").path == str(three["mid"])


def test_keep_last_reports_a_refused_removal_and_removes_the_rest(
        tmp_path: Path, three: dict[str, Path]) -> None:
    snap(tmp_path / "ckpt" / "step-0", "s0", 0)
    _claim_as_snapshot(three["old"])
    report = keep_last(tmp_path / "ckpt", 2)
    assert [r.snapshot_id for r in report.removed] == ["s0"]
    assert list(report.refused) == [str(three["old"])]
    assert "in progress there" in report.refused[str(three["old"])]


def test_keep_last_of_zero_is_refused_before_anything_is_removed(
        tmp_path: Path, three: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="never removes every snapshot"):
        keep_last(tmp_path / "ckpt", 0)
    assert len(list_snapshots(tmp_path / "ckpt")) == 3


def _a_removers_claim(path: Path, ttl_s: float = 30.0) -> None:
    """The claim a removal writes there (``remove_snapshot``), as a remover whose process
    died mid-removal left it; called again, as its live remover renews it (a new beat)."""
    data, _ = encode_claim("remove-dead0000", "nemo-ckpt-remover-dead0000", ttl_s)
    environment_folder(path).write_bytes(".claim-remove-dead0000.json", data)


def test_keep_last_after_a_remover_died_goes_ahead_once_this_process_saw_its_claim_unchanged(
        tmp_path: Path, three: dict[str, Path]) -> None:
    root = tmp_path / "ckpt"
    _a_removers_claim(three["old"])
    clock = FakeClock(100.0)
    first = keep_last(root, 2, clock=clock)
    assert first.removed == [] and list(first.refused) == [str(three["old"])]
    why = first.refused[str(three["old"])]
    assert ("remove-dead0000 of nemo-ckpt-remover-dead0000 is in progress there (another "
            "removal); nothing was removed; run it again once that has ended; if its "
            "process is gone, its claim is taken as abandoned (and removed) once seen "
            "unchanged for 36s more: pass wait_s=37 (nemo-ckpt rm --wait 37)") in why
    clock.advance(STALE_FACTOR * 30.0 + 1)
    second = keep_last(root, 2, clock=clock)  # a later call of the same process
    assert [r.snapshot_id for r in second.removed] == ["s1"] and second.refused == {}
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3", "s2"]
    assert not environment_dir(three["old"]).exists()  # the dead claim went with it


def test_a_removers_claim_that_is_renewed_is_never_taken_as_abandoned(
        tmp_path: Path, three: dict[str, Path]) -> None:
    clock = FakeClock(100.0)
    _a_removers_claim(three["old"])
    for _ in range(3):
        report = keep_last(tmp_path / "ckpt", 2, clock=clock)
        assert report.removed == [] and list(report.refused) == [str(three["old"])]
        clock.advance(STALE_FACTOR * 30.0 + 1)
        _a_removers_claim(three["old"])
    assert len(list_snapshots(tmp_path / "ckpt")) == 3
    assert [c.operation for c in read_claims(environment_folder(three["old"]))] == [
        "remove-dead0000"]


def test_a_removal_keeps_an_environment_folder_that_holds_files_not_its_own(
        three: dict[str, Path]) -> None:
    notes = environment_dir(three["mid"]) / "notes.txt"  # a user's, not a file we make
    notes.write_text("why step-2 was kept")
    remove_snapshot(three["mid"])
    assert sorted(p.name for p in environment_dir(three["mid"]).iterdir()) == ["notes.txt"]


def test_a_snapshot_claims_a_path_whose_emptied_folder_a_removal_took_after_it_prepared_it(
        three: dict[str, Path]) -> None:
    environment_folder(three["mid"]).prepare()  # the snapshot prepares its folder...
    remove_snapshot(three["mid"])  # ...a removal there empties and removes it...
    _claim_as_snapshot(three["mid"])  # ...and the snapshot's claim makes it again
    assert [c.operation for c in read_claims(environment_folder(three["mid"]))] == [
        "snap-running"]


# --- beside a running job (in-process coordinator and holders) -------------------------------


@pytest.fixture
def job(tmp_path: Path) -> Any:
    j = sandbox_job(tmp_path)
    try:
        yield j
    finally:
        j.close()


def test_a_removal_during_a_real_snapshot_into_that_path_is_refused_and_the_commit_stands(
        job: World, tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "latest"
    refused: list[str] = []

    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        cut = StaticCut(live, set())
        async with job.ckpt.snapshot(path) as first:
            assert first is not None
            await first.check_against_cut(cut)
        await _turns(job, dirs, 0, 1)
        async with job.ckpt.snapshot(path) as second:
            assert second is not None
            try:
                remove_snapshot(path)
            except CheckpointPathBusyError as exc:
                refused.append(str(exc))
            await second.check_against_cut(cut)
        await _coordinator(job).collection_done()

    job.run(scenario())
    assert len(refused) == 1 and "(a snapshot writing it" in refused[0]
    assert "nothing was removed" in refused[0]
    assert verify_snapshot(path).ok and read_snapshot(path).manifest.sessions == 2


def _two_snapshots_with_directories(job: World, root: Path) -> None:
    """Snapshots ``root/a`` then ``root/b`` of one rollout's directory, a turn apart."""
    async def scenario() -> None:
        live, dirs = await _open_with_directories(job, rollouts=1)
        cut = StaticCut(live, set())
        for name, turn in (("a", 0), ("b", 1)):
            await _turns(job, dirs, turn, 1)
            async with job.ckpt.snapshot(root / name) as snapshot:
                assert snapshot is not None
                await snapshot.check_against_cut(cut)
            await _coordinator(job).collection_done()

    job.run(scenario())


def test_removing_a_snapshot_collects_the_blobs_only_it_referenced(
        job: World, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _two_snapshots_with_directories(job, root)
    before = len(_store(tmp_path).digests())
    report = remove_snapshot(root / "a")
    assert report.collection is not None and report.collection.removed > 0
    assert report.collection.snapshots == [str(root / "b")]
    assert len(_store(tmp_path).digests()) == before - report.collection.removed
    assert verify_snapshot(root / "b").ok  # every blob b references is still there


def test_keep_last_collects_the_blobs_of_the_snapshots_it_removed(
        job: World, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _two_snapshots_with_directories(job, root)
    report = keep_last(root, 1)
    assert [r.path for r in report.removed] == [str(root / "a")]
    assert report.collection is not None and report.collection.removed > 0
    assert verify_snapshot(root / "b").ok


def test_a_removal_collects_past_a_dead_collectors_claim_once_this_process_saw_it_unchanged(
        job: World, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _two_snapshots_with_directories(job, root)
    data, _ = encode_claim("collector", "a-collector-that-died", 30.0)
    (root / "blobs" / ".claim-collector.json").write_bytes(data)
    clock = FakeClock(100.0)
    first = remove_snapshot(root / "a", clock=clock)
    assert first.collection is None and first.collection_skipped is not None
    assert "already being collected by a-collector-that-died" in first.collection_skipped
    clock.advance(STALE_FACTOR * 30.0 + 1)
    second = remove_snapshot(root / "b", clock=clock)  # a later call of the same process
    assert second.collection is not None and second.collection.removed > 0
    assert second.collection_skipped is None
    assert _store(tmp_path).digests() == set()


def _a_job_that_snapshots_and_dies(tmp_path: Path, path: Path) -> None:
    job = sandbox_job(tmp_path)
    try:
        async def first_run() -> None:
            live, dirs = await _open_with_directories(job, rollouts=1)
            await _turns(job, dirs, 0, 1)
            async with job.ckpt.snapshot(path) as snapshot:
                assert snapshot is not None
                await snapshot.check_against_cut(StaticCut(live, set()))

        job.run(first_run())
    finally:
        job.close()
    shutil.rmtree(tmp_path / "sandboxes")  # a new node: nothing cached


def _restore(tmp_path: Path, path: Path) -> int:
    fresh = sandbox_job(tmp_path, seed=1)
    try:
        async def restore() -> int:
            async with fresh.ckpt.restored(path) as restored:
                return len(restored.continued_attempts)

        return int(fresh.run(restore()))
    finally:
        fresh.close()


def test_a_restore_goes_ahead_past_the_claim_a_dead_jobs_snapshot_left_there(
        tmp_path: Path) -> None:
    """A cluster that died mid-snapshot into the path it last committed leaves its claim;
    reading the committed snapshot conflicts with no writer, so the restore is not
    refused."""
    path = tmp_path / "ckpt" / "latest"
    _a_job_that_snapshots_and_dies(tmp_path, path)
    _claim_as_snapshot(path)  # another cluster's owner: seen for the first time, live
    assert _restore(tmp_path, path) == 2
    assert [c.operation for c in read_claims(environment_folder(path))] == ["snap-running"]


def test_a_removal_while_a_restore_reads_the_snapshot_is_refused_and_the_restore_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt" / "step-1"
    _a_job_that_snapshots_and_dies(tmp_path, path)
    refused: list[str] = []
    reading = Restores._read_and_verify

    async def removal_meanwhile(self: Restores, *args: Any) -> Any:
        try:
            remove_snapshot(path)
        except CheckpointPathBusyError as exc:
            refused.append(str(exc))
        return await reading(self, *args)

    monkeypatch.setattr(Restores, "_read_and_verify", removal_meanwhile)
    assert _restore(tmp_path, path) == 2
    assert len(refused) == 1 and "(a restore reading it); nothing was removed" in refused[0]
    assert read_claims(environment_folder(path)) == []  # dropped once the holders read
    assert verify_snapshot(path).ok


def test_the_cli_pages_example_runs_as_written(tmp_path: Path, three: dict[str, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "CLI.md").read_text()
    start = page.index("\n## Finding, keeping and removing snapshots\n")
    block = page[page.index("```python\n", start) + 10:page.index("```\n", start + 1)]
    flip_middle_byte(first_shard(three["new"]))
    scope: dict[str, Any] = {"root": tmp_path / "ckpt"}
    exec(compile(block, "docs/CLI.md", "exec"), scope)
    out = capsys.readouterr().out
    assert f"skipped {three['new']} it does not verify" in out
    assert scope["path"] == str(three["mid"])
    assert scope["report"].removed == []  # three snapshots, three kept


def test_a_removal_cut_short_leaves_no_committed_snapshot_and_a_second_one_finishes_it(
        tmp_path: Path, three: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_error(*args: Any) -> list[str]:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(catalog, "remove_unreferenced_files", disk_error)
        with pytest.raises(OSError):
            remove_snapshot(three["mid"])
    assert [s.snapshot_id for s in list_snapshots(tmp_path / "ckpt")] == ["s3", "s1"]
    shard = first_shard(three["mid"])
    report = remove_snapshot(three["mid"])
    assert (report.snapshot_id, report.files) == (None, [shard.name])
    assert not environment_dir(three["mid"]).exists()


def test_a_manifest_removal_that_landed_and_then_raised_goes_on(
        tmp_path: Path, three: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    real = LocalFolder.remove

    def removed_then_raised(self: LocalFolder, names: Any) -> None:
        names = list(names)
        real(self, names)
        if "manifest.json" in names:
            raise OSError(5, "Input/output error after the removal")

    monkeypatch.setattr(LocalFolder, "remove", removed_then_raised)
    report = remove_snapshot(three["mid"])
    assert report.snapshot_id == "s2" and len(report.files) == 2
    assert not environment_dir(three["mid"]).exists()


# --- in a bucket ------------------------------------------------------------------------------


def test_snapshots_in_a_bucket_are_listed_found_removed_and_kept(s3_server: Any) -> None:
    root = f"s3://{BUCKET}/catalog-{uuid.uuid4().hex[:8]}"
    for k, minute in ((1, 1), (2, 2), (3, 3)):
        directory = environment_folder(f"{root}/step-{k}")
        shard = write_shard(directory, shard_file_name(f"s{k}", "holder-0"), "holder-0",
                            [session("holder-0", "r0")])
        write_manifest(directory, encode_manifest(
            snapshot_id=f"s{k}", created_at=T0 + timedelta(minutes=minute),
            instances=["holder-0"], shards=[shard], restarted_rollouts=0, metrics={}))
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3", "s2", "s1"]
    assert latest_snapshot(root).path == f"{root}/step-3"
    _claim_as_snapshot_at(f"{root}/step-2")
    with pytest.raises(CheckpointPathBusyError, match="in progress there"):
        remove_snapshot(f"{root}/step-2")
    report = keep_last(root, 1)
    assert [r.snapshot_id for r in report.removed] == ["s1"]
    assert list(report.refused) == [f"{root}/step-2"]
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3", "s2"]
    assert environment_folder(f"{root}/step-1").names() == []


def _claim_as_snapshot_at(path: str) -> None:
    claim_path(environment_folder(path), "snap-running", "cluster/other-job", ClaimWatch(),
               30.0)


def test_a_removal_of_a_listed_snapshot_is_refused_once_another_committed_at_its_path(
        tmp_path: Path) -> None:
    path = snap(tmp_path / "ckpt" / "step-1", "snap-old", minute=1)
    listed = list_snapshots(tmp_path / "ckpt")
    assert [i.snapshot_id for i in listed] == ["snap-old"]
    snap(path, "snap-new", minute=2)  # a job writes into the same path again
    with pytest.raises(CheckpointPathBusyError, match="snapshot there is now snap-new"):
        remove_snapshot(path, snapshot_id="snap-old")
    assert read_snapshot(path).manifest.snapshot_id == "snap-new"
    assert verify_snapshot(path).ok
