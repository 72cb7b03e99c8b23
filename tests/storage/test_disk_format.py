"""The on-disk format: durable writes, a manifest written last, and verified reads."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash

from nemo_ckpt.errors import (
    CheckpointPathBusyError,
    CheckpointPathError,
    ManifestInvalidError,
    ShardCorruptedError,
    SnapshotNotFoundError,
    SnapshotReadError,
    SnapshotWriteError,
    TornSnapshotError,
    UnsafeShardNameError,
    UnsupportedFormatVersionError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.storage.checkpoint_folder import environment_dir, folder_at, prepare_environment_dir
from nemo_ckpt.storage.claims import LEGACY_TTL_S, STALE_FACTOR, ClaimWatch
from nemo_ckpt.storage.cleanup import (
    manifest_shard_files,
    manifest_snapshot_id,
    remove_unreferenced_files,
)
from nemo_ckpt.storage.manifest import (
    ENVIRONMENT_DIR,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    RolloutEntry,
    ShardEntry,
    encode_manifest,
    is_plain_file_name,
)
from nemo_ckpt.storage.names import shard_file_name
from nemo_ckpt.storage.path_claims import claim_path, live_claims
from nemo_ckpt.storage.shards import read_shard, read_shard_index, shard_problems, write_shard
from nemo_ckpt.storage.snapshot_files import (
    read_manifest,
    read_snapshot,
    snapshot_rollouts,
    write_manifest,
)
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore, digest_of
from nemo_ckpt.trees.collection import collect_blobs


def session(inst: str, rid: str, attempt: int = 0, state: bytes = b"s", turns: int = 2
            ) -> SessionRecord:
    return SessionRecord(
        instance_id=inst,
        episode=Ep(rid, attempt),
        turns=tuple(f"{rid}:turn{t}".encode() for t in range(turns)),
        state=state,
        staging_keys=frozenset(f"{rid}/row{t}" for t in range(turns)),
        earlier_capture_keys=tuple(Ep(rid, a).capture_key for a in range(attempt)),
    )


def write_snapshot(root: Path, by_instance: dict[str, list[SessionRecord]],
                   snapshot_id: str = "snap-1", restarted: int = 0) -> Manifest:
    """Write shards, then a format-2 manifest (one that lists every rollout), as
    snapshots written before format 3 were; format 3 is ``write_snapshot_v3``."""
    directory = prepare_environment_dir(root)
    shards, rollouts = [], []
    for inst, records in by_instance.items():
        if not records:
            continue
        entry = write_shard(directory, shard_file_name(snapshot_id, inst), inst, records)
        entry = entry.model_copy(update={"chunks": None})  # chunks came with format 6
        shards.append(entry)
        rollouts += [
            RolloutEntry(instance_id=inst, rollout_id=r.episode.rollout_id,
                         attempt=r.episode.attempt, turns=len(r.turns),
                         staging_keys=sorted(r.staging_keys), shard=entry.file)
            for r in records
        ]
    manifest = Manifest(
        format_version=2, snapshot_id=snapshot_id, created_at=datetime.now(timezone.utc),
        instances=sorted(by_instance), shards=shards, rollouts=rollouts,
        restarted_rollouts=restarted, metrics={"paused_seconds": 0.01},
    )
    write_manifest(directory, manifest)
    return manifest


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture
def snapshot_root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    write_snapshot(root, {"holder-0": [session("holder-0", "a"), session("holder-0", "b", 2)],
                          "holder-1": [session("holder-1", "c", 1)],
                          "holder-2": []}, restarted=3)
    return root


def shard_path(root: Path, instance: str = "holder-0") -> Path:
    return environment_dir(root) / shard_file_name("snap-1", instance)


def manifest_path(root: Path) -> Path:
    return environment_dir(root) / "manifest.json"


def edit_manifest(root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(manifest_path(root).read_text())
    edit(data)
    manifest_path(root).write_text(json.dumps(data))


# --- round trips ---------------------------------------------------------------------


def test_round_trip_keeps_every_session_by_instance(snapshot_root: Path) -> None:
    loaded = read_snapshot(snapshot_root)
    assert loaded.sessions == {
        "holder-0": [session("holder-0", "a"), session("holder-0", "b", 2)],
        "holder-1": [session("holder-1", "c", 1)],
        "holder-2": [],
    }
    m = loaded.manifest
    assert m.restarted_rollouts == 3 and m.format_version == 2
    assert {(r.rollout_id, r.attempt, r.turns) for r in m.rollouts} == {
        ("a", 0, 2), ("b", 2, 2), ("c", 1, 2)}
    assert next(r for r in m.rollouts if r.rollout_id == "c").staging_keys == ["c/row0", "c/row1"]


def test_round_trip_of_empty_and_large_state(tmp_path: Path) -> None:
    big = os.urandom(9 << 20)  # >= 8 MiB, incompressible
    records = [session("holder-0", "empty", state=b"", turns=0),
               session("holder-0", "big", state=big)]
    write_snapshot(tmp_path, {"holder-0": records})
    loaded = read_snapshot(tmp_path)
    assert loaded.sessions["holder-0"] == records
    assert loaded.sessions["holder-0"][1].state == big


def test_shard_entry_records_the_files_true_length_and_hash(snapshot_root: Path) -> None:
    manifest = read_manifest(snapshot_root)
    for entry in manifest.shards:
        data = (environment_dir(snapshot_root) / entry.file).read_bytes()
        assert entry.bytes == len(data)
        assert entry.content_hash == f"xxh3-128:{xxhash.xxh3_128(data).hexdigest()}"


def flip_middle_byte(p: Path) -> Path:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    return p


def as_format_1(root: Path) -> None:
    """Rewrite a snapshot's manifest as format 1 wrote it: a bare SHA-256 per shard."""
    def downgrade(d: dict) -> None:  # type: ignore[type-arg]
        d["format_version"] = 1
        for s in d["shards"]:
            del s["content_hash"]
            s["sha256"] = hashlib.sha256(
                (environment_dir(root) / s["file"]).read_bytes()).hexdigest()

    edit_manifest(root, downgrade)


