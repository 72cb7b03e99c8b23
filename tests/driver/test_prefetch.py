"""A restore read ahead (``RayEnvironmentCheckpoint.prefetch``) restores exactly what a
restore without it does, reads each shard once, and a read ahead of another snapshot is
dropped; on the in-process world under virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import actors.holder.shards as holder_shards
from nemo_ckpt.errors import SnapshotNotFoundError
from nemo_ckpt.storage.snapshot_files import read_manifest
from tests.harness import World

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The shard files holders read (``load_shard``), in order."""
    seen: list[str] = []
    original = holder_shards.load_shard

    def load_shard(directory: Any, entry: Any) -> Any:
        seen.append(entry.file)
        return original(directory, entry)

    monkeypatch.setattr(holder_shards, "load_shard", load_shard)
    yield seen


async def crashed_and_restored(world: World, path: Path, ahead: Path | None
                               ) -> tuple[list[Any], frozenset[str]]:
    """The job crashes (every holder goes); a new one reads ``ahead`` ahead, waits,
    then restores ``path``: what the restore hands RL."""
    world.ckpt.shutdown()
    await world.ckpt.ensure_holders()
    if ahead is not None:
        started = await world.ckpt.prefetch(ahead)
        assert started == len(read_manifest(ahead).shards)
        await asyncio.sleep(5)  # virtual time: the reads are done
    async with world.ckpt.restored(path) as restored:
        return sorted(restored.continued_attempts), restored.staging_keys


def scenario(tmp_path: Path, ahead_of: str | None) -> tuple[Any, list[str], list[str]]:
    """Snapshots A and B of one job, then a restore of A (read ahead as ``ahead_of``
    says): what it restored, A's shard files, B's."""
    world = World(tmp_path)
    a, b = world.path("A"), world.path("B")
    try:
        async def run() -> Any:
            live = await world.populate()
            await world.snapshot(a, live)
            client = await world.client("holder-0")
            async with client.turn(live["holder-0"][0]) as turn:  # B differs from A
                turn.complete(b"t9", b"s9", [])
            await world.snapshot(b, live)
            ahead = {None: None, "A": a, "B": b}[ahead_of]
            return await crashed_and_restored(world, a, ahead)

        restored = world.run(run())
    finally:
        world.close()
    return (restored, [s.file for s in read_manifest(a).shards],
            [s.file for s in read_manifest(b).shards])


def test_a_restore_read_ahead_restores_what_one_without_does_reading_each_shard_once(
        tmp_path: Path, reads: list[str]) -> None:
    plain, a_files, _ = scenario(tmp_path / "plain", None)
    reads.clear()
    ahead, a_files_2, _ = scenario(tmp_path / "ahead", "A")
    assert ahead == plain and plain[0]
    assert sorted(reads) == sorted(a_files_2)  # the prefetch's reads, taken by the restore


def test_a_read_ahead_of_another_snapshot_is_dropped_and_the_restore_reads_its_own(
        tmp_path: Path, reads: list[str]) -> None:
    plain, _, _ = scenario(tmp_path / "plain", None)
    reads.clear()
    other, a_files, b_files = scenario(tmp_path / "other", "B")
    assert other == plain
    assert sorted(reads) == sorted(b_files + a_files)


def test_a_prefetch_of_a_path_without_a_snapshot_says_so(tmp_path: Path) -> None:
    world = World(tmp_path)
    try:
        async def run() -> None:
            await world.ckpt.ensure_holders()
            with pytest.raises(SnapshotNotFoundError):
                await world.ckpt.prefetch(world.path("nothing"))

        world.run(run())
    finally:
        world.close()
