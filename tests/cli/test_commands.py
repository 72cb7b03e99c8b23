"""The ``nemo-ckpt`` command line, on real snapshot folders (damaged ones included) and
against live holders on the session's Ray cluster."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

from nemo_ckpt import EnvironmentEpisode as Ep
from nemo_ckpt import SessionClient
from nemo_ckpt.cli.main import main
from nemo_ckpt.cli.status import HolderStatus, holder_status, run_status
from nemo_ckpt.errors import SnapshotReadError
from nemo_ckpt.phases import HolderState
from nemo_ckpt.storage.checkpoint_folder import environment_dir, folder_at
from nemo_ckpt.storage.manifest import FORMAT_VERSION
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import read_snapshot
from nemo_ckpt.testing import StaticCut
from nemo_ckpt.transport import HOLDER
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore, digest_of
from tests.conftest import alive_node_ids
from tests.harness import CONFIG, World
from tests.storage.test_disk_format import (
    edit_manifest,
    flip_middle_byte,
    manifest_path,
    session,
    write_snapshot,
    write_snapshot_v3,
)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def words(text: str) -> list[list[str]]:
    """Each output line as its whitespace-separated words (tables align with spaces)."""
    return [line.split() for line in text.splitlines()]


def shard(root: Path, instance: str, snapshot_id: str = "snap-1") -> Path:
    return environment_dir(root) / shard_file_name(snapshot_id, instance)


def escape_first_shard(data: dict[str, Any]) -> None:
    old = data["shards"][0]["file"]
    data["shards"][0]["file"] = "../outside.msgpack"
    for r in data.get("rollouts", []):
        if r["shard"] == old:
            r["shard"] = "../outside.msgpack"


@pytest.fixture(params=[3, 2], ids=["format-3", "format-2"])
def fmt(request: pytest.FixtureRequest) -> int:
    """The manifest format the snapshots under test are written in: "3", as written now
    (format 6 since the chunk hashes: rollouts in each shard's index), and 2, which lists
    the rollouts in the manifest itself (still read)."""
    return int(request.param)


def write_in(fmt: int, root: Path, by_instance: dict[str, Any], **kw: Any) -> None:
    (write_snapshot_v3 if fmt == 3 else write_snapshot)(root, by_instance, **kw)


@pytest.fixture
def snap_a(tmp_path: Path, fmt: int) -> Path:
    """holder-0: a (attempt 0, 2 turns), b (attempt 2, 2 turns); holder-1: c (attempt 1,
    2 turns); holder-2 holds nothing; 3 rollouts restarted."""
    root = tmp_path / "step-10"
    write_in(fmt, root, {"holder-0": [session("holder-0", "a"), session("holder-0", "b", 2)],
                          "holder-1": [session("holder-1", "c", 1)],
                          "holder-2": []}, snapshot_id="snap-1", restarted=3)
    return root


@pytest.fixture
def snap_b(tmp_path: Path, fmt: int) -> Path:
    """A later snapshot: a finished, b continued as attempt 3 with 5 turns, c unchanged,
    d and e added."""
    root = tmp_path / "step-20"
    write_in(fmt, root, {"holder-0": [session("holder-0", "b", 3, turns=5),
                                       session("holder-0", "e", 1, turns=4)],
                          "holder-1": [session("holder-1", "c", 1),
                                       session("holder-1", "d", 0, turns=1)],
                          "holder-2": []}, snapshot_id="snap-2")
    return root


# Each damage leaves the snapshot unreadable; (how to damage it, what the message says).
MANIFEST_DAMAGE = {
    "no-snapshot": (lambda root: None, "no environment snapshot"),
    "future-version": (lambda root: edit_manifest(root, lambda d: d.update(format_version=99)),
                       "format version 99"),
    "garbage-manifest": (lambda root: manifest_path(root).write_bytes(b"\x00\xff{not json"),
                         "is not valid JSON"),
    "invalid-manifest": (lambda root: edit_manifest(root, lambda d: d.pop("shards")),
                         "does not validate"),
    "escaping-shard-name": (lambda root: edit_manifest(root, escape_first_shard),
                            "not a plain file name"),
    "deeply-nested-manifest": (lambda root: manifest_path(root).write_bytes(
        b"[" * 200_000 + b"]" * 200_000), "nested too deeply"),
}


def damaged(tmp_path: Path, kind: str) -> tuple[Path, str]:
    damage, needle = MANIFEST_DAMAGE[kind]
    root = tmp_path / kind
    if kind != "no-snapshot":
        write_snapshot(root, {"holder-0": [session("holder-0", "a")]})
    damage(root)
    return root, needle


# --- inspect ---------------------------------------------------------------------------


def test_inspect_shows_rollouts_by_instance_with_attempts_turns_shard_bytes_and_metrics(
    snap_a: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "inspect", str(snap_a))
    assert (code, err) == (0, "")
    lines = words(out)
    assert lines[0] == ["snapshot", "snap-1", "at", str(snap_a)]
    assert ["rollouts", "3", "captured,", "3", "restarted"] in [line[:5] for line in lines]
    # Rollouts, grouped by instance; the instance that held nothing still shows.
    assert ["INSTANCE", "ROLLOUT", "ATTEMPT", "TURNS", "STAGING", "KEYS"] in lines
    start = lines.index(["INSTANCE", "ROLLOUT", "ATTEMPT", "TURNS", "STAGING", "KEYS"])
    assert lines[start + 1:start + 5] == [
        ["holder-0", "a", "0", "2", "2"],
        ["holder-0", "b", "2", "2", "2"],
        ["holder-1", "c", "1", "2", "2"],
        ["holder-2", "-", "-", "-", "-"],
    ]
    # Bytes per shard are the files' true sizes.
    for inst, sessions in (("holder-0", "2"), ("holder-1", "1")):
        p = shard(snap_a, inst)
        assert [inst, p.name, str(p.stat().st_size), sessions,
                f"xxh3-128:{xxhash.xxh3_128(p.read_bytes()).hexdigest()}"[:25]] in lines
    assert ["holders_paused_seconds", "0.01"] in lines  # written as paused_seconds


def test_inspect_shows_an_older_releases_figures_under_todays_names_and_counts_as_ints(
    snap_a: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edit_manifest(snap_a, lambda m: m.update(metrics={
        "paused_seconds": 0.02, "bytes_written": 9042.0, "captured_rollouts": 3.0,
        "persist_seconds": 1.0}))
    code, out, err = run(capsys, "inspect", str(snap_a))
    assert (code, err) == (0, "")
    lines = words(out)
    for row in (["holders_paused_seconds", "0.02"], ["bytes_written", "9042"],
                ["captured_rollouts", "3"]):
        assert row in lines
    assert not any(line[:1] == ["paused_seconds"] for line in lines)
    code, out, err = run(capsys, "inspect", "--json", str(snap_a))
    figures = json.loads(out)["metrics"]
    assert figures == {"bytes_written": 9042, "captured_rollouts": 3,
                       "holders_paused_seconds": 0.02, "persist_seconds": 1.0}
    assert '"bytes_written": 9042,' in out and '"persist_seconds": 1.0' in out


def test_inspect_json_carries_the_same_facts_as_fields(
    snap_a: Path, fmt: int, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "inspect", "--json", str(snap_a))
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert (data["snapshot_id"], data["format_version"], data["path"]) == (
        "snap-1", FORMAT_VERSION if fmt == 3 else fmt, str(snap_a))
    assert (data["captured_rollouts"], data["restarted_rollouts"]) == (3, 3)
    assert data["metrics"] == {"holders_paused_seconds": 0.01}  # written as paused_seconds
    by_inst = {i["instance_id"]: i for i in data["instances"]}
    assert list(by_inst) == ["holder-0", "holder-1", "holder-2"]
    assert [(r["rollout_id"], r["attempt"], r["turns"]) for r in by_inst["holder-0"]["rollouts"]
            ] == [("a", 0, 2), ("b", 2, 2)]
    assert by_inst["holder-1"]["rollouts"][0]["staging_keys"] == ["c/row0", "c/row1"]
    assert by_inst["holder-2"] == {"instance_id": "holder-2", "rollouts": [], "shards": [],
                                   "turns": 0, "bytes": 0}
    assert data["unreadable_shards"] == {}
    for inst in ("holder-0", "holder-1"):
        (s,) = by_inst[inst]["shards"]
        p = shard(snap_a, inst)
        assert (s["file"], s["bytes"], s["content_hash"]) == (
            p.name, p.stat().st_size, f"xxh3-128:{xxhash.xxh3_128(p.read_bytes()).hexdigest()}")
        assert by_inst[inst]["bytes"] == p.stat().st_size
    assert data["bytes"] == sum(shard(snap_a, i).stat().st_size for i in ("holder-0", "holder-1"))


def test_inspect_of_an_empty_snapshot_says_it_has_no_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_snapshot(tmp_path, {"holder-0": [], "holder-1": []})
    code, out, err = run(capsys, "inspect", str(tmp_path))
    assert (code, err) == (0, "")
    assert "no shards (the backend held no rollouts)" in out.splitlines()
    assert ["rollouts", "0", "captured,", "0", "restarted"] in [w[:5] for w in words(out)]


def test_inspect_reads_no_payload_so_a_damaged_snapshot_can_still_be_inspected(
    snap_a: Path, fmt: int, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_middle_byte(shard(snap_a, "holder-0"))
    shard(snap_a, "holder-1").unlink()
    code, out, _ = run(capsys, "inspect", str(snap_a))
    assert code == 0
    if fmt == 2:  # the manifest lists every rollout
        assert ["holder-1", "c", "1", "2", "2"] in words(out)
    else:  # the shards' indexes do: a missing shard is named, the others still list
        assert ["holder-0", "b", "2", "2", "2"] in words(out)
        assert f"shard {shard(snap_a, 'holder-1').name}: its index does not read" in out
        assert "run verify" in out


@pytest.mark.parametrize("kind", sorted(MANIFEST_DAMAGE))
def test_inspect_of_an_unreadable_snapshot_is_one_line_on_stderr_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    root, needle = damaged(tmp_path, kind)
    code, out, err = run(capsys, "inspect", str(root))
    assert (code, out) == (1, "")
    assert len(err.splitlines()) == 1
    assert err.startswith("nemo-ckpt inspect: error: ") and needle in err
    assert "Traceback" not in err


def test_inspect_of_the_environment_folder_itself_points_at_its_parent(
    snap_a: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "inspect", str(snap_a / "environment"))
    assert code == 1 and len(err.splitlines()) == 1
    assert f"pass its parent, {snap_a}" in err


# --- verify ----------------------------------------------------------------------------


def test_verify_of_an_intact_snapshot_exits_0_and_lists_every_file_ok(
    snap_a: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "verify", str(snap_a))
    assert (code, err) == (0, "")
    lines = words(out)
    assert ["manifest.json", "ok"] == lines[2][:2]
    for inst in ("holder-0", "holder-1"):
        assert [shard(snap_a, inst).name, "ok"] in [line[:2] for line in lines]
    assert out.splitlines()[-1].startswith(
        "OK: snapshot snap-1 is intact: 2 shards, ")
    assert out.splitlines()[-1].endswith(" bytes, 3 rollouts verified")


def test_verify_of_an_empty_snapshot_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_snapshot(tmp_path, {"holder-0": []})
    code, out, _ = run(capsys, "verify", str(tmp_path))
    assert code == 0 and "OK: snapshot snap-1 is intact: 0 shards, 0 bytes" in out


def test_verify_reports_every_damaged_shard_not_only_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    write_snapshot(root, {f"holder-{i}": [session(f"holder-{i}", f"r{i}")] for i in range(4)})
    flip_middle_byte(shard(root, "holder-0"))
    shard(root, "holder-1").unlink()
    truncated = shard(root, "holder-3")
    truncated.write_bytes(truncated.read_bytes()[:-3])
    code, out, err = run(capsys, "verify", str(root))
    assert code == 1
    verdicts = {line[0]: line[1] for line in words(out) if line and line[0].startswith("shard-")}
    assert verdicts == {shard(root, "holder-0").name: "FAILED",
                        shard(root, "holder-1").name: "FAILED",
                        shard(root, "holder-2").name: "ok",
                        shard(root, "holder-3").name: "FAILED"}
    err_lines = err.splitlines()
    assert err_lines[0] == ("FAILED: snapshot snap-1 has 3 problem(s); a restore from it "
                            "would be refused:")
    problems = err_lines[1:]
    assert len(problems) == 3
    assert f"{shard(root, 'holder-0')} has xxh3-128" in problems[0]
    assert f"{shard(root, 'holder-1')}, named in the manifest, is missing" in problems[1]
    assert f"{shard(root, 'holder-3')} is " in problems[2] and "truncated" in problems[2]


def test_verify_of_a_shard_length_claimed_past_its_real_size_is_a_failed_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    write_snapshot(root, {"holder-0": [session("holder-0", "r0")]})
    edit_manifest(root, lambda d: d["shards"][0].update(bytes=10**15))
    code, out, err = run(capsys, "verify", str(root))
    assert code == 1
    assert [shard(root, "holder-0").name, "FAILED"] in [w[:2] for w in words(out)]
    assert "the manifest says 1000000000000000" in err and "Traceback" not in err


@pytest.fixture
def snap_a2(tmp_path: Path) -> Path:
    """``snap_a`` as format 2 wrote it: its manifest lists every rollout."""
    root = tmp_path / "step-10"
    write_snapshot(root, {"holder-0": [session("holder-0", "a"), session("holder-0", "b", 2)],
                          "holder-1": [session("holder-1", "c", 1)],
                          "holder-2": []}, restarted=3)
    return root


def test_verify_refuses_a_shard_that_holds_other_rollouts_than_its_manifest_lists(
    snap_a2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A well-formed shard whose length and hash were updated to match, but whose
    # sessions are not the ones the (format-2) manifest lists there.
    snap_a = snap_a2
    other = snap_a.parent / "other"
    write_snapshot(other, {"holder-1": [session("holder-1", "z", 1)]})
    data = shard(other, "holder-1").read_bytes()
    shard(snap_a, "holder-1").write_bytes(data)
    edit_manifest(snap_a, lambda d: d["shards"][1].update(
        bytes=len(data), content_hash=f"xxh3-128:{xxhash.xxh3_128(data).hexdigest()}"))
    code, _, err = run(capsys, "verify", str(snap_a))
    assert code == 1
    assert "holds z-a1, which its manifest does not list there" in err
    assert "lacks rollouts its manifest lists there: c" in err


def test_verify_refuses_a_shard_that_holds_one_rollout_twice(
    snap_a2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The counts agree (two sessions, two rollouts listed), but one rollout is doubled
    # and the other is absent: a restore would install the wrong set of sessions.
    snap_a = snap_a2
    directory = environment_dir(snap_a)
    name = shard(snap_a, "holder-1").name
    entry = write_shard(directory, name, "holder-1",
                        [session("holder-1", "c", 1), session("holder-1", "c", 1)])

    def list_x_too(d: dict[str, Any]) -> None:
        d["shards"][1].update(bytes=entry.bytes, content_hash=entry.content_hash, sessions=2)
        d["rollouts"].append({"instance_id": "holder-1", "rollout_id": "x", "attempt": 0,
                              "turns": 0, "staging_keys": [], "shard": name})

    edit_manifest(snap_a, list_x_too)
    code, _, err = run(capsys, "verify", str(snap_a))
    assert code == 1
    assert "holds rollout 'c' twice" in err
    assert "lacks rollouts its manifest lists there: x" in err


def test_verify_refuses_a_format_3_shard_holding_a_rollout_twice_or_another_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Format 3 lists rollouts in each shard's index: a crafted shard, whose hash was
    # fixed in the manifest, is caught by what it holds.
    root = tmp_path / "crafted"
    write_snapshot_v3(root, {"holder-0": [session("holder-0", "a"), session("holder-0", "b")],
                             "holder-1": [session("holder-1", "c")]}, snapshot_id="snap-1")
    directory = environment_dir(root)
    twice = write_shard(directory, shard(root, "holder-0").name, "holder-0",
                        [session("holder-0", "a"), session("holder-0", "a", 3)])
    theirs = write_shard(directory, shard(root, "holder-1").name, "holder-1",
                         [session("holder-1", "a")])
    edit_manifest(root, lambda d: [d["shards"][k].update(
        e.model_dump(include={"bytes", "content_hash", "chunks"}))
        for k, e in ((0, twice), (1, theirs))])
    code, _, err = run(capsys, "verify", str(root))
    assert code == 1
    assert "holds rollout 'a' twice" in err
    assert "rollout 'a' is in two shards" in err


@pytest.mark.parametrize("kind", sorted(MANIFEST_DAMAGE))
def test_verify_of_an_unreadable_manifest_is_one_line_on_stderr_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    root, needle = damaged(tmp_path, kind)
    code, out, err = run(capsys, "verify", str(root))
    assert (code, out) == (1, "")
    assert len(err.splitlines()) == 1
    assert err.startswith("nemo-ckpt verify: error: ") and needle in err


@pytest.mark.parametrize("damage", [
    lambda root: None,
    lambda root: flip_middle_byte(shard(root, "holder-0")),
    lambda root: shard(root, "holder-1").unlink(),
    lambda root: shard(root, "holder-0").write_bytes(b""),
    lambda root: edit_manifest(root, lambda d: d.update(format_version=3)),
    lambda root: edit_manifest(root, escape_first_shard),
    lambda root: manifest_path(root).unlink(),
], ids=["intact", "flipped-byte", "missing-shard", "emptied-shard", "future-version",
        "escaping-name", "no-manifest"])
def test_verify_passes_exactly_the_snapshots_a_restore_reads(
    snap_a: Path, capsys: pytest.CaptureFixture[str], damage: Any
) -> None:
    damage(snap_a)
    try:
        read_snapshot(snap_a)
        restorable = True
    except SnapshotReadError:
        restorable = False
    code, _, _ = run(capsys, "verify", str(snap_a))
    assert code == (0 if restorable else 1)


# --- diff ------------------------------------------------------------------------------


def test_diff_shows_rollouts_added_finished_and_the_turns_each_advanced(
    snap_a: Path, snap_b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "diff", str(snap_a), str(snap_b))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"A  snap-1 at {snap_a} (created ")
    assert lines[1].startswith(f"B  snap-2 at {snap_b} (created ")
    assert lines[2] == "2 added, 1 finished, 2 continued (+3 turns), restarted 3 -> 0"
    table = words(out)
    added = table.index(["ADDED", "INSTANCE", "ATTEMPT", "TURNS"])
    # Sorted by instance, then rollout.
    assert table[added + 1:added + 3] == [["e", "holder-0", "1", "4"],
                                         ["d", "holder-1", "0", "1"]]
    finished = table.index(["FINISHED", "INSTANCE", "ATTEMPT", "TURNS"])
    assert table[finished + 1:finished + 2] == [["a", "holder-0", "0", "2"]]
    continued = table.index(["CONTINUED", "INSTANCE", "ATTEMPT", "TURNS", "ADVANCED"])
    assert table[continued + 1:] == [
        ["b", "holder-0", "2", "->", "3", "2", "->", "5", "+3"],
        ["c", "holder-1", "1", "2", "->", "2", "+0"],
    ]


def test_diff_names_a_rollout_that_moved_instance_and_a_backwards_comparison(
    snap_a: Path, snap_b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = tmp_path / "moved"
    write_snapshot(moved, {"holder-0": [], "holder-1": [session("holder-1", "a", 1, turns=3)]},
                   snapshot_id="snap-3")
    code, out, _ = run(capsys, "diff", str(snap_a), str(moved))
    assert code == 0
    assert ["a", "holder-0", "->", "holder-1", "0", "->", "1", "2", "->", "3", "+1"] in words(out)
    code, out, _ = run(capsys, "diff", str(snap_b), str(snap_a))
    assert code == 0
    assert "note: B was created before A; the changes below read backwards" in out


def test_diff_of_identical_snapshots_changes_nothing(
    snap_a: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "diff", str(snap_a), str(snap_a))
    assert code == 0
    assert "0 added, 0 finished, 3 continued (+0 turns), restarted 3 -> 3" in out
    assert "no rollouts added" in out and "no rollouts finished" in out


@pytest.mark.parametrize("kind", ["no-snapshot", "garbage-manifest", "future-version"])
def test_diff_with_an_unreadable_side_is_one_line_on_stderr_and_exit_1(
    snap_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    root, needle = damaged(tmp_path, kind)
    for argv in (("diff", str(snap_a), str(root)), ("diff", str(root), str(snap_a))):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (1, "")
        assert len(err.splitlines()) == 1
        assert err.startswith("nemo-ckpt diff: error: ") and needle in err and str(root) in err


# --- gc ---------------------------------------------------------------------------------


def test_gc_refuses_a_held_store_at_once_and_with_wait_collects_once_the_hold_is_seen_dead(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = BlobStore(str(tmp_path / BLOB_DIR), folder_at)
    stray = digest_of(b"nobody references this")
    store.put(stray, b"nobody references this")
    store.claims.hold("snap-dead", "a-job-that-died", ttl_s=0.05)
    assert main(["gc", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "in use by snapshot(s) ['snap-dead']" in err
    assert "run gc again later, or with --wait SECONDS" in err
    assert stray in store.digests()
    assert main(["gc", str(tmp_path), "--wait", "10"]) == 0
    assert "removed 1 unreferenced blob(s)" in capsys.readouterr().out
    assert store.digests() == set()
    with pytest.raises(SystemExit) as exit_info:
        main(["gc", str(tmp_path), "--wait", "-1"])
    assert exit_info.value.code == 2


# --- the entry points ------------------------------------------------------------------


def test_a_missing_or_unknown_command_is_a_usage_error(
    capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in ([], ["bogus"], ["inspect"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "usage: nemo-ckpt" in capsys.readouterr().err


def test_the_installed_console_script_and_python_m_run_the_cli(
    snap_a: Path, tmp_path: Path
) -> None:
    script = Path(sys.executable).with_name("nemo-ckpt")
    assert script.exists(), f"{script} is missing: run `pip install -e .` to install it"
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([str(script), "inspect", "--json", str(snap_a)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["snapshot_id"] == "snap-1"

    flip_middle_byte(shard(snap_a, "holder-1"))
    done = subprocess.run([sys.executable, "-m", "nemo_ckpt", "verify", str(snap_a)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1
    assert "FAILED: snapshot snap-1 has 1 problem(s)" in done.stderr
    assert "Traceback" not in done.stderr

    done = subprocess.run([str(script), "inspect", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("nemo-ckpt inspect: error: no environment snapshot at ")


def test_inspect_verify_and_diff_run_without_importing_ray(snap_a: Path, snap_b: Path) -> None:
    # A fresh interpreter: this one has imported Ray already.
    script = ("import sys\n"
              "from nemo_ckpt.cli.main import main\n"
              "codes = [main([c, *sys.argv[1:2]]) for c in ('inspect', 'verify')]\n"
              "codes.append(main(['diff', *sys.argv[1:]]))\n"
              "print(codes, 'ray' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script, str(snap_a), str(snap_b)],
                          capture_output=True, text=True, timeout=60)
    assert done.stderr.splitlines()[-1] == "[0, 0, 0] False", done.stderr


def test_status_against_an_address_where_nothing_answers_fails_fast_with_one_line() -> None:
    script = Path(sys.executable).with_name("nemo-ckpt")
    started = time.monotonic()
    done = subprocess.run([str(script), "status", "--address", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 15, "no 20 s of ray.init retries"
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(
        "nemo-ckpt status: error: cannot connect to a Ray cluster at '127.0.0.1:1': "
        "nothing answers there")
    assert "Connection refused" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "-1"], "argument --timeout: must be above 0, not -1"),
    (["--timeout", "soon"], "argument --timeout: 'soon' is not a number"),
    (["--namespace", ""], "argument --namespace: must not be empty"),
    (["--address", "127.0.0.1:99999"],
     "argument --address: '127.0.0.1:99999' has no valid port (1-65535)"),
    (["--address", "head-node"], "argument --address: 'head-node' is not a cluster address"),
    (["--address", "local"], "argument --address: 'local' would start a new, empty Ray instance"),
])
def test_status_refuses_a_bad_option_as_a_usage_error_before_ray_starts(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["status", *argv])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.startswith("usage: nemo-ckpt status")
    assert f"nemo-ckpt status: error: {message}" in err


# --- status through the transport (the in-process world, virtual time) ------------------


def test_holder_status_names_a_dead_holder_and_one_that_does_not_answer_in_time(
        world: World) -> None:
    # Ray keeps a dead actor's name a while: status still finds the holder, its call fails.
    world.sim.death_delay = lambda actor: (0.0, 60.0)

    async def scenario() -> list[HolderStatus]:
        await world.populate()
        holders = {a.name: a for a in world.sim.live(HOLDER)}
        world.sim.kill(holders["holder-1"])
        world.sim.stall([holders["holder-2"]], seconds=30.0, detect=60.0)
        return await holder_status(world.sim.transport(world.driver, CONFIG), timeout_s=2.0)

    found = world.run(scenario())
    assert [(h.instance_id, h.error) for h in found] == [
        ("holder-0", None),
        ("holder-1", "unreachable (ActorDied)"),
        ("holder-2", "no answer within 2s"),
    ]
    info = found[0].info
    assert info is not None and info.state is HolderState.RUNNING and info.sessions == 2


# --- status (live holders on the session's cluster) -------------------------------------


def status_rows(out: str) -> dict[str, list[str]]:
    """The status table's rows by instance id."""
    return {line[0]: line for line in words(out)[2:] if line}


@pytest.mark.timeout(60)
async def test_status_shows_every_holder_with_its_node_state_and_sessions(
    ckpt: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = ckpt.config.namespace
    client = await SessionClient.connect("holder-1", namespace=ns)
    await client.open(Ep("r1", 0))
    await client.open(Ep("r2", 3))
    code = await asyncio.to_thread(run_status, ns)
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == (f"namespace {ns}: 3 holders, coordinator running, "
                                   f"last snapshot none")
    rows = status_rows(out)
    assert sorted(rows) == ["holder-0", "holder-1", "holder-2"]
    # INSTANCE STATE SESSIONS IN-FLIGHT LAST-SNAPSHOT LEASE NODE-ID NODE-ADDRESS
    assert {inst: row[1:6] for inst, row in rows.items()} == {
        "holder-0": ["running", "0", "0", "-", "-"],
        "holder-1": ["running", "2", "0", "-", "-"],
        "holder-2": ["running", "0", "0", "-", "-"],
    }
    assert {row[6] for row in rows.values()} == alive_node_ids()
    assert all("dead" not in " ".join(row) for row in rows.values())


@pytest.mark.timeout(60)
async def test_status_shows_a_paused_holders_snapshot_and_lease_then_the_last_snapshot(
    ckpt: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = ckpt.config.namespace
    client = await SessionClient.connect("holder-0", namespace=ns)
    await client.open(Ep("r", 0))
    async with ckpt.snapshot(tmp_path / "step-1") as snap:
        assert snap is not None
        await snap.check_against_cut(StaticCut({"holder-0": {Ep("r", 0)}}))
        code = await asyncio.to_thread(run_status, ns)
        out, _ = capsys.readouterr()
        assert code == 0
        for inst, row in status_rows(out).items():
            # paused for <id>, and a lease that expires within the configured 4 s
            assert row[1:4] == ["paused", "for", snap.snapshot_id], inst
            lease = row[row.index("in") + 1]
            assert lease.endswith("s") and 0 < float(lease[:-1]) <= ckpt.config.lease_s
    code = await asyncio.to_thread(main, ["status", "--namespace", ns])
    out, _ = capsys.readouterr()
    assert code == 0
    assert out.splitlines()[0].endswith(f"last snapshot {snap.snapshot_id}")
    assert {inst: row[1:5] for inst, row in status_rows(out).items()} == {
        "holder-0": ["running", "1", "0", snap.snapshot_id],
        "holder-1": ["running", "0", "0", snap.snapshot_id],
        "holder-2": ["running", "0", "0", snap.snapshot_id],
    }


@pytest.mark.timeout(60)
def test_status_in_a_namespace_without_holders_says_so_and_exits_1(
    cluster: Any, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    code = main(["status", "--namespace", namespace])
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err.startswith(f"nemo-ckpt status: no nemo-ckpt holders in namespace "
                          f"{namespace!r} on the cluster at ")
    assert len(err.splitlines()) == 1
    # status reused the test's connection and left it open, and created nothing.
    assert ray.is_initialized()
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a.get("namespace") == namespace]
