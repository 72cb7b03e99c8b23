"""Path claims and manifests that the store enforces, where it can: on a local folder, on
an S3 server that honours conditional writes (SeaweedFS) and on Azure Blob (Azurite), a
second writer is refused;
on one that does not (rclone's ``serve s3``), the claims are advisory and
``check_startup``'s warning says so (docs/DESIGN.md, "Object storage")."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.errors import CheckpointPathBusyError, OperationAbortedError
from nemo_ckpt.storage.checkpoint_folder import environment_folder, folder_at
from nemo_ckpt.storage.claims import STALE_FACTOR, ClaimWatch
from nemo_ckpt.storage.commit_sequence import take_sequence
from nemo_ckpt.storage.folder import ABSENT
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.storage.manifest import encode_manifest
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.path_claims import advisory_claims_warning, claim_path
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import read_manifest, write_manifest
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore
from tests.azurite_server import AzuriteServer
from tests.s3_server import LocalS3Server, RcloneServer
from tests.storage.test_object_folder import session

pytestmark = pytest.mark.timeout(120)

# Whether each store refuses a conditional write that no longer holds.
ENFORCES = {"local": True, "seaweedfs": True, "rclone": False, "azurite": True}


@pytest.fixture(scope="module")
def rclone_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3Server]:
    server = RcloneServer(tmp_path_factory.mktemp("rclone"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3Server]:
    server = AzuriteServer(tmp_path_factory.mktemp("azurite"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["local", "seaweedfs", "rclone", "azurite"])
def store(request: pytest.FixtureRequest, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(kind, a fresh checkpoint path) on a local folder and on each S3 server."""
    if request.param == "local":
        return "local", str(tmp_path / "ckpt")
    server: LocalS3Server = request.getfixturevalue(
        "s3_server" if request.param == "seaweedfs" else f"{request.param}_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return server.name, server.url(f"cond/{uuid.uuid4().hex[:8]}/ckpt")


@pytest.fixture(params=["local", "seaweedfs", "azurite"])
def enforcing_store(request: pytest.FixtureRequest, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh checkpoint path on each store that enforces conditional writes."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    server: LocalS3Server = request.getfixturevalue(
        "s3_server" if request.param == "seaweedfs" else "azurite_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return server.url(f"cond/{uuid.uuid4().hex[:8]}/ckpt")


def manifest_bytes(snapshot_id: str, folder: Any) -> bytes:
    shard = write_shard(folder, shard_file_name(snapshot_id, "holder-0"), "holder-0",
                        [session("holder-0", snapshot_id)])
    return encode_manifest(snapshot_id=snapshot_id, created_at=datetime.now(timezone.utc),
                           instances=["holder-0"], shards=[shard], restarted_rollouts=0,
                           metrics={})


def test_the_store_reports_whether_it_enforces_conditional_writes(
        store: tuple[str, str]) -> None:
    kind, path = store
    folder = environment_folder(path)
    folder.prepare()
    assert folder.enforces_conditions() is ENFORCES[kind]
    warning = advisory_claims_warning(folder)
    if ENFORCES[kind]:
        assert warning is None
    else:
        assert warning is not None and "path claims are advisory" in warning
    assert folder.names() == []  # the probe left nothing


def _two_writers(folder: Any, expect: str, before: Any = lambda: None) -> list[str]:
    """Two threads write ``.claim-x.json`` (b"a" and b"b") on condition ``expect`` at
    once; what each saw: "written" or "refused"."""
    outcomes: list[str] = []

    def write(data: bytes) -> None:
        before()
        try:
            folder.write_bytes(".claim-x.json", data, sync=False, expect=expect)
            outcomes.append("written")
        except FileExistsError:
            outcomes.append("refused")

    threads = [threading.Thread(target=write, args=(d,)) for d in (b"a", b"b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcomes


def test_of_two_writers_creating_one_name_at_once_exactly_one_wins(
        enforcing_store: str) -> None:
    folder = environment_folder(enforcing_store)
    folder.prepare()
    start = threading.Barrier(2)
    outcomes = _two_writers(folder, ABSENT, before=start.wait)
    assert sorted(outcomes) == ["refused", "written"]
    assert folder.read(".claim-x.json") in (b"a", b"b")


def test_a_job_back_after_its_claim_was_taken_over_cannot_commit_over_the_new_snapshot(
        store: tuple[str, str]) -> None:
    _, path = store
    folder = environment_folder(path)
    folder.prepare()
    now = [0.0]
    watch_b = ClaimWatch(lambda: now[0])
    claim_path(folder, "snap-a", "job-a", ClaimWatch(), ttl_s=10, beat="a1")
    with pytest.raises(CheckpointPathBusyError):
        claim_path(folder, "snap-b", "job-b", watch_b, ttl_s=10, beat="b1")
    # job-a stalls past its ttl: job-b takes the path over and commits there.
    now[0] += 10 * STALE_FACTOR + 1
    claim_path(folder, "snap-b", "job-b", watch_b, ttl_s=10, beat="b1")
    committed = manifest_bytes("snap-b", folder)
    write_manifest(folder, committed, fence=("snap-b", {"b1"}))
    # job-a wakes up, its claim still there, and tries to commit: refused.
    late = manifest_bytes("snap-a", folder)
    with pytest.raises(CheckpointPathBusyError, match="was replaced by another writer "
                                                      "since this snapshot began"):
        write_manifest(folder, late, fence=("snap-a", {"a1"}))
    assert read_manifest(path).snapshot_id == "snap-b"
    # A retry of a commit whose write landed is not a second writer.
    write_manifest(folder, committed, fence=("snap-b", {"b1"}))


def test_a_claim_renews_for_its_writer_and_refuses_the_writer_it_was_taken_from(
        store: tuple[str, str]) -> None:
    _, path = store
    folder = environment_folder(path)
    folder.prepare()
    watch = ClaimWatch()
    claim_path(folder, "snap-a", "job-a", watch, ttl_s=10, beat="a1")
    claim_path(folder, "snap-a", "job-a", watch, ttl_s=10, beat="a2", renewing={"a1"})
    # A successor of job-a's coordinator rewrote the claim: the old one is fenced.
    claim_path(folder, "snap-a", "job-a", watch, ttl_s=10, beat="s1", renewing={"a2"})
    with pytest.raises(OperationAbortedError, match="its claim is not renewed"):
        claim_path(folder, "snap-a", "job-a", watch, ttl_s=10, beat="a3",
                   renewing={"a1", "a2"})


def test_of_two_collectors_beginning_at_once_on_one_blob_store_exactly_one_begins(
        enforcing_store: str) -> None:
    stores = [BlobStore(join_location(enforcing_store, BLOB_DIR), folder_at) for _ in "ab"]
    start = threading.Barrier(2)
    outcomes: list[str] = []

    def begin(store: BlobStore, owner: str) -> None:
        start.wait()
        try:
            store.claims.begin_collection(owner, ttl_s=30, watch=ClaimWatch())
            outcomes.append("collecting")
        except CheckpointPathBusyError:
            outcomes.append("refused")

    threads = [threading.Thread(target=begin, args=(s, f"gc-{i}"))
               for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == ["collecting", "refused"]


def test_commits_racing_for_a_number_under_one_root_never_share_one(
        enforcing_store: str) -> None:
    root = enforcing_store
    start = threading.Barrier(4)
    taken: list[int] = []

    def take() -> None:
        start.wait()
        for _ in range(5):
            taken.append(take_sequence(root))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(taken) == list(range(1, 21))


def test_of_two_writers_replacing_one_version_at_once_on_a_local_folder_exactly_one_wins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = environment_folder(tmp_path / "ckpt")
    folder.prepare()
    folder.write_bytes(".claim-x.json", b"first", sync=False, expect=ABSENT)
    seen = folder.version(".claim-x.json")
    assert seen is not None
    # Each writer, once it has read the version, waits for the other to read it too: a
    # check and a rename that are not one step would then both pass.
    both_read = threading.Barrier(2, timeout=1.0)
    version = type(folder).version

    def read_then_wait(self: Any, name: str) -> str | None:
        found = version(self, name)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_read.wait()
        return found

    monkeypatch.setattr(type(folder), "version", read_then_wait)
    outcomes = _two_writers(folder, seen)
    assert sorted(outcomes) == ["refused", "written"]
    assert folder.read(".claim-x.json") in (b"a", b"b")
