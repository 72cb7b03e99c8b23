"""``nemo-ckpt ls`` and ``nemo-ckpt rm`` on real snapshot folders, damaged and claimed
ones included (the core they render: tests/catalog/test_listing.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.catalog.listing import list_snapshots
from nemo_ckpt.cli.main import main
from nemo_ckpt.storage.checkpoint_folder import environment_dir, environment_folder
from nemo_ckpt.storage.claims import encode_claim
from tests.catalog.test_listing import _claim_as_snapshot, first_shard, snap
from tests.s3_server import BUCKET
from tests.storage.test_disk_format import flip_middle_byte, manifest_path
from tests.storage.test_object_folder import session, write_snapshot


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpt"
    snap(r / "step-1", "s1", 1)
    snap(r / "step-2", "s2", 2, rollouts=2)
    snap(r / "step-3", "s3", 3, rollouts=3)
    return r


def test_ls_lists_the_snapshots_newest_first_with_id_rollouts_and_path(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "ls", str(root))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"3 committed snapshot(s) under {root}, newest first"
    assert lines[1].split() == ["CREATED", "SNAPSHOT", "ROLLOUTS", "BYTES", "PATH"]
    assert [line.split()[1:3] + line.split()[-1:] for line in lines[2:]] == [
        ["s3", "3", str(root / "step-3")], ["s2", "2", str(root / "step-2")],
        ["s1", "1", str(root / "step-1")]]
    assert lines[2].split()[0] == "2026-01-01T00:03:00+00:00"


def test_ls_verify_marks_a_damaged_snapshot_and_exits_1(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_middle_byte(first_shard(root / "step-3"))
    code, out, err = run(capsys, "ls", "--verify", str(root))
    assert code == 1
    verdicts = {line.split()[-1]: line.split()[5] for line in out.splitlines()[2:]}
    assert verdicts == {str(root / "step-3"): "FAILED", str(root / "step-2"): "ok",
                        str(root / "step-1"): "ok"}
    assert "1 snapshot(s) would be refused by a restore" in err


def test_ls_latest_prints_the_newest_that_verifies_and_why_newer_ones_were_skipped(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_middle_byte(first_shard(root / "step-3"))
    code, out, err = run(capsys, "ls", "--latest", str(root))
    assert (code, out) == (0, f"{root / 'step-2'}\n")
    assert err.startswith(f"nemo-ckpt ls: skipped {root / 'step-3'}: it does not verify")
    code, out, _ = run(capsys, "ls", "--latest", "--no-verify", str(root))
    assert (code, out) == (0, f"{root / 'step-3'}\n")


def test_ls_latest_with_no_good_snapshot_exits_1_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap(tmp_path / "only", "s1", 1)
    manifest_path(tmp_path / "only").write_bytes(b"{")
    code, out, err = run(capsys, "ls", "--latest", str(tmp_path))
    assert (code, out) == (1, "")
    assert f"no snapshot under {tmp_path} verifies" in err
    assert "its manifest does not read" in err


def test_ls_json_carries_the_facts_and_an_unreadable_manifests_error(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest_path(root / "step-1").write_bytes(b"{")
    code, out, _ = run(capsys, "ls", "--json", str(root))
    assert code == 0
    data = json.loads(out)
    assert [d["snapshot_id"] for d in data] == [None, "s3", "s2"]
    assert data[0]["path"] == str(root / "step-1") and "is not valid JSON" in data[0]["error"]
    assert data[1]["rollouts"] == 3 and data[1]["created_at"] == "2026-01-01T00:03:00+00:00"


def test_ls_and_rm_keep_last_of_a_mistyped_root_are_one_line_and_exit_1(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (("ls", str(root) + "-typo"), ("ls", "--latest", str(root) + "-typo"),
                 ("rm", "--keep-last", "1", str(root) + "-typo")):
        code, out, err = run(capsys, *argv)
        assert (code, len(err.splitlines())) == (1, 1)
        assert "is not a folder (it does not exist, or is a file)" in err
    assert len(list_snapshots(root)) == 3


def test_ls_of_an_empty_root_says_there_are_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "ls", str(tmp_path)) == (
        0, f"no committed snapshots under {tmp_path}\n", "")


def test_rm_removes_each_snapshot_named_and_keeps_rls_files(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "step-1" / "rl_state.json").write_text("{}")
    code, out, err = run(capsys, "rm", str(root / "step-1"), str(root / "step-2"))
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"removed snapshot s1 at {root / 'step-1'} (2 files)",
                                f"removed snapshot s2 at {root / 'step-2'} (2 files)"]
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3"]
    assert (root / "step-1" / "rl_state.json").exists()


def test_rm_of_a_snapshot_a_snapshot_holds_is_refused_with_exit_1_and_removes_nothing(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _claim_as_snapshot(root / "step-2")
    code, out, err = run(capsys, "rm", str(root / "step-2"), str(root / "step-1"))
    assert code == 1
    assert out == f"removed snapshot s1 at {root / 'step-1'} (2 files)\n"
    assert err.startswith("nemo-ckpt rm: error: cannot remove the snapshot at ")
    assert "snap-running of cluster/other-job is in progress there" in err
    assert len(list(environment_dir(root / "step-2").glob("shard-*"))) == 1
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3", "s2"]


def test_rm_of_a_path_without_a_snapshot_is_one_line_and_exit_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "rm", str(tmp_path / "nothing"))
    assert (code, out) == (1, "")
    assert len(err.splitlines()) == 1 and "no environment snapshot at" in err


def test_rm_keep_last_keeps_the_newest_n(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "rm", "--keep-last", "1", str(root))
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"kept 1 snapshot(s) under {root}",
                                f"removed snapshot s2 at {root / 'step-2'} (2 files)",
                                f"removed snapshot s1 at {root / 'step-1'} (2 files)"]
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3"]


def test_rm_keep_last_refuses_zero_and_more_than_one_root_before_removing_anything(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["rm", "--keep-last", "0", str(root)])
    assert exit_info.value.code == 2
    code, _, err = run(capsys, "rm", "--keep-last", "1", str(root), str(root / "step-1"))
    assert code == 2 and "--keep-last takes one ROOT, got 2 paths" in err
    assert len(list_snapshots(root)) == 3


def _tree(top: Path) -> dict[str, bytes]:
    return {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*"))
            if p.is_file()}


def test_ls_latest_names_each_skipped_snapshot_once_on_stderr(root: Path) -> None:
    # A subprocess: under pytest, logging's handlers hide a warning that a user's
    # terminal shows beside the CLI's own line.
    flip_middle_byte(first_shard(root / "step-3"))
    done = subprocess.run([sys.executable, "-m", "nemo_ckpt", "ls", "--latest", str(root)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, f"{root / 'step-2'}\n")
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"nemo-ckpt ls: skipped {root / 'step-3'}: it does not verify")


def test_gc_of_a_mistyped_root_exits_1_in_one_line_and_creates_nothing(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    typo = root.parent / "ckpt-typo"
    code, out, err = run(capsys, "gc", str(typo))
    assert (code, out, len(err.splitlines())) == (1, "", 1)
    assert f"there is nothing at {typo}, so it is no checkpoint root (mistyped?)" in err
    assert "nothing was created" in err
    assert not typo.exists()


def test_gc_of_a_snapshot_path_exits_1_naming_the_root_and_changes_nothing(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _tree(root)
    code, out, err = run(capsys, "gc", str(root / "step-2"))
    assert (code, out, len(err.splitlines())) == (1, "", 1)
    assert f"{root / 'step-2'} is a snapshot, not a checkpoint root: pass the root it " \
           f"lies under" in err
    assert _tree(root) == before
    assert run(capsys, "gc", str(root))[0] == 0  # the root itself collects


@pytest.mark.parametrize("command", ["verify", "inspect", "rm"])
def test_a_root_or_a_mistyped_path_given_for_a_snapshot_is_named_as_such_not_as_damage(
        root: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    before = _tree(root)
    code, out, err = run(capsys, command, str(root))
    assert (code, out, len(err.splitlines())) == (1, "", 1)
    assert f"no environment snapshot at {root}: it is a folder above 3 committed " \
           f"snapshot(s): pass one of them (`nemo-ckpt ls {root}` lists them)." in err
    typo = root / "step-4"
    code, out, err2 = run(capsys, command, str(typo))
    assert (code, out, len(err2.splitlines())) == (1, "", 1)
    assert f"no environment snapshot at {typo}: there is nothing there (mistyped?)" in err2
    for line in (err, err2):
        assert "restore an earlier checkpoint" not in line
        assert line.rstrip().endswith("Nothing was removed.") == (command == "rm")
    assert _tree(root) == before and not typo.exists()


def test_ls_marks_a_damaged_manifest_unreadable_in_its_row_and_says_why_below(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest_path(root / "step-1").write_bytes(b"{")
    code, out, err = run(capsys, "ls", str(root))
    assert code == 0
    rows = out.splitlines()[2:]
    assert rows[0].split() == ["?", "UNREADABLE", "-", "-", str(root / "step-1")]
    assert max(len(line) for line in out.splitlines()) < 80 + len(str(root))
    assert err.startswith(f"nemo-ckpt ls: {root / 'step-1'}: its manifest does not read: ")
    assert "is not valid JSON" in err and len(err.splitlines()) == 1


def test_rm_keep_last_meeting_a_dead_removers_claim_says_what_to_wait_and_then_goes_ahead(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = encode_claim("remove-dead0000", "nemo-ckpt-remover-dead0000", 1.0)
    environment_folder(root / "step-1").write_bytes(".claim-remove-dead0000.json", data)
    code, out, err = run(capsys, "rm", "--keep-last", "2", str(root))
    assert code == 1 and f"nemo-ckpt rm: not removed {root / 'step-1'}: " in err
    assert "(nemo-ckpt rm --wait 3)" in err
    code, out, err = run(capsys, "rm", "--keep-last", "2", "--wait", "3", str(root))
    assert (code, err) == (0, "")
    assert f"removed snapshot s1 at {root / 'step-1'} (2 files)" in out.splitlines()
    assert list((root / "step-1").iterdir()) == []  # environment/ and its dead claim gone


def test_ls_and_rm_keep_last_of_a_mistyped_bucket_prefix_exit_1_as_for_a_folder(
        s3_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    root = f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:8]}"
    write_snapshot(f"{root}/step-1", {"holder-0": [session("holder-0", "r0")]})
    assert run(capsys, "ls", root)[0] == 0
    typo = f"{root}-typo"
    for argv in (("ls", typo), ("ls", "--latest", typo), ("rm", "--keep-last", "1", typo)):
        code, out, err = run(capsys, *argv)
        assert (code, out, len(err.splitlines())) == (1, "", 1), (argv, err)
        assert f"there is nothing at {typo}, so it is no checkpoint root (mistyped?)" in err
    assert [s.snapshot_id for s in list_snapshots(root)] == ["snap-1"]


def test_verify_and_rm_keep_last_show_progress_on_stderr_only_when_asked_or_on_a_terminal(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    code, out, err = run(capsys, "verify", str(root / "step-3"))
    assert (code, err) == (0, "")  # stderr is no terminal here: no progress unasked
    code, out2, err = run(capsys, "verify", "--progress", str(root / "step-3"))
    assert (code, out2) == (0, out)
    assert err.splitlines() == ["nemo-ckpt verify: shards verified 0/1",
                                "nemo-ckpt verify: shards verified 1/1"]
    code, out, err = run(capsys, "rm", "--keep-last", "2", "--progress", str(root))
    assert code == 0 and f"removed snapshot s1 at {root / 'step-1'} (2 files)" in out
    assert err.splitlines() == [
        *(f"nemo-ckpt rm: manifests read {k}/3" for k in range(4)),
        *(f"nemo-ckpt rm: snapshots kept or removed {k}/3" for k in range(4))]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["verify", str(root / "step-3")]) == 0
    assert terminal.getvalue() == ("\r\x1b[Knemo-ckpt verify: shards verified 0/1"
                                   "\r\x1b[Knemo-ckpt verify: shards verified 1/1\n")
    terminal.truncate(0)
    assert main(["verify", "--no-progress", str(root / "step-3")]) == 0
    assert terminal.getvalue() == ""


def test_rm_keep_last_dry_run_lists_what_it_would_remove_and_leaves_every_file(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "step-1" / "rl_state.json").write_text("{}")
    before = _tree(root)
    code, out, err = run(capsys, "rm", "--keep-last", "1", "--dry-run", str(root))
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"would keep 1 snapshot(s) under {root}",
                                f"would remove snapshot s2 at {root / 'step-2'}",
                                f"would remove snapshot s1 at {root / 'step-1'}",
                                "nothing was removed (--dry-run): 2 snapshot(s) would be"]
    assert _tree(root) == before
    code, out, err = run(capsys, "rm", "--dry-run", str(root / "step-1"))
    assert (code, out) == (2, "")
    assert "--dry-run goes with --keep-last N ROOT; nothing was removed" in err
    assert _tree(root) == before


def test_rm_keep_last_says_why_it_keeps_each_damaged_snapshot_and_how_to_remove_it(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_middle_byte(first_shard(root / "step-3"))
    code, out, err = run(capsys, "rm", "--keep-last", "1", "--verify", str(root))
    assert code == 0
    assert out.splitlines() == [f"kept 2 snapshot(s) under {root}",
                                f"removed snapshot s1 at {root / 'step-1'} (2 files)"]
    (line,) = err.splitlines()
    assert line.startswith(f"nemo-ckpt rm: kept damaged snapshot {root / 'step-3'}, not "
                           f"counted towards --keep-last: it does not verify (1 problem(s)): ")
    assert line.endswith(f"; it is kept for you to look at (`nemo-ckpt verify "
                         f"{root / 'step-3'}`); to remove it: `nemo-ckpt rm "
                         f"{root / 'step-3'}`")
    assert [s.snapshot_id for s in list_snapshots(root)] == ["s3", "s2"]
