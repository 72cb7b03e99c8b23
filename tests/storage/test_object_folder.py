"""Snapshots in a bucket, against each real object store the tests start on 127.0.0.1:
the S3 servers of ``tests/s3_server.py`` (SeaweedFS and rclone) and Azurite
(``tests/azurite_server.py``, for ``az://``): the same guarantees as in a folder,
through ``nemo_ckpt.storage.object_folder``."""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import obstore
import pytest

from nemo_ckpt.errors import (
    CheckpointPathBusyError,
    ShardCorruptedError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    TornSnapshotError,
    UnsafeShardNameError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.storage.checkpoint_folder import environment_folder, folder_at
from nemo_ckpt.storage.claims import STALE_FACTOR, ClaimWatch
from nemo_ckpt.storage.cleanup import (
    manifest_snapshot_id,
    remove_snapshot_files,
    remove_unreferenced_files,
)
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.storage.manifest import Manifest, encode_manifest
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.path_claims import claim_path, live_claims, release_claim
from nemo_ckpt.storage.shards import write_shard
from nemo_ckpt.storage.snapshot_files import (
    read_manifest,
    read_snapshot,
    snapshot_rollouts,
    write_manifest,
)
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore
from tests.s3_server import BUCKET, SERVERS, LocalS3Server

pytestmark = pytest.mark.timeout(120)


def session(inst: str, rid: str, state: bytes = b"s", turns: int = 2) -> SessionRecord:
    return SessionRecord(
        instance_id=inst, episode=Ep(rid, 0),
        turns=tuple(f"{rid}:turn{t}".encode() for t in range(turns)), state=state,
        staging_keys=frozenset(f"{rid}/row{t}" for t in range(turns)),
        earlier_capture_keys=())


def write_snapshot(url: str, by_instance: dict[str, list[SessionRecord]],
                   snapshot_id: str = "snap-1") -> Manifest:
    """Shards, then the manifest, as a snapshot's holders and coordinator write them."""
    folder = environment_folder(url)
    folder.prepare()
    shards = [write_shard(folder, shard_file_name(snapshot_id, inst), inst, records)
              for inst, records in by_instance.items() if records]
    raw = encode_manifest(snapshot_id=snapshot_id, created_at=datetime.now(timezone.utc),
                          instances=sorted(by_instance), shards=shards,
                          restarted_rollouts=0, metrics={})
    write_manifest(folder, raw)
    return Manifest.model_validate_json(raw)


@pytest.fixture
def url(object_store_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for k, v in object_store_server.env().items():
        monkeypatch.setenv(k, v)
    return object_store_server.url(f"tests/{uuid.uuid4().hex[:8]}/ckpt")


def objects(url: str) -> list[str]:
    folder: Any = environment_folder(url)
    return sorted(folder.names())


def test_a_snapshot_round_trips_through_a_bucket_with_shards_big_enough_for_multipart(
        url: str) -> None:
    big = [session("holder-0", f"r{i}", state=os.urandom(1 << 20)) for i in range(40)]
    small = [session("holder-1", "s0"), session("holder-1", "s1", turns=0)]
    written = write_snapshot(url, {"holder-0": big, "holder-1": small, "holder-2": []})
    loaded = read_snapshot(url)
    assert loaded.manifest == written
    assert loaded.sessions == {"holder-0": big, "holder-1": small, "holder-2": []}
    assert objects(url) == sorted([shard_file_name("snap-1", "holder-0"),
                                   shard_file_name("snap-1", "holder-1"), "manifest.json"])
    rollouts, unreadable = snapshot_rollouts(url, written)
    assert unreadable == {} and sorted(r.rollout_id for r in rollouts) == \
        sorted([*(f"r{i}" for i in range(40)), "s0", "s1"])
    assert manifest_snapshot_id(environment_folder(url)) == "snap-1"


def test_a_prefix_without_a_manifest_holds_no_snapshot(url: str) -> None:
    with pytest.raises(SnapshotNotFoundError, match=f"no environment snapshot at {url}"):
        read_manifest(url)
    folder = environment_folder(url)
    write_shard(folder, shard_file_name("snap-1", "holder-0"), "holder-0",
                [session("holder-0", "a")])
    with pytest.raises(SnapshotNotFoundError, match="interrupted before it committed"):
        read_manifest(url)


def test_snapshots_under_sibling_prefixes_of_one_bucket_see_only_their_own_objects(
        url: str) -> None:
    # One client serves the whole bucket: each folder's keys and listings must still
    # stop at its own prefix, not at a sibling that merely starts with the same text.
    write_snapshot(url, {"holder-0": [session("holder-0", "a")]})
    write_snapshot(url + "2", {"holder-0": [session("holder-0", "b")]}, "snap-2")
    assert objects(url) == ["manifest.json", shard_file_name("snap-1", "holder-0")]
    assert objects(url + "2") == ["manifest.json", shard_file_name("snap-2", "holder-0")]
    sibling = environment_folder(url + "2")
    sibling.remove(sibling.names())
    assert objects(url + "2") == []
    assert objects(url) == ["manifest.json", shard_file_name("snap-1", "holder-0")]
    assert [r.episode.rollout_id for r in read_snapshot(url).sessions["holder-0"]] == ["a"]


def test_a_missing_shard_object_is_a_torn_snapshot(url: str) -> None:
    write_snapshot(url, {"holder-0": [session("holder-0", "a")],
                         "holder-1": [session("holder-1", "b")]})
    shard = shard_file_name("snap-1", "holder-1")
    environment_folder(url).remove([shard])
    with pytest.raises(TornSnapshotError, match=f"shard {url}/environment/{shard}, named in "
                                                f"the manifest, is missing"):
        read_snapshot(url)


def test_a_truncated_or_changed_shard_object_is_refused(url: str) -> None:
    write_snapshot(url, {"holder-0": [session("holder-0", "a", state=b"x" * 1000)]})
    folder: Any = environment_folder(url)
    shard = shard_file_name("snap-1", "holder-0")
    data = folder.read(shard)
    obstore.put(folder.store, folder.key(shard), data[:-10])
    with pytest.raises(ShardCorruptedError, match="it was truncated or overwritten"):
        read_snapshot(url)
    obstore.put(folder.store, folder.key(shard), data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ShardCorruptedError, match="its content changed after the snapshot"):
        read_snapshot(url)


@pytest.mark.parametrize("name", ["../outside.msgpack", "sub/shard.msgpack",
                                  "/abs.msgpack"])
def test_a_manifest_naming_a_key_outside_its_prefix_is_refused(url: str, name: str) -> None:
    write_snapshot(url, {"holder-0": [session("holder-0", "a")]})
    folder: Any = environment_folder(url)
    manifest = json.loads(folder.read("manifest.json"))
    manifest["shards"][0]["file"] = name
    obstore.put(folder.store, folder.key("manifest.json"), json.dumps(manifest).encode())
    with pytest.raises(UnsafeShardNameError, match="refusing to read outside the snapshot"):
        read_manifest(url)


def test_a_shard_whose_writer_fails_midway_leaves_no_object(url: str) -> None:
    folder = environment_folder(url)

    def sessions() -> Iterator[SessionRecord]:
        for i in range(30):  # past one multipart part before it fails
            yield session("holder-0", f"r{i}", state=os.urandom(1 << 20))
        raise RuntimeError("the environment's encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        write_shard(folder, shard_file_name("snap-1", "holder-0"), "holder-0", sessions())
    assert objects(url) == []


def test_a_newer_manifest_replaces_the_older_and_clean_up_spares_claimed_operations(
        url: str) -> None:
    write_snapshot(url, {"holder-0": [session("holder-0", "a")]}, "snap-1")
    folder = environment_folder(url)
    claim_path(folder, "snap-3", "job-b", ClaimWatch(), ttl_s=60.0)
    write_shard(folder, shard_file_name("snap-3", "holder-0"), "holder-0",
                [session("holder-0", "c")])
    write_snapshot(url, {"holder-0": [session("holder-0", "b")]}, "snap-2")
    assert read_manifest(url).snapshot_id == "snap-2"
    protect = live_claims(folder, "job-a", ClaimWatch(), ours=())
    assert protect == {"snap-3"}
    removed = remove_unreferenced_files(folder, protect)
    assert removed == [shard_file_name("snap-1", "holder-0")]
    assert read_snapshot(url).sessions["holder-0"] == [session("holder-0", "b")]
    # The aborted operation's files go with it; a committed one is final.
    assert remove_snapshot_files(folder, "snap-3") is False
    assert remove_snapshot_files(folder, "snap-2") is True
    release_claim(folder, "snap-2")
    assert objects(url) == sorted([shard_file_name("snap-2", "holder-0"), "manifest.json"])


def test_on_a_bucket_the_collection_claim_is_judged_on_the_readers_clock(url: str) -> None:
    # A collector refuses a claim it sees live, and takes one over once watched
    # unchanged for its ttl (docs/DESIGN.md).
    store = BlobStore(join_location(url, BLOB_DIR), folder_at)
    now = [0.0]
    watch = ClaimWatch(lambda: now[0])
    store.claims.hold("snap-1", "job-a", ttl_s=10)
    with pytest.raises(CheckpointPathBusyError, match=r"in use by snapshot\(s\) \['snap-1'\]"):
        store.claims.begin_collection("gc-1", ttl_s=10, watch=watch)
    now[0] += 10 * STALE_FACTOR + 1  # snap-1's job died: its hold never changed
    store.claims.begin_collection("gc-1", ttl_s=10, watch=watch)
    other = BlobStore(join_location(url, BLOB_DIR), folder_at)
    with pytest.raises(CheckpointPathBusyError, match="already being collected by gc-1"):
        other.claims.begin_collection("gc-2", ttl_s=10, watch=ClaimWatch())
    store.claims.end_collection()
    store.claims.release("snap-1")
    assert folder_at(join_location(url, BLOB_DIR)).names() == []


@pytest.fixture(params=sorted(SERVERS))
def own_server(request: pytest.FixtureRequest, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalS3Server]:
    """A server of each S3 kind, this test's to kill; the environment points at it
    meanwhile. (Azurite keeps its index in memory between saves: killed, it forgets
    objects, as no real store does, so it is not one of them.)"""
    server = SERVERS[request.param](tmp_path / "s3")
    server.start()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    try:
        yield server
    finally:
        server.stop()


def test_a_server_killed_mid_persist_fails_the_write_and_the_previous_snapshot_stands(
        own_server: LocalS3Server) -> None:
    url = own_server.url("killed/ckpt")
    first = write_snapshot(url, {"holder-0": [session("holder-0", "a")]}, "snap-1")
    folder = environment_folder(url)

    def sessions() -> Iterator[SessionRecord]:
        for i in range(40):
            if i == 20:
                own_server.kill()
            yield session("holder-0", f"r{i}", state=os.urandom(1 << 20))

    with pytest.raises(SnapshotWriteError, match=f"could not write {url}/environment/"
                                                 f"{shard_file_name('snap-2', 'holder-0')}"):
        write_shard(folder, shard_file_name("snap-2", "holder-0"), "holder-0", sessions())
    own_server.start()
    loaded = read_snapshot(url)
    assert loaded.manifest == first
    assert loaded.sessions["holder-0"] == [session("holder-0", "a")]
    assert shard_file_name("snap-2", "holder-0") not in objects(url)


def test_the_cli_inspects_verifies_and_diffs_snapshots_in_a_bucket(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from nemo_ckpt.cli.main import main

    a, b = f"{url}/step-1", f"{url}/step-2"
    write_snapshot(a, {"holder-0": [session("holder-0", "a")],
                       "holder-1": [session("holder-1", "b")]}, "snap-1")
    write_snapshot(b, {"holder-0": [session("holder-0", "a", turns=4)],
                       "holder-1": [session("holder-1", "c")]}, "snap-2")

    assert main(["inspect", a]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"snapshot snap-1 at {a}"
    assert "holder-1" in out and " b " in out

    assert main(["verify", b]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "OK: snapshot snap-2 is intact: 2 shards, ")

    assert main(["diff", a, b]) == 0
    assert "1 added, 1 finished, 1 continued (+2 turns)" in capsys.readouterr().out

    # A damaged shard object fails verify, naming it by its URL.
    folder: Any = environment_folder(b)
    name = shard_file_name("snap-2", "holder-1")
    obstore.put(folder.store, folder.key(name), folder.read(name)[:-3])
    assert main(["verify", b]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == ("FAILED: snapshot snap-2 has 1 problem(s); a restore "
                                   "from it would be refused:")
    assert f"{b}/environment/{name}" in err


def test_the_data_plane_saves_into_a_bucket_and_restores_from_it(url: str) -> None:
    import asyncio

    from nemo_ckpt.interfaces import RestoredEnvironmentRollouts
    from nemo_ckpt.testing import DATA_PLANE_FILE, DataPlaneBarrier, ReferenceDataPlane

    async def run() -> None:
        dp = ReferenceDataPlane()
        barrier = DataPlaneBarrier(dp)
        ep = await dp.dispatch("r", "holder-0")
        await dp.write_staging("r/t0000", {"turn": 0})
        async with barrier.checkpoint() as cut:
            written = await barrier.save(cut, url)
        assert written == f"{url}/{DATA_PLANE_FILE}"
        fresh = ReferenceDataPlane()
        report = await DataPlaneBarrier(fresh).restore(url, RestoredEnvironmentRollouts(
            frozenset({("holder-0", "r", ep.attempt)}), frozenset({"r/t0000"})))
        assert report.continued == (("holder-0", ep.next_attempt()),)

    asyncio.run(run())
    assert not Path(url).exists() and not Path("s3:").exists()


@pytest.mark.timeout(90)
def test_the_server_command_runs_a_command_against_its_bucket_and_stops_after_it(
        tmp_path: Path) -> None:
    import subprocess
    import sys

    script = ("import os, sys\n"
              "from nemo_ckpt.storage.checkpoint_folder import folder_at\n"
              f"folder_at('s3://{BUCKET}/cmd').write_bytes('f', b'hello')\n"
              f"print(os.environ['AWS_ENDPOINT_URL'], folder_at('s3://{BUCKET}/cmd').read('f'))\n"
              "sys.exit(3)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    done = subprocess.run(
        [sys.executable, "-m", "tests.s3_server", "--data-dir", str(tmp_path),
         "--", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=80, env=env,
        cwd=Path(__file__).resolve().parents[2])  # where tests.s3_server imports from
    assert done.returncode == 3, done.stderr
    endpoint, read = done.stdout.split()
    assert read == "b'hello'"
    assert f"S3-compatible server at {endpoint}, bucket s3://{BUCKET}" in done.stderr
    port = int(endpoint.rsplit(":", 1)[1])
    import socket
    with socket.socket() as s, pytest.raises(OSError):
        s.connect(("127.0.0.1", port))  # the server is gone


def test_the_server_command_without_a_command_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.s3_server import main

    with pytest.raises(SystemExit) as exit_:
        main(["--"])
    assert exit_.value.code == 2
    assert "give the command to run after --" in capsys.readouterr().err


@pytest.mark.parametrize("mistake", ["missing bucket", "wrong secret"])
def test_a_mistake_on_the_bucket_is_one_line_in_the_cli_naming_what_to_change(
        url: str, mistake: str, object_store_server: LocalS3Server,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from nemo_ckpt.cli.main import main

    write_snapshot(url, {"holder-0": [session("holder-0", "a")]})
    scheme = object_store_server.scheme
    if mistake == "missing bucket":
        url = url.replace(f"{scheme}://{BUCKET}/", f"{scheme}://no-such-bucket/")
        says = f"{scheme}://no-such-bucket does not exist at {object_store_server.endpoint}"
    else:
        key = ("AZURE_STORAGE_ACCOUNT_KEY" if scheme == "az" else "AWS_SECRET_ACCESS_KEY")
        monkeypatch.setenv(key, base64.b64encode(b"not-the-secret").decode())
        says = f"access denied to {scheme}://"
    for command in (["inspect", url], ["verify", url]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    if mistake == "wrong secret":  # (SeaweedFS makes a missing bucket on a write)
        with pytest.raises(SnapshotWriteError) as caught:
            write_snapshot(url + "/again", {"holder-0": [session("holder-0", "b")]})
        assert "\n" not in str(caught.value) and says in str(caught.value)


def test_a_large_shard_read_in_chunks_equals_one_plain_read_on_each_server(
        url: str) -> None:
    big = [session("holder-0", f"r{i}", state=os.urandom(3 << 20)) for i in range(7)]
    written = write_snapshot(url, {"holder-0": big})
    entry = written.shards[0]
    folder: Any = environment_folder(url)
    assert entry.chunks is not None and entry.bytes > 2 * (8 << 20)
    pieces = list(folder.read_chunks(entry.file, entry.bytes, entry.chunks.bytes))
    assert b"".join(pieces) == folder.read(entry.file)
    assert {len(p) for p in pieces[:-1]} == {entry.chunks.bytes}
    assert read_snapshot(url).sessions == {"holder-0": big}
