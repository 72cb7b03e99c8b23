"""The main job: a crashed run restores both halves and ends exactly like a run that
never crashed. Also the toy environment's determinism, which that comparison rests on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from examples.recovery_demo import DemoError, DemoOptions, latest_committed_snapshot, run_demo
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.testing import (
    DATA_PLANE_FILE,
    ToyState,
    initial_state,
    ordered_staging_keys,
    reference_trajectory,
    step,
)
from tests.examples import load_example

ROOT = Path(__file__).resolve().parents[2]


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
    # No finished rollout was lost (verified: every one has its trajectory) or run again.
    assert report.rollouts_run_twice == ()
    # Rollouts came back mid-rollout, with their turns, not from turn 0.
    assert report.rollouts_restored >= 1 and report.turns_restored >= 1
    # The crash cost at most the turns run since the last committed snapshot.
    assert 0 <= report.turns_rerun <= report.turns_since_last_snapshot
    assert report.snapshots >= 2
    assert 0 < report.pause_seconds_p50 <= report.pause_seconds_max
    # Every rollout's final directory equals the crash-free run's, byte for byte; the
    # first snapshot wrote the repository once, later ones only what turns changed.
    assert report.sandboxes and report.directories_compared == 12
    assert report.mismatched_directories == ()
    first, *later = report.snapshot_new_blob_bytes
    assert first > 64 << 10 and later and max(later) < first
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


@pytest.mark.timeout(120)
async def test_a_crashed_run_restores_from_a_bucket_and_writes_nothing_local(
        cluster: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_ckpt.storage.checkpoint_folder import environment_folder, folder_at
    from tests.s3_server import BUCKET

    monkeypatch.chdir(tmp_path)
    root = f"s3://{BUCKET}/demo-test"
    options = DemoOptions(checkpoint_dir=root, namespace="t-demo-s3",
                          **SMALL)  # type: ignore[arg-type]
    report = await run_demo(options)

    assert report.verified, f"trajectories differ: {report.mismatched_rollouts}"
    assert report.rollouts_restored >= 1 and report.turns_restored >= 1
    assert report.restored_from.startswith(f"{root}/run-")
    run_dir = report.restored_from.rsplit("/", 1)[0]
    assert latest_committed_snapshot(run_dir) == report.snapshot_paths[-1]
    for path in report.snapshot_paths:
        assert "manifest.json" in environment_folder(path).names()
        assert DATA_PLANE_FILE in folder_at(path).names()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(150)
def test_the_example_joins_an_existing_cluster_writes_its_json_and_exits_zero(
        cluster: Any, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    traces = tmp_path / "spans.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "turn_level_recovery.py"),
         "--trace-file", str(traces),
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
    assert data["directories_compared"] == 8 and data["mismatched_directories"] == []
    assert len(data["snapshot_bytes_written"]) == data["snapshots"]
    assert "every rollout's directory, byte for byte" in proc.stdout
    assert any((tmp_path / "ckpt").glob("run-*/snapshot-*/environment/manifest.json"))
    assert_one_trace_per_operation_across_processes(traces)


def assert_one_trace_per_operation_across_processes(traces: Path) -> None:
    """The trace file a run wrote: each snapshot and restore is one trace, from the
    driver through the coordinator to the holders, every phase in it."""
    spans = [json.loads(line) for line in traces.read_text().splitlines()]
    assert spans and all({"name", "trace_id", "span_id", "parent_id", "pid"} <= s.keys()
                         for s in spans)
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    for root_name, phases in (
            ("nemo_ckpt.snapshot", {"nemo_ckpt.snapshot.begin", "nemo_ckpt.pause",
                                    "nemo_ckpt.drain", "nemo_ckpt.capture",
                                    "nemo_ckpt.persist", "nemo_ckpt.commit"}),
            ("nemo_ckpt.restore", {"nemo_ckpt.restore.prepare", "nemo_ckpt.prepare",
                                   "nemo_ckpt.verify", "nemo_ckpt.install",
                                   "nemo_ckpt.restore.commit"})):
        roots = [s for s in spans if s["name"] == root_name and s["parent_id"] is None]
        assert roots, f"no {root_name} trace in {traces}"
        full = [t for t in (by_trace[r["trace_id"]] for r in roots)
                if phases <= {s["name"] for s in t}]
        assert full, f"no {root_name} trace holds every phase {sorted(phases)}"
        trace = full[0]
        # The driver, the coordinator and the holders: one trace over 3 processes or more.
        assert len({s["pid"] for s in trace}) >= 3, trace
        ids = {s["span_id"] for s in trace}
        assert all(s["parent_id"] in ids for s in trace if s["parent_id"] is not None)
        assert {s["attributes"].get("nemo_ckpt.outcome") for s in trace} == {"ok"}
        assert len({s["attributes"].get("nemo_ckpt.operation.id") for s in trace}) == 1


# --- options, checked before Ray starts -----------------------------------------------------


def bad_options(tmp_path: Path) -> list[tuple[list[str], str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    return [
        (["--turns", "-1"], "argument --turns: must be at least 1, not -1"),
        (["--rollouts", "0"], "argument --rollouts: must be at least 1, not 0"),
        (["--nodes", "two"], "argument --nodes: 'two' is not a whole number"),
        (["--snapshot-every", "0"], "argument --snapshot-every: must be above 0, not 0"),
        (["--turn-seconds", "-0.5"], "argument --turn-seconds: must be 0 or more, not -0.5"),
        (["--crash-after-snapshots", "0"], "argument --crash-after-snapshots: must be at "
                                           "least 1, not 0"),
        (["--address", "head"], "argument --address: 'head' is not a cluster address"),
        (["--checkpoint-dir", "/dev/null/ckpt"],
         "argument --checkpoint-dir: /dev/null is not a folder"),
        (["--checkpoint-dir", str(a_file / "ckpt")],
         f"argument --checkpoint-dir: {a_file} is not a folder"),
        (["--checkpoint-dir", "/proc/nemo-ckpt/ckpt"],
         "argument --checkpoint-dir: cannot write under /proc/nemo-ckpt/ckpt"),
        (["--json", "/dev/null/out.json"], "argument --json: /dev/null is not a folder"),
        (["--json", str(tmp_path)], f"argument --json: {tmp_path} is a folder"),
    ]


@pytest.mark.timeout(30)
def test_every_bad_demo_option_is_a_usage_error_and_leaves_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("turn_level_recovery")
    for argv, message in bad_options(tmp_path):
        with pytest.raises(SystemExit) as exit_:
            example.parse_args([*argv, "--checkpoint-dir", str(tmp_path / "ckpt")]
                               if "--checkpoint-dir" not in argv else argv)
        _, err = capsys.readouterr()
        assert exit_.value.code == 2, argv
        assert err.startswith("usage: "), argv
        assert f"error: {message}" in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.timeout(60)
def test_the_demo_refuses_a_bad_option_before_any_ray_process_starts(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "turn_level_recovery.py"), "--turns", "-1",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "error: argument --turns: must be at least 1, not -1" in proc.stderr
    assert "Traceback" not in proc.stderr and "starting a local Ray" not in proc.stderr
    assert time.monotonic() - started < 20, "refused before a cluster started"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
async def test_a_failed_run_leaves_no_folder_behind(cluster: Any, tmp_path: Path) -> None:
    # Two short rollouts finish long before a fifth snapshot: the run fails as asked.
    options = DemoOptions(checkpoint_dir=tmp_path / "new" / "ckpt", namespace="t-demo-fail",
                          rollouts=2, turns=2, crash_after_snapshots=5, turn_seconds=0.01,
                          snapshot_every_s=0.3)
    with pytest.raises(DemoError, match="finished"):
        await run_demo(options)
    assert list(tmp_path.iterdir()) == []


# --- the minimal example --------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_the_minimal_example_recovers_with_its_finished_results_and_no_orphan_rows(
        tmp_path: Path) -> None:
    # As the README runs it: its own 2-node embedded cluster, from the repository root.
    proc = subprocess.run(
        [sys.executable, "examples/minimal_driver.py", "--checkpoint-dir",
         str(tmp_path / "ckpt"), "--namespace", "t-minimal-embedded"],
        capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("namespace t-minimal-embedded: session holders holder-0, "
                               "holder-1; see them with: nemo-ckpt status --address ")
    # r1's result was with the backend only: captured finished, no row left orphaned.
    assert "4 rollouts captured" in lines[1] and "1 dispatched but not held (r5)" in lines[1]
    assert "1 finished (r1), 0 orphan staging rows" in lines[1]
    assert "3 rollouts continue mid-rollout, 1 start over, 1 finished result(s) handed " \
           "back" in lines[3]
    assert lines[-1] == ("VERIFIED: 6 rollouts x 6 turns equal a run without a crash; 9 "
                         "turns were restored, not re-run")
    assert "Traceback" not in proc.stderr
    snapshot = tmp_path / "ckpt" / "step-1"
    assert (snapshot / "environment" / "manifest.json").is_file()
    assert (snapshot / "data_plane.json").is_file()


@pytest.mark.timeout(30)
def test_every_bad_minimal_example_option_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("minimal_driver")
    for argv, message in [
        (["--turns", "2"], "argument --turns: must be at least 4, not 2"),
        (["--rollouts", "1"], "argument --rollouts: must be at least 3, not 1"),
        (["--nodes", "0"], "argument --nodes: must be at least 1, not 0"),
        (["--namespace", ""], "argument --namespace: must not be empty"),
        (["--address", "10.0.0.1"], "argument --address: '10.0.0.1' is not a cluster address"),
        (["--checkpoint-dir", "/dev/null/ckpt"],
         "argument --checkpoint-dir: /dev/null is not a folder"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            example.parse_args(argv)
        _, err = capsys.readouterr()
        assert exit_.value.code == 2 and f"error: {message}" in err, (argv, err)
