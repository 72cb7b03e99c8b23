"""The Python API for looking into snapshots: ``inspect_snapshot``, ``verify_snapshot`` and
``diff_snapshots`` return typed results, importable from ``nemo_ckpt`` without Ray, and
the command line prints what they return."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import nemo_ckpt
from nemo_ckpt import (
    SnapshotDiff,
    SnapshotSummary,
    VerifyReport,
    diff_snapshots,
    inspect_snapshot,
    verify_snapshot,
)
from nemo_ckpt.cli.main import main
from nemo_ckpt.errors import SnapshotNotFoundError, SnapshotReadError
from nemo_ckpt.storage.manifest import FORMAT_VERSION
from tests.catalog.test_listing import first_shard
from tests.storage.test_disk_format import flip_middle_byte, session, write_snapshot_v3


@pytest.fixture
def a(tmp_path: Path) -> Path:
    write_snapshot_v3(tmp_path / "a", {
        "holder-0": [session("holder-0", "x"), session("holder-0", "y", 2)],
        "holder-1": []}, snapshot_id="snap-a", restarted=1)
    return tmp_path / "a"


@pytest.fixture
def b(tmp_path: Path) -> Path:
    write_snapshot_v3(tmp_path / "b", {
        "holder-0": [session("holder-0", "y", 2, turns=5), session("holder-0", "z")],
        "holder-1": []}, snapshot_id="snap-b")
    return tmp_path / "b"


def test_inspect_snapshot_gives_rollouts_and_shards_by_instance_as_typed_fields(a: Path) -> None:
    summary = inspect_snapshot(a)
    assert isinstance(summary, SnapshotSummary)
    assert (summary.snapshot_id, summary.format_version, summary.captured_rollouts,
            summary.restarted_rollouts) == ("snap-a", FORMAT_VERSION, 2, 1)
    holder_0, holder_1 = summary.instances
    assert [(r.rollout_id, r.attempt, r.turns) for r in holder_0.rollouts] == [
        ("x", 0, 2), ("y", 2, 2)]
    assert holder_0.rollouts[0].staging_keys == ("x/row0", "x/row1")
    assert holder_0.turns == 4 and holder_0.bytes == summary.bytes == holder_0.shards[0].bytes
    assert (holder_1.instance_id, holder_1.rollouts, holder_1.shards) == ("holder-1", [], [])
    assert summary.unreadable_shards == {} and summary.sandboxes.directories == 0


def test_inspect_json_prints_the_summarys_fields(
        a: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(a)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == inspect_snapshot(a).to_json()
    assert printed["instances"][0]["rollouts"][1] == {
        "rollout_id": "y", "attempt": 2, "turns": 2, "staging_keys": ["y/row0", "y/row1"],
        "shard": inspect_snapshot(a).instances[0].shards[0].file}


def test_inspect_snapshot_of_a_path_without_one_raises_the_read_error(tmp_path: Path) -> None:
    with pytest.raises(SnapshotNotFoundError, match="no environment snapshot at"):
        inspect_snapshot(tmp_path)


def test_verify_snapshot_reports_every_problem_as_fields(a: Path) -> None:
    assert isinstance(verify_snapshot(a), VerifyReport) and verify_snapshot(a).ok
    flip_middle_byte(first_shard(a))
    report = verify_snapshot(a)
    assert not report.ok and report.manifest is not None
    (problems,) = [p for p in report.shards.values() if p]
    assert len(problems) == 1 and "its content changed after the snapshot" in problems[0]


def test_diff_snapshots_gives_added_finished_and_continued_rollouts(a: Path, b: Path) -> None:
    diff = diff_snapshots(a, b)
    assert isinstance(diff, SnapshotDiff)
    assert [r.rollout_id for r in diff.added] == ["z"]
    assert [r.rollout_id for r in diff.finished] == ["x"]
    assert [(ra.turns, rb.turns) for ra, rb in diff.continued] == [(2, 5)]
    assert diff.turns_advanced == 3 and diff.directories == {}


def test_diff_snapshots_with_a_shard_index_that_does_not_read_raises_naming_it(
        a: Path, b: Path) -> None:
    shard = first_shard(b)
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(SnapshotReadError, match=f"shard {shard.name} of {b} does not read"):
        diff_snapshots(a, b)


def test_every_public_name_imports_from_nemo_ckpt_without_ray() -> None:
    script = ("import sys, nemo_ckpt\n"
              "missing = [n for n in nemo_ckpt.__all__ if not hasattr(nemo_ckpt, n)]\n"
              "print(missing, 'ray' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "[] False", done.stderr
    assert {"list_snapshots", "latest_snapshot", "remove_snapshot", "keep_last",
            "inspect_snapshot", "verify_snapshot", "diff_snapshots"} <= set(nemo_ckpt.__all__)
