"""Clean-up of a checkpoint folder (``nemo_ckpt.storage.cleanup``): committed is final, and the
files of operations in progress stay (issue 11)."""

from __future__ import annotations

from pathlib import Path

from nemo_ckpt.storage.checkpoint_folder import environment_dir, prepare_environment_dir
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.storage.cleanup import (
    manifest_snapshot_id,
    remove_snapshot_files,
    remove_unreferenced_files,
)
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.path_claims import claim_path
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import read_snapshot
from tests.storage.test_disk_format import session, tree, write_snapshot


def test_a_late_clean_up_never_removes_what_a_newer_manifest_names(tmp_path: Path) -> None:
    # The clean-up reads what the manifest names now, not what its own commit wrote.
    write_snapshot(tmp_path, {"holder-0": [session("holder-0", "a")]}, snapshot_id="first")
    write_snapshot(tmp_path, {"holder-0": [session("holder-0", "b")]}, snapshot_id="second")
    remove_unreferenced_files(environment_dir(tmp_path))  # "first"'s clean-up, late
    assert [r.episode.rollout_id for r in read_snapshot(tmp_path).sessions["holder-0"]] == ["b"]


def test_a_clean_up_spares_the_files_of_operations_in_progress(tmp_path: Path) -> None:
    directory = prepare_environment_dir(tmp_path)
    busy = write_shard(directory, shard_file_name("snap-busy", "holder-0"), "holder-0",
                       [session("holder-0", "x")])
    write_snapshot(tmp_path, {"holder-0": [session("holder-0", "a")]}, snapshot_id="done")
    assert remove_unreferenced_files(directory, protect={"snap-busy"}) == []
    assert (directory / busy.file).is_file()
    assert remove_unreferenced_files(directory) == [busy.file]


def test_an_abort_never_removes_the_committed_snapshot(tmp_path: Path) -> None:
    write_snapshot(tmp_path, {"holder-0": [session("holder-0", "a")]}, snapshot_id="snap-9")
    before = tree(tmp_path)
    assert remove_snapshot_files(environment_dir(tmp_path), "snap-9") is True
    assert tree(tmp_path) == before
    read_snapshot(tmp_path)
    assert manifest_snapshot_id(environment_dir(tmp_path)) == "snap-9"


def test_an_abort_removes_its_own_files_and_nothing_else(tmp_path: Path) -> None:
    write_snapshot(tmp_path, {"holder-0": [session("holder-0", "a")]}, snapshot_id="snap-1")
    directory = environment_dir(tmp_path)
    committed = tree(tmp_path)
    write_shard(directory, shard_file_name("snap-2", "holder-0"), "holder-0",
                [session("holder-0", "b")])
    claim_path(directory, "snap-2", "job@cluster", ClaimWatch(), ttl_s=60.0)
    assert remove_snapshot_files(directory, "snap-2") is False
    assert tree(tmp_path) == committed
