"""The catalog's progress callbacks and its ``_async`` forms: the event loop keeps running
while they work, progress arrives on the loop, and a cancelled call stops at its next
step (the sync core they run: tests/catalog/test_listing.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt import (
    CatalogProgress,
    keep_last,
    keep_last_async,
    latest_snapshot_async,
    list_snapshots,
    list_snapshots_async,
    remove_snapshot_async,
    verify_snapshot,
    verify_snapshot_async,
)
from nemo_ckpt.catalog import listing as catalog
from nemo_ckpt.catalog import verification
from nemo_ckpt.storage.checkpoint_folder import environment_dir, prepare_environment_dir
from nemo_ckpt.storage.manifest import encode_manifest
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.path_claims import read_claims
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import write_manifest
from tests.catalog.test_listing import T0, snap
from tests.storage.test_disk_format import session

pytestmark = pytest.mark.timeout(60)


def three_shards(path: Path) -> Path:
    """A committed snapshot of three holders, one shard each."""
    directory = prepare_environment_dir(path)
    holders = ["holder-0", "holder-1", "holder-2"]
    shards = [write_shard(directory, shard_file_name("s1", h), h, [session(h, f"r-{h}")])
              for h in holders]
    write_manifest(directory, encode_manifest(
        snapshot_id="s1", created_at=T0, instances=holders, shards=shards,
        restarted_rollouts=0, metrics={}))
    return path


def steps(reported: list[CatalogProgress]) -> list[tuple[str, int, int]]:
    return [(p.what, p.done, p.total) for p in reported]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpt"
    for k in (1, 2, 3):
        snap(r / f"step-{k}", f"s{k}", k)
    return r


def test_verify_reports_each_shard_as_it_is_verified(tmp_path: Path) -> None:
    path = three_shards(tmp_path / "step-1")
    reported: list[CatalogProgress] = []
    assert verify_snapshot(path, progress=reported.append).ok
    assert steps(reported) == [("shards verified", k, 3) for k in range(4)]
    assert [p.current for p in reported] == [
        "", *(shard_file_name("s1", f"holder-{k}") for k in range(3))]


def test_keep_last_reports_the_manifests_read_then_each_snapshot_kept_or_removed(
        root: Path) -> None:
    reported: list[CatalogProgress] = []
    report = keep_last(root, 2, progress=reported.append)
    assert [r.snapshot_id for r in report.removed] == ["s1"]
    assert steps(reported) == [*(("manifests read", k, 3) for k in range(4)),
                               *(("snapshots kept or removed", k, 3) for k in range(4))]
    assert [p.current for p in reported[-3:]] == [
        str(root / "step-3"), str(root / "step-2"), str(root / "step-1")]


def test_a_progress_callback_that_raises_stops_keep_last_before_its_next_removal(
        root: Path) -> None:
    def stop_after_the_first(step: CatalogProgress) -> None:
        if step.what == "snapshots kept or removed" and step.done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        keep_last(root, 1, progress=stop_after_the_first)
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3", "s2", "s1"]


def test_keep_last_dry_run_lists_what_it_would_remove_and_removes_nothing(
        root: Path) -> None:
    before = sorted(str(p) for p in root.rglob("*"))
    report = keep_last(root, 1, dry_run=True)
    assert report.dry_run and report.removed == [] and report.collection is None
    assert [s.snapshot_id for s in report.would_remove] == ["s2", "s1"]
    assert [s.snapshot_id for s in report.kept] == ["s3"]
    assert sorted(str(p) for p in root.rglob("*")) == before


def test_keep_last_names_each_damaged_snapshot_it_keeps_with_why(root: Path) -> None:
    (environment_dir(root / "step-3") / "manifest.json").write_bytes(b"{")
    report = keep_last(root, 1)
    assert [s.path for s in report.kept] == [str(root / "step-3"), str(root / "step-2")]
    assert list(report.damaged) == [str(root / "step-3")]
    assert report.damaged[str(root / "step-3")].startswith(
        "its manifest does not read, so its age is unknown: ")
    assert [r.snapshot_id for r in report.removed] == ["s1"]


def test_a_slow_verify_leaves_the_event_loop_running_and_reports_on_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = three_shards(tmp_path / "step-1")
    real = verification.read_shard

    def slow_read(*args: Any) -> Any:
        time.sleep(0.2)  # a shard on a slow store
        return real(*args)

    monkeypatch.setattr(verification, "read_shard", slow_read)

    async def scenario() -> tuple[bool, int, list[CatalogProgress], set[int]]:
        ticks = 0
        threads: set[int] = set()
        reported: list[CatalogProgress] = []

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        def heard(step: CatalogProgress) -> None:
            threads.add(threading.get_ident())
            reported.append(step)

        beat = asyncio.create_task(ticker())
        report = await asyncio.wait_for(verify_snapshot_async(path, progress=heard), 30)
        beat.cancel()
        return report.ok, ticks, reported, threads

    ok, ticks, reported, threads = asyncio.run(scenario())
    assert ok
    # 0.6 s of reading: a loop blocked for it would not have ticked at all meanwhile.
    assert ticks >= 10, ticks
    assert steps(reported) == [("shards verified", k, 3) for k in range(4)]
    assert threads == {threading.get_ident()}  # on the loop's thread, not the worker's


def test_a_cancelled_keep_last_async_finishes_the_removal_under_way_and_no_other(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap(root / "step-0", "s0", 0)
    real = catalog.remove_snapshot
    go = threading.Event()
    calls: list[str] = []

    def held_removal(path: Any, **options: Any) -> Any:
        calls.append(str(path))
        go.wait(10)
        return real(path, **options)

    monkeypatch.setattr(catalog, "remove_snapshot", held_removal)

    async def scenario() -> None:
        task = asyncio.create_task(keep_last_async(root, 1))
        while not calls:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()  # the removal under way goes on, in its worker thread

    asyncio.run(scenario())  # which waits for the worker thread to end
    assert calls == [str(root / "step-2")]
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3", "s1", "s0"]
    assert read_claims(environment_dir(root / "step-2")) == []


def test_the_async_forms_give_what_the_sync_ones_give(root: Path) -> None:
    async def scenario() -> None:
        listed = await list_snapshots_async(root)
        assert [s.snapshot_id for s in listed] == ["s3", "s2", "s1"]
        latest = await latest_snapshot_async(root)
        assert latest.path == str(root / "step-3")
        assert (await verify_snapshot_async(root / "step-3")).ok
        removed = await remove_snapshot_async(root / "step-1")
        assert removed.snapshot_id == "s1"
        kept = await keep_last_async(root, 1)
        assert [r.snapshot_id for r in kept.removed] == ["s2"]
        with pytest.raises(ValueError, match="never removes every snapshot"):
            await keep_last_async(root, 0)

    asyncio.run(scenario())
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3"]