def test_a_format_1_snapshot_with_sha256_hashes_is_still_read_and_verified(
    snapshot_root: Path,
) -> None:
    as_format_1(snapshot_root)
    loaded = read_snapshot(snapshot_root)
    assert loaded.manifest.format_version == 1
    assert loaded.sessions["holder-1"] == [session("holder-1", "c", 1)]
    assert all(s.content_hash.startswith("sha256:") for s in loaded.manifest.shards)
    p = flip_middle_byte(shard_path(snapshot_root))
    assert_refused(snapshot_root, ShardCorruptedError, str(p), "sha256")


def test_a_format_1_manifest_that_does_not_validate_is_refused(snapshot_root: Path) -> None:
    as_format_1(snapshot_root)
    edit_manifest(snapshot_root, lambda d: d["shards"][0].update(sha256="zz"))
    assert_refused(snapshot_root, ManifestInvalidError, "does not validate")


def test_files_on_disk_are_json_and_msgpack_without_pickle(snapshot_root: Path) -> None:
    files = tree(snapshot_root)
    assert sorted(files) == sorted(
        ["environment/manifest.json",
         f"environment/{shard_file_name('snap-1', 'holder-0')}",
         f"environment/{shard_file_name('snap-1', 'holder-1')}"])
    json.loads(files["environment/manifest.json"])
    for name, data in files.items():
        assert b"\x80\x04\x95" not in data[:3] and b"\x80\x05" not in data[:2], name
        if name.endswith(".msgpack"):
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(data)
            objects = list(unpacker)
            assert objects[0]["format"] == "nemo-ckpt-shard"


def test_no_temp_files_are_left_after_writing(snapshot_root: Path) -> None:
    assert not [n for n in tree(snapshot_root) if ".tmp-" in n]


def test_a_failed_shard_write_leaves_no_file_and_names_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = prepare_environment_dir(tmp_path)

    def full(fd: int, buffers: list[memoryview]) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(SnapshotWriteError, match="filesystem is full") as err:
        write_shard(directory, "shard-x.msgpack", "holder-0", [session("holder-0", "a")])
    monkeypatch.undo()
    assert str(directory / "shard-x.msgpack") in str(err.value)
    assert list(directory.iterdir()) == []


def test_writing_into_a_read_only_folder_raises_snapshot_write_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits; use a path under a file instead, which fails alike.
        blocker = tmp_path / "file"
        blocker.write_bytes(b"")
        with pytest.raises(SnapshotWriteError, match="could not write"):
            prepare_environment_dir(blocker / "ckpt")
        return
    directory = prepare_environment_dir(tmp_path)
    directory.chmod(0o500)
    try:
        with pytest.raises(SnapshotWriteError, match="permission denied"):
            write_shard(directory, "shard-x.msgpack", "holder-0", [session("holder-0", "a")])
    finally:
        directory.chmod(0o700)


