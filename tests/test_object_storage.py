"""Snapshots in an S3 bucket, against a real S3-compatible server (SeaweedFS, started by
the tests on 127.0.0.1; ``tests/object_store_server.py``): the same guarantees as in a
folder, through ``nemo_ckpt.object_folder``."""

from __future__ import annotations

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
    ShardCorruptedError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    TornSnapshotError,
    UnsafeShardNameError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.manifest import Manifest, encode_manifest, shard_file_name
from nemo_ckpt.sessions import SessionRecord
from nemo_ckpt.storage import (
    claim_path,
    environment_folder,
    live_claims,
    manifest_snapshot_id,
    read_manifest,
    read_snapshot,
    release_claim,
    remove_snapshot_files,
    remove_unreferenced_files,
    snapshot_rollouts,
    write_manifest,
    write_shard,
)
from tests.object_store_server import BUCKET, S3Server

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
def url(s3_server: S3Server) -> str:
    return f"s3://{BUCKET}/tests/{uuid.uuid4().hex[:8]}/ckpt"


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
    obstore.put(folder.store, shard, data[:-10])
    with pytest.raises(ShardCorruptedError, match="it was truncated or overwritten"):
        read_snapshot(url)
    obstore.put(folder.store, shard, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ShardCorruptedError, match="its content changed after the snapshot"):
        read_snapshot(url)


@pytest.mark.parametrize("name", ["../outside.msgpack", "sub/shard.msgpack",
                                  "/abs.msgpack"])
def test_a_manifest_naming_a_key_outside_its_prefix_is_refused(url: str, name: str) -> None:
    write_snapshot(url, {"holder-0": [session("holder-0", "a")]})
    folder: Any = environment_folder(url)
    manifest = json.loads(folder.read("manifest.json"))
    manifest["shards"][0]["file"] = name
    obstore.put(folder.store, "manifest.json", json.dumps(manifest).encode())
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
    claim_path(folder, "snap-3", "job-b", now=100.0, ttl_s=60.0)
    write_shard(folder, shard_file_name("snap-3", "holder-0"), "holder-0",
                [session("holder-0", "c")])
    write_snapshot(url, {"holder-0": [session("holder-0", "b")]}, "snap-2")
    assert read_manifest(url).snapshot_id == "snap-2"
    protect = live_claims(folder, "job-a", now=120.0, ours=())
    assert protect == {"snap-3"}
    removed = remove_unreferenced_files(folder, protect)
    assert removed == [shard_file_name("snap-1", "holder-0")]
    assert read_snapshot(url).sessions["holder-0"] == [session("holder-0", "b")]
    # The aborted operation's files go with it; a committed one is final.
    assert remove_snapshot_files(folder, "snap-3") is False
    assert remove_snapshot_files(folder, "snap-2") is True
    release_claim(folder, "snap-2")
    assert objects(url) == sorted([shard_file_name("snap-2", "holder-0"), "manifest.json"])


@pytest.fixture
def own_server(tmp_path: Path, s3_server: S3Server) -> Iterator[S3Server]:
    """A second server, this test's to kill; the environment points at it meanwhile."""
    server = S3Server(tmp_path / "s3")
    server.start()
    saved = {k: os.environ[k] for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        os.environ.update(saved)


def test_a_server_killed_mid_persist_fails_the_write_and_the_previous_snapshot_stands(
        own_server: S3Server) -> None:
    url = f"s3://{BUCKET}/killed/ckpt"
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
