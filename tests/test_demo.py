"""The main job: a crashed run restores both halves and ends exactly like a run that
never crashed. Also the toy environment's determinism, which that comparison rests on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.sessions import SessionRecord
from nemo_ckpt.testing import (
    DATA_PLANE_FILE,
    DemoOptions,
    ToyState,
    initial_state,
    latest_committed_snapshot,
    ordered_staging_keys,
    reference_trajectory,
    run_demo,
    step,
)

ROOT = Path(__file__).resolve().parent.parent


# --- the toy environment ------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_a_rollout_is_a_pure_function_of_seed_and_rollout_id() -> None:
    first = reference_trajectory(7, "r0003", 10)
    assert reference_trajectory(7, "r0003", 10) == first
    assert reference_trajectory(8, "r0003", 10) != first
    assert reference_trajectory(7, "r0004", 10) != first
    records, rows = first
    assert [r["turn"] for r in records] == [r["turn"] for r in rows] == list(range(10))
    assert all("attempt" not in json.dumps(x) for x in (*records, *rows))


@pytest.mark.timeout(10)
def test_a_turn_continued_from_the_saved_state_bytes_matches_an_uninterrupted_run() -> None:
    records, _ = reference_trajectory(1, "r0", 8)
    state = initial_state(1, "r0", 8)
    got = []
    for _ in range(4):
        state, record, _row = step(state)
        got.append(record)
    state = ToyState.from_bytes(state.to_bytes())  # what a restored session hands back
    while not state.done:
        state, record, _row = step(state)
        got.append(record)
    assert tuple(got) == records
    with pytest.raises(ValueError, match="already ran"):
        step(state)


@pytest.mark.timeout(10)
def test_staging_keys_are_put_in_turn_order_across_attempts() -> None:
    session = SessionRecord(
        "holder-0", Ep("r", 1), turns=(b"0", b"1", b"2"),
        staging_keys=frozenset({"r-a1/t0002", "r/t0000", "r/t0001"}),
        earlier_capture_keys=("r",))
    assert ordered_staging_keys(session) == ("r/t0000", "r/t0001", "r-a1/t0002")
    broken = SessionRecord("holder-0", Ep("r", 0), turns=(b"0",), staging_keys=frozenset())
    with pytest.raises(ValueError, match="exactly one"):
        ordered_staging_keys(broken)


# --- the run ------------------------------------------------------------------------------


# Small, but long enough (>= 2 waves of 12 turns per worker slot) that the crash after
# the second snapshot lands mid-run even on a fast machine.
SMALL = dict(rollouts=12, turns=12, snapshot_every_s=0.4, crash_after_snapshots=2,
             rollouts_per_worker=2, turn_seconds=0.05)


@pytest.mark.timeout(120)
async def test_a_crashed_run_restores_mid_rollout_and_ends_like_the_crash_free_run(
        cluster: Any, tmp_path: Path) -> None:
    import ray

    options = DemoOptions(checkpoint_dir=tmp_path, namespace="t-demo",
                          **SMALL)  # type: ignore[arg-type]
    report = await run_demo(options)

    assert report.verified, f"trajectories differ: {report.mismatched_rollouts}"
    assert report.matches_pure_function
    assert report.turns_total == 144
    # Rollouts came back mid-rollout, with their turns, not from turn 0.
    assert report.rollouts_restored >= 1 and report.turns_restored >= 1
    # The crash cost at most the turns run since the last committed snapshot.
    assert 0 <= report.turns_rerun <= report.turns_since_last_snapshot
    assert report.snapshots >= 2
    assert 0 < report.pause_seconds_p50 <= report.pause_seconds_max
    # Committed snapshots stay on disk, each with both halves.
    restored_from = Path(report.restored_from)
    assert latest_committed_snapshot(restored_from.parent) == Path(report.snapshot_paths[-1])
    for path in map(Path, report.snapshot_paths):
        assert (path / "environment" / "manifest.json").is_file()
        assert (path / DATA_PLANE_FILE).is_file()
    # Every actor the run started is gone.
    left = [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace", "").startswith("t-demo")]
    assert left == []


@pytest.mark.timeout(150)
def test_the_example_joins_an_existing_cluster_writes_its_json_and_exits_zero(
        cluster: Any, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "turn_level_recovery.py"),
         "--address", cluster.address, "--rollouts", "8", "--turns", "12",
         "--snapshot-every", "0.4", "--crash-after-snapshots", "1",
         "--rollouts-per-worker", "2", "--turn-seconds", "0.06", "--seed", "3",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--json", str(out)],
        capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "VERIFIED" in proc.stdout and "snapshot pause p50" in proc.stdout
    data = json.loads(out.read_text())
    for key in ("verified", "rollouts", "turns_total", "turns_restored", "turns_rerun",
                "rollouts_restarted", "snapshots", "pause_seconds_p50",
                "pause_seconds_max"):
        assert key in data
    assert data["verified"] is True and data["rollouts"] == 8 and data["seed"] == 3
    assert any((tmp_path / "ckpt").glob("run-*/snapshot-*/environment/manifest.json"))