def test_a_session_of_another_instance_is_refused_in_a_shard(tmp_path: Path) -> None:
    directory = prepare_environment_dir(tmp_path)
    with pytest.raises(ValueError, match="belongs to holder-1"):
        write_shard(directory, "shard-x.msgpack", "holder-0", [session("holder-1", "a")])
    assert list(directory.iterdir()) == []


def test_commit_removes_an_older_snapshots_shards_but_keeps_its_own(tmp_path: Path) -> None:
    write_snapshot(tmp_path, {"holder-0": [session("holder-0", "a")]}, snapshot_id="old")
    manifest = write_snapshot(tmp_path, {"holder-0": [session("holder-0", "b")]},
                              snapshot_id="new")
    removed = remove_unreferenced_files(environment_dir(tmp_path))
    assert removed == [shard_file_name("old", "holder-0")]
    assert [s.file for s in manifest.shards] == [shard_file_name("new", "holder-0")]
    assert [r.episode.rollout_id for r in read_snapshot(tmp_path).sessions["holder-0"]] == ["b"]


def test_shard_names_are_plain_file_names() -> None:
    assert shard_file_name("a/b", "../holder") == "shard-a_b-.._holder-0000.msgpack"
    assert is_plain_file_name(shard_file_name("a/b", "../holder"))
    for bad in ("../x", "/etc/passwd", "a/b", "a\\b", "..", ".", "", "x\x00y", "C:\\x"):
        assert not is_plain_file_name(bad), bad


# --- refusals ------------------------------------------------------------------------


def assert_refused(root: Path, error: type[SnapshotReadError], *needles: str) -> None:
    before = tree(root) if root.is_dir() else None
    with pytest.raises(error) as info:
        read_snapshot(root)
    message = str(info.value)
    for needle in needles:
        assert needle in message
    if before is not None:
        assert tree(root) == before, "a refused read changed files on disk"


def test_no_snapshot_at_a_missing_path(tmp_path: Path) -> None:
    assert_refused(tmp_path / "nope", SnapshotNotFoundError, str(tmp_path / "nope"),
                   "no environment snapshot")


def test_no_snapshot_in_an_empty_folder(tmp_path: Path) -> None:
    assert_refused(tmp_path, SnapshotNotFoundError, "manifest.json")


def test_shards_without_a_manifest_read_as_no_snapshot(snapshot_root: Path) -> None:
    manifest_path(snapshot_root).unlink()
    assert_refused(snapshot_root, SnapshotNotFoundError, "interrupted before it committed")


def test_a_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_text("not a folder")
    assert_refused(f, CheckpointPathError, str(f), "is a file")


def test_a_future_format_version_is_refused(snapshot_root: Path) -> None:
    edit_manifest(snapshot_root, lambda d: d.update(format_version=99))
    assert_refused(snapshot_root, UnsupportedFormatVersionError, "format version 99",
                   str(manifest_path(snapshot_root)))


@pytest.mark.parametrize("garbage", [b"", b"\x00\xff garbage", b"{not json", b"[1, 2]"])
def test_a_manifest_that_does_not_parse_is_refused(snapshot_root: Path, garbage: bytes) -> None:
    manifest_path(snapshot_root).write_bytes(garbage)
    assert_refused(snapshot_root, ManifestInvalidError, str(manifest_path(snapshot_root)))


@pytest.mark.parametrize("edit", [
    lambda d: d.pop("shards"),
    lambda d: d["shards"][0].update(bytes=-1),
    lambda d: d["shards"][0].update(content_hash="xxh3-128:zz"),
    lambda d: d["shards"][0].update(content_hash="md5:" + "0" * 32),
    lambda d: d["rollouts"][0].update(shard="shard-unknown.msgpack"),
    lambda d: d["shards"][0].update(sessions=7),
    lambda d: d.update(extra_field=1),
], ids=["no-shards", "negative-length", "bad-hash", "unknown-algorithm", "unknown-shard",
        "wrong-count", "extra"])
def test_a_manifest_that_does_not_validate_is_refused(snapshot_root: Path, edit) -> None:  # type: ignore[no-untyped-def]
    edit_manifest(snapshot_root, edit)
    assert_refused(snapshot_root, ManifestInvalidError, "does not validate")


