"""The figures a driver gets from a snapshot (``RaySnapshot.metrics``) and a restore
(``last_restore_metrics``), and those the manifest records: seconds as floats, bytes and
counts as ints, and the caller's ``paused_seconds`` apart from the backend's own
``holders_paused_seconds`` (issue 36). In-process (``actors.sim``): the real driver,
coordinator and holders."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.storage.snapshot_files import read_manifest
from tests.harness import World, cut_of

pytestmark = pytest.mark.timeout(60)

COUNTS = ("bytes_written", "captured_rollouts", "restarted_rollouts", "restart_only_rollouts",
          "holders", "state_bytes",
          "replay_restarted_rollouts", "not_held_rollouts", "orphan_staging_rows",
          "finished_rollouts")
SECONDS = ("paused_seconds", "holders_paused_seconds", "entry_seconds", "drain_seconds",
           "capture_seconds", "persist_seconds", "snapshot_seconds")


@pytest.fixture
def job(tmp_path: Path) -> Iterator[World]:
    j = World(tmp_path)
    try:
        yield j
    finally:
        j.close()


def types(figures: dict[str, Any]) -> dict[str, str]:
    return {k: type(v).__name__ for k, v in figures.items()}


def test_counts_and_bytes_are_ints_and_seconds_floats_in_metrics_manifest_and_restore(
        job: World) -> None:
    path = job.path("step-1")

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
        live = await job.populate()
        async with job.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(cut_of(live))
        figures = snap.metrics(1)
        await job.ckpt.retire([ep for eps in live.values() for ep in eps])
        async with job.ckpt.restored(path):
            pass
        return figures, dict(read_manifest(path).metrics), job.ckpt.last_restore_metrics

    figures, recorded, restore = job.run(scenario())
    assert types(figures) == {**{k: "int" for k in COUNTS}, **{k: "float" for k in SECONDS}}
    assert figures["bytes_written"] > 0 and figures["captured_rollouts"] == 6
    # Not the caller's figure, nor the whole save's (known once the manifest is written).
    assert types(recorded) == {k: t for k, t in types(figures).items()
                               if k not in ("paused_seconds", "snapshot_seconds")}
    assert restore is not None and types(restore) == {
        "bytes_read": "int", "continued_rollouts": "int", "read_seconds": "float",
        "restore_seconds": "float"}
    assert (restore["bytes_read"], restore["continued_rollouts"]) == (
        figures["bytes_written"], 6)


def test_paused_seconds_is_the_callers_and_holders_paused_seconds_the_backends_own(
        job: World) -> None:
    path = job.path("step-1")

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        live = await job.populate()
        async with job.ckpt.snapshot(path) as snap:
            assert snap is not None
            await snap.check_against_cut(cut_of(live))
            inside = snap.metrics(0.0)
            await asyncio.sleep(2.0)  # RL saves its half: the holders stay paused
        return inside, snap.metrics(7.5), dict(read_manifest(path).metrics)

    inside, after, recorded = job.run(scenario())
    assert "holders_paused_seconds" not in inside  # known once the block has exited
    assert after["paused_seconds"] == 7.5  # as the caller passed it
    assert 2.0 <= after["holders_paused_seconds"] < 2.5
    assert recorded["holders_paused_seconds"] == after["holders_paused_seconds"]
    assert "paused_seconds" not in recorded