@pytest.mark.parametrize("claimed", [10**15, 2**62])
def test_a_shard_length_claimed_in_the_manifest_is_checked_not_allocated(
        snapshot_root: Path, claimed: int) -> None:
    """A length in a file is a claim: a manifest saying a shard holds a petabyte is
    refused by the shard's real size, not by running out of memory."""
    edit_manifest(snapshot_root, lambda d: d["shards"][0].update(bytes=claimed))
    real = shard_path(snapshot_root).stat().st_size
    assert_refused(snapshot_root, ShardCorruptedError, f"is {real} bytes",
                   f"the manifest says {claimed}")
    # inspect reads a shard's index without its hash: bounded by the real size too.
    entry = read_manifest(snapshot_root).shards[0]
    assert read_shard_index(environment_dir(snapshot_root), entry)


def test_a_deeply_nested_manifest_is_refused_as_invalid_not_a_recursion_error(
        snapshot_root: Path) -> None:
    manifest_path(snapshot_root).write_bytes(b"[" * 200_000 + b"]" * 200_000)
    assert_refused(snapshot_root, ManifestInvalidError, "nested too deeply")
    manifest_path(snapshot_root).write_bytes(
        b'{"format_version": 3, "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    assert_refused(snapshot_root, ManifestInvalidError)
    # Clean-up and abort read the manifest too: a clean-up that cannot tell what it
    # names removes nothing, and an abort finds no snapshot id there.
    with pytest.raises(CheckpointPathError, match="nested too deeply.*nothing was removed"):
        manifest_shard_files(environment_dir(snapshot_root))
    assert manifest_snapshot_id(environment_dir(snapshot_root)) is None


def test_a_deleted_shard_is_a_torn_snapshot(snapshot_root: Path) -> None:
    shard_path(snapshot_root, "holder-1").unlink()
    assert_refused(snapshot_root, TornSnapshotError, str(shard_path(snapshot_root, "holder-1")),
                   "torn")


def test_a_flipped_byte_is_caught_by_the_hash(snapshot_root: Path) -> None:
    p = flip_middle_byte(shard_path(snapshot_root))
    assert_refused(snapshot_root, ShardCorruptedError, str(p), "xxh3-128")


def test_a_truncated_shard_is_caught_by_its_length(snapshot_root: Path) -> None:
    p = shard_path(snapshot_root)
    p.write_bytes(p.read_bytes()[:-5])
    assert_refused(snapshot_root, ShardCorruptedError, str(p), "truncated")


def test_a_shard_replaced_by_garbage_of_the_same_length_is_refused(snapshot_root: Path) -> None:
    p = shard_path(snapshot_root)
    p.write_bytes(os.urandom(p.stat().st_size))
    assert_refused(snapshot_root, ShardCorruptedError, str(p))


def test_a_shard_that_matches_its_hash_but_not_the_format_is_refused(snapshot_root: Path) -> None:
    p = shard_path(snapshot_root)
    garbage = msgpack.packb({"format": "something-else"})
    p.write_bytes(garbage)
    edit_manifest(snapshot_root, lambda d: d["shards"][0].update(
        bytes=len(garbage), content_hash=f"xxh3-128:{xxhash.xxh3_128(garbage).hexdigest()}"))
    assert_refused(snapshot_root, ShardCorruptedError, "does not decode")


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "sub/shard.msgpack", "..\\x", ".."])
def test_a_shard_name_escaping_the_folder_is_refused(snapshot_root: Path, name: str) -> None:
    def escape(d: dict) -> None:  # type: ignore[type-arg]
        old = d["shards"][0]["file"]
        d["shards"][0]["file"] = name
        for r in d["rollouts"]:
            if r["shard"] == old:
                r["shard"] = name

    edit_manifest(snapshot_root, escape)
    assert_refused(snapshot_root, UnsafeShardNameError, repr(name), "not a plain file name")


def test_every_refusal_is_a_snapshot_read_error_with_its_own_class() -> None:
    kinds = [SnapshotNotFoundError, CheckpointPathError, UnsupportedFormatVersionError,
             ManifestInvalidError, TornSnapshotError, ShardCorruptedError, UnsafeShardNameError]
    assert len(set(kinds)) == len(kinds)
    assert all(issubclass(k, SnapshotReadError) for k in kinds)


def test_manifest_model_refuses_a_rollout_in_another_instances_shard() -> None:
    shard = ShardEntry(file="s.msgpack", bytes=1, content_hash="xxh3-128:" + "0" * 32,
                       instance_id="holder-0",
                       sessions=1)
    with pytest.raises(ValueError, match="1 rollout.s. of holder-1 sit in shard"):
        Manifest(format_version=2, snapshot_id="x", created_at=datetime.now(timezone.utc),
                 instances=["holder-0", "holder-1"], shards=[shard],
                 rollouts=[RolloutEntry(instance_id="holder-1", rollout_id="r", attempt=0,
                                        turns=0, staging_keys=[], shard="s.msgpack")],
                 restarted_rollouts=0, metrics={})


def test_a_shard_is_its_header_its_index_then_its_payloads_as_msgpack_packs_them(
        tmp_path: Path) -> None:
    # Big payloads go to the file by reference, small ones joined: the bytes on disk must
    # be exactly the msgpack stream, and the index readable without the payloads.
    records = [
        SessionRecord("holder-0", Ep("big-turns", 1), tuple(os.urandom(40 << 10) for _ in range(3)),
                      b"", frozenset({"k1", "k2"}), ("big-turns",)),
        SessionRecord("holder-0", Ep("big-state", 0), (b"t",), os.urandom(70000)),
        SessionRecord("holder-0", Ep("mid-state", 0), (), os.urandom(300)),
    ]
    directory = prepare_environment_dir(tmp_path)
    entry = write_shard(directory, "shard-x.msgpack", "holder-0", records)
    pack = msgpack.Packer(use_bin_type=True).pack
    expected = pack({"format": "nemo-ckpt-shard", "version": 3, "instance_id": "holder-0",
                     "sessions": 3})
    expected += pack([[r.episode.rollout_id, r.episode.attempt, sorted(r.staging_keys),
                       len(r.turns), list(r.earlier_capture_keys)] for r in records])
    expected += b"".join(pack([list(r.turns), r.state]) for r in records)
    assert (directory / "shard-x.msgpack").read_bytes() == expected
    assert entry.content_hash == f"xxh3-128:{xxhash.xxh3_128(expected).hexdigest()}"
    assert read_shard(directory, entry) == records


def test_a_shard_of_the_layout_before_format_3_is_still_read(tmp_path: Path) -> None:
    records = [session("holder-0", "a"), session("holder-0", "b", 2)]
    pack = msgpack.Packer(use_bin_type=True).pack
    data = pack({"format": "nemo-ckpt-shard", "version": 1, "instance_id": "holder-0"})
    data += b"".join(pack(r.to_wire()) for r in records)
    directory = prepare_environment_dir(tmp_path)
    (directory / "old.msgpack").write_bytes(data)
    entry = ShardEntry(file="old.msgpack", bytes=len(data), instance_id="holder-0",
                       content_hash=f"xxh3-128:{xxhash.xxh3_128(data).hexdigest()}", sessions=2)
    assert read_shard(directory, entry) == records


def test_a_shard_written_through_short_writes_is_complete_and_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Network filesystems may accept part of a writev; the writer must resume mid-piece.
    real_writev = os.writev
    calls = 0

    def short_writev(fd: int, buffers: list[memoryview]) -> int:
        nonlocal calls
        calls += 1
        head = bytes(memoryview(b"".join(bytes(b) for b in buffers))[:7777])
        return real_writev(fd, [head])

    monkeypatch.setattr(os, "writev", short_writev)
    records = [session("holder-0", f"r{i}", state=os.urandom(20000 + i)) for i in range(40)]
    write_snapshot(tmp_path, {"holder-0": records})
    monkeypatch.undo()
    assert calls > 40
    assert read_snapshot(tmp_path).sessions["holder-0"] == records


def write_snapshot_v3(root: Path, by_instance: dict[str, list[SessionRecord]],
                      snapshot_id: str = "snap-3", restarted: int = 0) -> Manifest:
    """Write shards, then the manifest as the coordinator commits now (format 3 until
    format 6 added chunk hashes; ``as_format_3`` makes the format-3 one)."""
    directory = prepare_environment_dir(root)
    shards = [write_shard(directory, shard_file_name(snapshot_id, inst), inst, records)
              for inst, records in by_instance.items() if records]
    raw = encode_manifest(snapshot_id=snapshot_id, created_at=datetime.now(timezone.utc),
                          instances=sorted(by_instance), shards=shards,
                          restarted_rollouts=restarted, metrics={"paused_seconds": 0.01})
    write_manifest(directory, raw)
    return Manifest.model_validate_json(raw)


def as_format_3(root: Path) -> Manifest:
    """Rewrite the manifest under ``root`` as format 3 wrote it: no chunk hashes."""
    path = root / ENVIRONMENT_DIR / MANIFEST_NAME
    data = json.loads(path.read_bytes())
    data["format_version"] = 3
    for shard in data["shards"]:
        del shard["chunks"]
    path.write_text(json.dumps(data))
    return Manifest.model_validate_json(path.read_bytes())


@pytest.mark.parametrize("version", [3, FORMAT_VERSION])
def test_a_manifest_without_rollouts_reads_back_and_the_shards_hold_them(
        tmp_path: Path, version: int) -> None:
    by_instance = {"holder-0": [session("holder-0", "a"), session("holder-0", "b", 2)],
                   "holder-1": [session("holder-1", "c", 1)], "holder-2": []}
    written = write_snapshot_v3(tmp_path, by_instance)
    if version == 3:
        written = as_format_3(tmp_path)
    loaded = read_snapshot(tmp_path)
    assert loaded.manifest == written and written.format_version == version
    assert loaded.manifest.rollouts == [] and loaded.manifest.sessions == 3
    assert loaded.sessions == by_instance
    rollouts, unreadable = snapshot_rollouts(tmp_path, loaded.manifest)
    assert unreadable == {}
    assert sorted((r.instance_id, r.rollout_id, r.attempt, r.turns) for r in rollouts) == [
        ("holder-0", "a", 0, 2), ("holder-0", "b", 2, 2), ("holder-1", "c", 1, 2)]


def test_a_format_3_manifest_stays_the_same_size_whatever_the_rollouts(
        tmp_path: Path) -> None:
    sizes = []
    for n in (10, 2000):
        root = tmp_path / str(n)
        write_snapshot_v3(root, {"holder-0": [session("holder-0", f"r{k:05d}", state=b"s")
                                              for k in range(n)]})
        sizes.append((environment_dir(root) / "manifest.json").stat().st_size)
    assert max(sizes) < 1024 and abs(sizes[0] - sizes[1]) < 32  # digits of counts only


def test_a_format_3_manifest_lists_no_rollouts_and_its_shards_once(tmp_path: Path) -> None:
    manifest = write_snapshot_v3(tmp_path, {"holder-0": [session("holder-0", "a")]})
    with pytest.raises(ValueError, match="shard files listed twice"):
        encode_manifest(snapshot_id="s", created_at=manifest.created_at,
                        instances=manifest.instances, shards=manifest.shards * 2,
                        restarted_rollouts=0, metrics={})
    with pytest.raises(ValueError, match="not listed in instances"):
        encode_manifest(snapshot_id="s", created_at=manifest.created_at, instances=[],
                        shards=manifest.shards, restarted_rollouts=0, metrics={})
    edit_manifest(tmp_path, lambda d: d.update(rollouts=[{
        "instance_id": "holder-0", "rollout_id": "a", "attempt": 0, "turns": 2,
        "staging_keys": [], "shard": manifest.shards[0].file}]))
    assert_refused(tmp_path, ManifestInvalidError, "lists no rollouts")


def test_odd_rollout_ids_survive_the_shard_index(tmp_path: Path) -> None:
    odd = ['quo"te', "back\\slash", "new\nline", "ünï\u2028cødé", "tab\t/slash"]
    records = [session("holder-0", rid, state=b"x") for rid in odd]
    manifest = write_snapshot_v3(tmp_path, {"holder-0": records})
    loaded = read_snapshot(tmp_path)
    assert [r.rollout_id for r in snapshot_rollouts(tmp_path, manifest)[0]] == odd
    assert loaded.sessions["holder-0"] == records


def test_a_format_3_shard_holding_a_rollout_twice_or_in_two_shards_is_refused(
        tmp_path: Path) -> None:
    records = [session("holder-0", "r"), session("holder-0", "r", 3)]
    write_snapshot_v3(tmp_path / "twice", {"holder-0": records})
    with pytest.raises(ShardCorruptedError, match="holds rollout 'r' twice"):
        read_snapshot(tmp_path / "twice")
    write_snapshot_v3(tmp_path / "two", {"holder-0": [session("holder-0", "r")],
                                         "holder-1": [session("holder-1", "r", 1)]})
    with pytest.raises(ShardCorruptedError, match="'r' is in two shards"):
        read_snapshot(tmp_path / "two")


# --- bounded decoding, one verification (issue 11) ------------------------------------


def test_a_shard_is_not_decoded_before_its_hash_matches(tmp_path: Path) -> None:
    # Case 12: 2 MB of msgpack empty arrays would unpack into millions of objects.
    import tracemalloc

    directory = prepare_environment_dir(tmp_path)
    crafted = b"\x90" * (2 << 20)
    (directory / "shard-x.msgpack").write_bytes(crafted)
    entry = ShardEntry(file="shard-x.msgpack", bytes=len(crafted),
                       content_hash="xxh3-128:" + "0" * 32, instance_id="holder-0",
                       sessions=0)
    tracemalloc.start()
    try:
        with pytest.raises(ShardCorruptedError, match="content changed after the snapshot"):
            read_shard(directory, entry)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(crafted), f"peak {peak} bytes for a {len(crafted)}-byte shard"


def test_a_crafted_shard_holding_a_rollout_twice_is_refused(tmp_path: Path) -> None:
    # Case 13: a shard whose hash matches its manifest, holding r at attempts 0 and 3.
    root = tmp_path / "ckpt"
    write_snapshot(root, {"holder-0": [session("holder-0", "r"), session("holder-0", "s")]})
    directory = environment_dir(root)
    name = shard_file_name("snap-1", "holder-0")
    entry = write_shard(directory, name, "holder-0",
                        [session("holder-0", "r"), session("holder-0", "r", 3)])
    edit_manifest(root, lambda m: m["shards"][0].update(bytes=entry.bytes,
                                                         content_hash=entry.content_hash))
    with pytest.raises(ShardCorruptedError, match="holds rollout 'r' twice"):
        read_snapshot(root)
    problems = shard_problems({"r": 0, "s": 0}, [("r", 0), ("r", 3)], name)
    assert any("twice" in p for p in problems) and any("lacks rollouts" in p for p in problems)


# --- the blob store's claims, judged on the reader's clock (issue 23, case 1) ------------


def _store_with_garbage(root: Path) -> BlobStore:
    store = BlobStore(str(root / BLOB_DIR), folder_at)
    store.put(digest_of(b"garbage"), b"garbage")
    return store


def test_a_holder_whose_clock_is_a_day_ahead_still_waits_for_a_running_collection(
        tmp_path: Path) -> None:
    store = _store_with_garbage(tmp_path)
    collector = FakeClock(1_000.0)
    holder = FakeClock(1_000.0 + 86_400.0)
    waited: list[float] = []

    def a_snapshot_relies_on_the_store_now() -> bool:
        start = holder()
        with pytest.raises(CheckpointPathBusyError, match="is being collected by gc-1"):
            store.claims.wait_for_collection(clock=holder, sleep=holder.advance, deadline=start + 5)
        waited.append(holder() - start)
        return True  # the collector stops for the snapshot

    report = collect_blobs(tmp_path, owner="gc-1", clock=collector,
                           should_stop=a_snapshot_relies_on_the_store_now)
    assert report.interrupted and len(waited) == 1 and 5 <= waited[0] < 5.1
    store.claims.wait_for_collection(clock=holder, sleep=holder.advance)  # over: returns at once
    assert store.missing([digest_of(b"garbage")]) == set()


def test_a_holder_waits_out_a_dead_collectors_claim_for_its_ttl_on_its_own_clock(
        tmp_path: Path) -> None:
    store = _store_with_garbage(tmp_path)
    # Left by a collector of an older nemo-ckpt that died: an expiry a year ahead.
    claim = {"operation": "collector", "owner": "gc-old", "expires_at": time.time() + 3e7}
    (tmp_path / BLOB_DIR / ".claim-collector.json").write_text(json.dumps(claim))
    holder = FakeClock(0.0)
    store.claims.wait_for_collection(clock=holder, sleep=holder.advance, deadline=600.0)
    assert LEGACY_TTL_S * STALE_FACTOR <= holder() < LEGACY_TTL_S * STALE_FACTOR + 0.1


def test_two_collectors_never_both_run_and_a_dead_ones_claim_is_taken_over_after_its_ttl(
        tmp_path: Path) -> None:
    store_a = _store_with_garbage(tmp_path)
    store_b = BlobStore(str(tmp_path / BLOB_DIR), folder_at)
    clock_b = FakeClock(0.0)
    watch_b = ClaimWatch(clock_b)
    store_a.claims.begin_collection("gc-a", ttl_s=30, watch=ClaimWatch())
    with pytest.raises(CheckpointPathBusyError, match="already being collected by gc-a"):
        store_b.claims.begin_collection("gc-b", ttl_s=30, watch=watch_b)
    clock_b.advance(30 * STALE_FACTOR - 1)  # gc-a stalls: its claim unchanged
    with pytest.raises(CheckpointPathBusyError, match="already being collected by gc-a"):
        store_b.claims.begin_collection("gc-b", ttl_s=30, watch=watch_b)
    clock_b.advance(2)
    store_b.claims.begin_collection("gc-b", ttl_s=30, watch=watch_b)
    # gc-a wakes up: its claim is gone, so it stops, and leaves gc-b's claim alone.
    with pytest.raises(CheckpointPathBusyError, match="lost its claim"):
        store_a.claims.renew_collection("gc-a", ttl_s=30)
    store_a.claims.end_collection()
    live = store_b.claims.live_collection(ClaimWatch())
    assert live is not None and live.owner == "gc-b"
    store_b.claims.end_collection()
    assert store_b.claims.live_collection(ClaimWatch()) is None
    assert [n for n in os.listdir(tmp_path / BLOB_DIR) if n.startswith(".")] == []


# --- disk errors are the project's errors -------------------------------------------------


def test_a_folder_that_cannot_be_listed_or_cleaned_raises_a_nemo_ckpt_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EIO while listing a snapshot folder (claims, clean-up) or removing from it
    reached the driver as a bare OSError; it is one of the documented classes."""
    folder = folder_at(tmp_path)
    (tmp_path / "f").write_bytes(b"x")

    def eio(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(Path, "iterdir", eio)
    with pytest.raises(CheckpointPathError, match=f"cannot list {tmp_path}: Input/output"):
        folder.names()
    with pytest.raises(CheckpointPathError, match="cannot list"):
        folder.subfolders()
    monkeypatch.setattr(Path, "unlink", eio)
    with pytest.raises(SnapshotWriteError, match=f"could not remove {tmp_path / 'f'}"):
        folder.remove(["f"])


def test_a_collection_claim_whose_write_landed_but_raised_is_not_left_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Left behind, it held every snapshot's persist until it was judged abandoned."""
    store = BlobStore(str(tmp_path / BLOB_DIR), folder_at)
    root = tmp_path / BLOB_DIR
    real = type(folder_at(root)).write_bytes

    def landed_then_failed(self: Any, name: str, data: bytes, sync: bool = True,
                           expect: str | None = None) -> None:
        real(self, name, data, sync, expect)
        raise SnapshotWriteError(self.path / name, "EIO after the link (injected)")

    monkeypatch.setattr(type(folder_at(root)), "write_bytes", landed_then_failed)
    with pytest.raises(SnapshotWriteError, match="after the link"):
        store.claims.begin_collection("gc", 30.0, ClaimWatch())
    assert not [p.name for p in root.iterdir() if p.name.startswith(".claim-")]
    store.claims.wait_for_collection(deadline=time.monotonic())  # nothing to wait for


def test_a_claim_that_cannot_be_read_stops_a_collection_instead_of_being_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Skipped, a snapshot's hold let a collection remove blobs it relied on."""
    store = BlobStore(str(tmp_path / BLOB_DIR), folder_at)
    store.claims.hold("snap-1", "job@c", 60.0)
    local = type(folder_at(tmp_path))
    real_read = local.read

    def eio_on_claims(self: Any, name: str, limit: int | None = None) -> bytes:
        if name.startswith(".claim-snap"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_read(self, name, limit)

    monkeypatch.setattr(local, "read", eio_on_claims)
    with pytest.raises(CheckpointPathError, match="cannot read the claim .*claim-snap-1"):
        store.claims.begin_collection("gc", 30.0, ClaimWatch())
    directory = prepare_environment_dir(tmp_path / "ckpt")
    claim_path(directory, "snap-2", "job@c", ClaimWatch(), 60.0)
    with pytest.raises(CheckpointPathError, match="cannot read the claim"):
        live_claims(directory, "job@c", ClaimWatch(), ours=())
