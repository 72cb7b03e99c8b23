"""Writing and reading snapshot files under ``<checkpoint_path>/environment/``.

Every file is written the same durable way: to a temp file in the same folder,
fsynced, renamed into place, then the folder fsynced. The content hash is computed
while writing, never by reading the file back. The manifest is written last, so a
folder without one holds no snapshot, whatever shards it has.

Reading verifies before it returns: the manifest's version and schema, every shard
name, every shard's length and hash, then what each shard holds against the manifest.
A shard is decoded only once its hash matches, so a crafted or damaged file costs at
most its own length in memory. Each refusal has its own exception class (see
``nemo_ckpt.errors``), and a refused read changes nothing on disk.

Committed is final: a file the manifest at a path names is never removed by anything
here until a newer manifest replaces it. Operations in progress hold a *claim* on the
folder (``.claim-<operation>.json``: its owner and an expiry it renews), so that a
commit's clean-up leaves another operation's files alone and a second job's snapshot
into the same folder is refused instead of cleaned away.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import xxhash
from pydantic import ValidationError

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
from nemo_ckpt.manifest import (
    ENVIRONMENT_DIR,
    MANIFEST_NAME,
    SHARD_PREFIX,
    SHARD_SUFFIX,
    SUPPORTED_FORMAT_VERSIONS,
    Manifest,
    ShardEntry,
    is_plain_file_name,
    rollouts_by_shard,
    safe_name_part,
    shard_file_name,
    shard_problems,
    upgrade_v1,
)
from nemo_ckpt.sessions import SessionRecord, body_head, record_of, record_parts

__all__ = [
    "environment_dir",
    "prepare_environment_dir",
    "write_shard",
    "write_manifest",
    "read_manifest",
    "read_shard",
    "read_shard_parts",
    "ShardParts",
    "write_shard_parts",
    "read_snapshot",
    "read_shard_index",
    "snapshot_rollouts",
    "RolloutIndexEntry",
    "remove_files",
    "remove_unreferenced_files",
    "remove_snapshot_files",
    "manifest_snapshot_id",
    "manifest_shard_files",
    "PathClaim",
    "read_claims",
    "claim_path",
    "release_claim",
    "live_claims",
    "LoadedSnapshot",
    "CONTENT_HASH",
    "content_hasher",
]

SHARD_MAGIC = "nemo-ckpt-shard"
# Shard layouts: 3 (written): a header, the index (one row per session), then one
# payload per session (``nemo_ckpt.sessions``); 1 (read): a header, then one map per
# session (manifest formats 1 and 2).
SHARD_VERSION = 3
_TMP_MARK = ".tmp-"
# Pieces are written in batches of about _WRITE_BATCH bytes with one writev each: small
# pieces are gathered into a buffer first, pieces at least _DIRECT_WRITE long (big
# states) go to the kernel by reference, without a copy. Per-piece write syscalls cost
# a third of the write's time at 64 KiB states.
_WRITE_BATCH = 4 << 20
# ...but copies of small pieces are written once they reach this much: they are memory
# the snapshot adds on top of the sessions (4 MiB of them was 1.6x the state of a holder
# of 2,500 1 KiB sessions).
_COPIED_BATCH = 256 << 10
_DIRECT_WRITE = 16 << 10
_SMALL_PIECE_BUFFER = 256 << 10
_MAX_IOV = 512  # well under every platform's IOV_MAX (1024 on Linux)
_READ_CHUNK = 4 << 20
# XXH3-128 detects torn and corrupted files as well as SHA-256 does, at ~25 GB/s a core
# instead of ~2: a cryptographic hash buys nothing here (whoever can rewrite a shard can
# rewrite the manifest too) and made persist and restore CPU-bound.
CONTENT_HASH = "xxh3-128"
_HASHERS: dict[str, Any] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def content_hasher(algorithm: str = CONTENT_HASH) -> Any:
    """A fresh hasher (``update``, ``hexdigest``) for a manifest's hash algorithm."""
    try:
        return _HASHERS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown content hash algorithm {algorithm!r}; "
                         f"one of {sorted(_HASHERS)}") from None


def _split_hash(content_hash: str) -> tuple[str, str]:
    algorithm, _, digest = content_hash.partition(":")
    return algorithm, digest


def environment_dir(checkpoint_path: Path | str) -> Path:
    """The folder that holds the environment's half of a checkpoint."""
    return Path(checkpoint_path) / ENVIRONMENT_DIR


# --- writing -------------------------------------------------------------------------


class _HashingWriter:
    """Hashes every byte on its way to the file, in the order written, and writes in
    large ``writev`` batches (see ``_WRITE_BATCH``)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._small = bytearray()
        self._batch: list[bytes | bytearray | memoryview] = []
        self._batch_bytes = 0
        self._copied_bytes = 0  # of _batch, in copies of small pieces
        self.hash = content_hasher()
        self.length = 0

    def write(self, data: bytes | bytearray | memoryview, copy: bool = False) -> None:
        """Queue ``data``; big pieces are kept by reference, so they must not change.
        ``copy`` says a big piece is a copy made for this write, bounded like the
        writer's own copies of small pieces."""
        n = len(data)
        self.length += n
        if n >= _DIRECT_WRITE:
            self._seal_small()
            self._batch.append(data)
            self._batch_bytes += n
            if copy:
                self._copied_bytes += n
        else:
            self._small += data
            if len(self._small) >= _SMALL_PIECE_BUFFER:
                self._seal_small()
        if self._batch_bytes >= _WRITE_BATCH or len(self._batch) >= _MAX_IOV \
                or self._copied_bytes >= _COPIED_BATCH:
            self._flush()

    def _seal_small(self) -> None:
        if self._small:
            self._batch.append(self._small)
            self._batch_bytes += len(self._small)
            self._copied_bytes += len(self._small)
            self._small = bytearray()

    def _flush(self) -> None:
        self._seal_small()
        for piece in self._batch:
            self.hash.update(piece)
        _writev_all(self._fd, self._batch)
        self._batch = []
        self._batch_bytes = 0
        self._copied_bytes = 0

    def close(self) -> None:
        """Write what is still queued."""
        self._flush()


def _writev_all(fd: int, pieces: list[bytes | bytearray | memoryview]) -> None:
    """``os.writev`` every piece, resuming after short writes."""
    views = [memoryview(p) for p in pieces]
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i:])
        while i < len(views) and written >= len(views[i]):
            written -= len(views[i])
            i += 1
        if written:
            views[i] = views[i][written:]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(directory: Path, name: str, fill: Any) -> tuple[int, str]:
    """Write ``name`` in ``directory`` through ``fill(writer)``; return (length,
    content hash as ``<algorithm>:<hex>``).

    The file appears under its name only once complete and fsynced; on any failure
    the temp file goes and ``SnapshotWriteError`` says where and why.
    """
    if not is_plain_file_name(name):
        raise ValueError(f"{name!r} is not a plain file name")
    tmp = directory / f".{name}{_TMP_MARK}{uuid.uuid4().hex}"
    target = directory / name
    try:
        with open(tmp, "xb", buffering=0) as f:
            writer = _HashingWriter(f.fileno())
            fill(writer)
            writer.close()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(directory)
    except BaseException as exc:
        # Whatever failed (disk, or the caller's own iterator), no partial file stays.
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise SnapshotWriteError(target, _write_failure(target, exc)) from exc
        raise
    return writer.length, f"{CONTENT_HASH}:{writer.hash.hexdigest()}"


def _write_failure(target: Path, exc: OSError) -> str:
    reason = {
        errno.ENOSPC: "the filesystem is full; free space or point snapshots elsewhere",
        errno.EDQUOT: "the disk quota is exhausted; free space or raise the quota",
        errno.EROFS: "the filesystem is read-only; mount it read-write",
        errno.EACCES: "permission denied; let the Ray workers' user write there",
        errno.EPERM: "permission denied; let the Ray workers' user write there",
        errno.ENOENT: "the checkpoint folder disappeared while writing; check what removes it",
    }.get(exc.errno or 0, "check the filesystem and retry the snapshot")
    return f"could not write {target}: {exc.strerror or exc} ({reason})"


def prepare_environment_dir(checkpoint_path: Path | str) -> Path:
    """Create ``<checkpoint_path>/environment`` if needed and return it."""
    directory = environment_dir(checkpoint_path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SnapshotWriteError(directory, _write_failure(directory, exc)) from exc
    return directory


def write_shard(
    directory: Path, name: str, instance_id: str, sessions: Iterable[SessionRecord]
) -> ShardEntry:
    """Write ``sessions`` of ``instance_id`` as shard ``name`` (see ``write_shard_parts``)."""
    rows, bodies = [], []
    for record in sessions:
        if record.instance_id != instance_id:
            raise ValueError(
                f"session {record.episode.capture_key} belongs to "
                f"{record.instance_id}, not to shard instance {instance_id}"
            )
        row, turns_blob, state = record_parts(record)
        rows.append(row)
        bodies.append((turns_blob, state))
    index = msgpack.Packer().pack_array_header(len(rows)) + b"".join(rows)
    return write_shard_parts(directory, name, instance_id, index, len(rows), bodies)


def write_shard_parts(directory: Path, name: str, instance_id: str, index: bytes,
                      count: int, bodies: Iterable[tuple[bytes, bytes]]) -> ShardEntry:
    """Write one shard from sessions already encoded, as holders keep them, and return
    its manifest entry: ``index`` is the msgpack array of the ``count`` sessions' rows
    (a capture's ``captured_msgpack``), ``bodies`` yields each one's turns blob and state
    in the same order.

    The shard is a stream of msgpack objects: a header map, the index, then each
    session's body, ``[turns, state]``. It is joined from those bytes as they are (big
    states by reference): nothing is re-encoded, no list per session is built (at a
    million small sessions each would be memory the snapshot adds), and the index can
    be read without the bodies.
    """

    def fill(w: _HashingWriter) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        w.write(packer.pack({"format": SHARD_MAGIC, "version": SHARD_VERSION,
                             "instance_id": instance_id, "sessions": count}))
        # Written as it is (by reference when big): the capture already holds it.
        w.write(index)
        batch: list[bytes] = []
        size = 0
        written = 0
        for turns_blob, state in bodies:
            written += 1
            head = body_head(turns_blob, len(state))
            if len(state) >= _DIRECT_WRITE:  # big: by reference, without a copy
                batch.append(head)
                w.write(b"".join(batch), copy=True)
                w.write(state)
                batch, size = [], 0
                continue
            batch += (head, state)
            size += len(head) + len(state)
            if size >= _SMALL_PIECE_BUFFER:
                w.write(b"".join(batch), copy=True)
                batch, size = [], 0
        if batch:
            w.write(b"".join(batch), copy=True)
        if written != count:
            raise ValueError(f"shard {name}: an index of {count} sessions, "
                             f"{written} bodies")

    length, digest = _write_durably(directory, name, fill)
    return ShardEntry(file=name, bytes=length, content_hash=digest, instance_id=instance_id,
                      sessions=count)


def write_manifest(directory: Path, manifest: Manifest | bytes) -> None:
    """Commit the snapshot: write ``manifest.json`` durably. Call it after every shard.

    ``manifest`` is a ``Manifest`` or its JSON from ``encode_manifest``."""
    # Compact: it is written while the holders are paused; `nemo-ckpt inspect` reads it.
    data = manifest if isinstance(manifest, bytes) else manifest.model_dump_json().encode()
    _write_durably(directory, MANIFEST_NAME, lambda w: w.write(data))


def remove_files(directory: Path, names: Iterable[str]) -> None:
    """Remove the named plain files from ``directory``; missing ones are fine."""
    for name in names:
        if is_plain_file_name(name):
            (directory / name).unlink(missing_ok=True)


def manifest_shard_files(directory: Path) -> set[str]:
    """The shard files the manifest in ``directory`` names now (none without one)."""
    try:
        data = json.loads((directory / MANIFEST_NAME).read_bytes())
        return {str(s["file"]) for s in data["shards"]}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # A manifest that does not parse protects nothing we can name: remove nothing.
        raise CheckpointPathError(
            directory / MANIFEST_NAME, f"cannot read the shard list of "
            f"{directory / MANIFEST_NAME} ({exc}); nothing was removed") from exc


def remove_unreferenced_files(directory: Path, protect: Collection[str] = ()) -> list[str]:
    """After a commit, remove shards and temp files that the manifest here now does not
    name: an older snapshot's that a newer one replaced, or an aborted one's.

    What the manifest names is read here, not passed in, so a clean-up that runs late
    never removes a newer commit's files. Files of the operations in ``protect`` (in
    progress here: see ``live_claims``) stay too, and only files whose names nemo-ckpt
    makes are touched. Returns the names removed.
    """
    keep = manifest_shard_files(directory)
    stems = [_operation_stem(op) for op in protect]
    removed = []
    for entry in directory.iterdir():
        name = entry.name
        ours = (name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)) or (
            name.startswith(".") and _TMP_MARK in name
        )
        if not ours or name in keep or any(name.lstrip(".").startswith(s) for s in stems):
            continue
        entry.unlink(missing_ok=True)
        removed.append(name)
    if removed:
        _fsync_dir(directory)
    return removed


# --- claims of operations in progress -----------------------------------------------

CLAIM_PREFIX = ".claim-"


@dataclass(frozen=True)
class PathClaim:
    """An operation in progress in a checkpoint folder: who runs it, and until when
    (epoch seconds) the claim holds unless renewed."""

    operation: str
    owner: str
    expires_at: float


def _claim_name(operation_id: str) -> str:
    return f"{CLAIM_PREFIX}{safe_name_part(operation_id)}.json"


def read_claims(directory: Path) -> list[PathClaim]:
    """Every readable claim in ``directory`` (a half-written one is skipped)."""
    claims: list[PathClaim] = []
    if not directory.is_dir():
        return claims
    for entry in directory.iterdir():
        if not (entry.name.startswith(CLAIM_PREFIX) and entry.name.endswith(".json")):
            continue
        try:
            data = json.loads(entry.read_bytes())
            claims.append(PathClaim(str(data["operation"]), str(data["owner"]),
                                    float(data["expires_at"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return claims


def live_claims(directory: Path, owner: str, now: float, ours: Collection[str]) -> set[str]:
    """The operations whose files must stay: claims of other owners that have not
    expired, and ``ours`` (this owner's operations open now). A claim of this owner that
    is not in ``ours`` was left by a predecessor that died: it protects nothing."""
    return {c.operation for c in read_claims(directory)
            if (c.owner != owner and c.expires_at > now) or c.operation in ours}


def claim_path(directory: Path, operation_id: str, owner: str, now: float,
               ttl_s: float) -> None:
    """Claim ``directory`` for ``operation_id`` until ``now + ttl_s``; calling it again
    renews the claim. Refuses with ``CheckpointPathBusyError`` while another owner's
    claim holds (another job snapshots here). This owner's own operations need no
    refusal: its holders run one at a time, and clean-up spares the ones open."""
    for claim in read_claims(directory):
        if claim.operation == operation_id or claim.expires_at <= now:
            continue
        if claim.owner != owner:
            raise CheckpointPathBusyError(
                f"{directory} is in use by {claim.operation} of {claim.owner} (its claim "
                f"holds for {claim.expires_at - now:.0f}s more): two jobs must not write "
                f"snapshots into one checkpoint path; give each job its own path")
    data = json.dumps({"operation": operation_id, "owner": owner,
                       "expires_at": now + ttl_s}).encode()
    target = directory / _claim_name(operation_id)
    tmp = directory / f".{target.name}{_TMP_MARK}{uuid.uuid4().hex}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise SnapshotWriteError(target, _write_failure(target, exc)) from exc


def release_claim(directory: Path, operation_id: str) -> None:
    """Drop the claim of ``operation_id``, if any."""
    (directory / _claim_name(operation_id)).unlink(missing_ok=True)


# --- reading -------------------------------------------------------------------------


def read_manifest(checkpoint_path: Path | str) -> Manifest:
    """Read and validate the manifest of the snapshot at ``checkpoint_path``.

    Raises one of ``SnapshotNotFoundError``, ``CheckpointPathError``,
    ``UnsupportedFormatVersionError``, ``ManifestInvalidError`` or
    ``UnsafeShardNameError``. Shards are not read; see ``read_snapshot``.
    """
    root = Path(checkpoint_path)
    directory = environment_dir(root)
    for p in (root, directory):
        if p.exists() and not p.is_dir():
            raise CheckpointPathError(
                p, f"checkpoint path {p} is a file, not a folder; pass the folder that "
                   f"snapshot() was given (the one holding {ENVIRONMENT_DIR}/)"
            )
    path = directory / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        detail = ""
        if directory.is_dir() and any(directory.glob(f"{SHARD_PREFIX}*")):
            detail = ("Shards are present without a manifest: a snapshot was interrupted "
                      "before it committed.")
        raise SnapshotNotFoundError(directory, detail) from None
    except OSError as exc:
        raise CheckpointPathError(
            path, f"cannot read {path}: {exc.strerror or exc}; check its permissions"
        ) from exc

    try:
        # The happy path parses once; only a refusal parses again, to say why.
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as bad_json:
            raise ManifestInvalidError(
                path, f"{path} is not valid JSON ({bad_json}); the file is damaged: "
                      f"restore an earlier checkpoint"
            ) from exc
        upgraded = upgrade_v1(data)
        if upgraded is not data:
            try:
                manifest = Manifest.model_validate_json(json.dumps(upgraded))
            except ValidationError as v1_exc:
                exc = v1_exc
            else:
                return _check_shard_names(path, directory, manifest)
        version = data.get("format_version") if isinstance(data, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) \
                and version not in SUPPORTED_FORMAT_VERSIONS:
            raise UnsupportedFormatVersionError(
                path, f"{path} has format version {version}, but this nemo-ckpt reads only "
                      f"{sorted(SUPPORTED_FORMAT_VERSIONS)}; restore with the nemo-ckpt "
                      f"version that wrote it, or a newer one"
            ) from exc
        raise ManifestInvalidError(
            path, f"{path} does not validate as a nemo-ckpt manifest: {exc}; the file is "
                  f"damaged or not ours: restore an earlier checkpoint"
        ) from exc
    return _check_shard_names(path, directory, manifest)


def _check_shard_names(path: Path, directory: Path, manifest: Manifest) -> Manifest:
    for shard in manifest.shards:
        if not is_plain_file_name(shard.file):
            raise UnsafeShardNameError(
                path, f"{path} names shard {shard.file!r}, which is not a plain file name "
                      f"in {directory}; refusing to read outside the snapshot folder. The "
                      f"manifest was tampered with or damaged: restore an earlier checkpoint"
            )
    return manifest


@dataclass(frozen=True)
class ShardParts:
    """A verified shard's sessions, still encoded: each one's decoded row
    (``[rollout_id, attempt, staging keys, turns, earlier capture keys]``), its turns
    blob and its state, in the shard's order."""

    instance_id: str
    rows: list[list[Any]]
    turns: list[bytes]
    states: list[bytes]

    def records(self) -> list[SessionRecord]:
        """Every session as a ``SessionRecord`` (decodes every turns blob)."""
        return [record_of(self.instance_id, row, turns, state)
                for row, turns, state in zip(self.rows, self.turns, self.states, strict=True)]


def read_shard(directory: Path, entry: ShardEntry) -> list[SessionRecord]:
    """Read and verify one shard (``read_shard_parts``), every session decoded."""
    parts = read_shard_parts(directory, entry)
    path = directory / entry.file
    try:
        return parts.records()
    except ValueError as exc:
        raise _undecodable(path, str(exc)) from exc


def read_shard_parts(directory: Path, entry: ShardEntry) -> ShardParts:
    """Read one shard and verify its length and hash, then split it into sessions.

    Nothing is decoded before the whole file's hash matches the manifest's: a damaged
    or crafted file of N bytes costs N bytes of memory, never the objects it could
    unpack into. Then only the index is decoded; each session's turns are a slice of
    the file and its state one bytes object.
    Shards of the older layout (a map per session) are read too.
    """
    path, data = _read_verified(directory, entry)
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False,
                                max_buffer_size=max(len(data), 1 << 20))
    try:
        header = unpacker.unpack()
        if not isinstance(header, dict) or header.get("format") != SHARD_MAGIC:
            raise _undecodable(path, "no nemo-ckpt shard header")
        if header.get("instance_id") != entry.instance_id:
            raise _undecodable(path, f"header {header!r} does not fit the manifest entry "
                                     f"for {entry.instance_id}")
        if header.get("version") == 1:
            return _legacy_parts(path, entry, unpacker, len(data))
        if header.get("version") != SHARD_VERSION:
            raise _undecodable(path, f"shard layout {header.get('version')!r} is not one "
                                     f"this nemo-ckpt reads")
        rows = unpacker.unpack()
        if not isinstance(rows, list) or len(rows) != entry.sessions \
                or header.get("sessions") != entry.sessions:
            raise _undecodable(path, f"its index does not hold the {entry.sessions} "
                                     f"sessions the manifest says")
        turns, states = [], []
        read_array_header, skip, tell, unpack = (unpacker.read_array_header, unpacker.skip,
                                                 unpacker.tell, unpacker.unpack)
        for _ in range(entry.sessions):
            if read_array_header() != 2:
                raise _undecodable(path, "a session's body is not [turns, state]")
            start = tell()
            skip()
            turns.append(data[start:tell()])
            states.append(unpack())
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise _undecodable(path, str(exc) or type(exc).__name__) from exc
    if unpacker.tell() != len(data):
        raise _undecodable(path, f"{len(data) - unpacker.tell()} trailing bytes")
    if any(type(state) is not bytes for state in states):
        raise _undecodable(path, "a session's state is not bytes")
    return ShardParts(entry.instance_id, rows, turns, states)


def _legacy_parts(path: Path, entry: ShardEntry, unpacker: msgpack.Unpacker,
                  length: int) -> ShardParts:
    """The sessions of a layout-1 shard (one map per session), as parts."""
    rows: list[list[Any]] = []
    turns: list[bytes] = []
    states: list[bytes] = []
    for obj in unpacker:
        try:
            record = SessionRecord.from_wire(obj)
        except ValueError as exc:
            raise _undecodable(path, str(exc)) from exc
        if record.instance_id != entry.instance_id:
            raise _undecodable(path, f"session of {record.instance_id} in a shard of "
                                     f"{entry.instance_id}")
        row, turns_blob, state = record_parts(record)
        rows.append(msgpack.unpackb(row, raw=False, use_list=True))
        turns.append(turns_blob)
        states.append(state)
    if unpacker.tell() != length:
        raise _undecodable(path, f"{length - unpacker.tell()} trailing bytes do not decode")
    if len(rows) != entry.sessions:
        raise _undecodable(path, f"{len(rows)} sessions, manifest says {entry.sessions}")
    return ShardParts(entry.instance_id, rows, turns, states)


def _undecodable(path: Path, why: str) -> ShardCorruptedError:
    return ShardCorruptedError(
        path, f"shard {path} matches its hash but does not decode ({why}); it was "
              f"written by a different tool: restore an earlier checkpoint")


def _read_verified(directory: Path, entry: ShardEntry) -> tuple[Path, bytes]:
    """The bytes of shard ``entry``, once their length and hash match the manifest."""
    if not is_plain_file_name(entry.file):
        raise UnsafeShardNameError(
            directory, f"shard name {entry.file!r} is not a plain file name in {directory}"
        )
    path = directory / entry.file
    algorithm, expected = _split_hash(entry.content_hash)
    digest = content_hasher(algorithm)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry.bytes:
                raise ShardCorruptedError(
                    path, f"shard {path} is {size} bytes, but the manifest says "
                          f"{entry.bytes}: it was truncated or overwritten; restore an "
                          f"earlier checkpoint"
                )
            data = f.read(entry.bytes + 1)
    except FileNotFoundError:
        raise TornSnapshotError(
            path, f"shard {path}, named in the manifest, is missing: the snapshot is torn "
                  f"(files were removed or not copied); restore an earlier checkpoint or "
                  f"copy the whole {directory} again"
        ) from None
    except OSError as exc:
        raise CheckpointPathError(
            path, f"cannot read shard {path}: {exc.strerror or exc}; check its permissions"
        ) from exc
    digest.update(data)
    if len(data) != entry.bytes or digest.hexdigest() != expected:
        raise ShardCorruptedError(
            path, f"shard {path} has {algorithm} {digest.hexdigest()}, but the manifest says "
                  f"{expected}: its content changed after the snapshot; restore an "
                  f"earlier checkpoint"
        )
    return path, data


@dataclass(frozen=True)
class LoadedSnapshot:
    """A snapshot read and fully verified: its manifest and every session, by instance."""

    manifest: Manifest
    sessions: dict[str, list[SessionRecord]]


def read_snapshot(checkpoint_path: Path | str) -> LoadedSnapshot:
    """Read and verify the whole snapshot at ``checkpoint_path``.

    Every instance listed in the manifest appears in ``sessions``, holding nothing or
    not. Raises a ``SnapshotReadError`` subclass on the first refusal.
    """
    manifest = read_manifest(checkpoint_path)
    directory = environment_dir(checkpoint_path)
    sessions: dict[str, list[SessionRecord]] = {i: [] for i in manifest.instances}
    listed = rollouts_by_shard(manifest)
    seen: dict[str, str] = {}  # rollout id -> the shard that holds it
    for shard in manifest.shards:
        records = read_shard(directory, shard)
        where = str(directory / shard.file)
        pairs = [(r.episode.rollout_id, r.episode.attempt) for r in records]
        problems = shard_problems(None if listed is None else listed.get(shard.file, {}),
                                  pairs, where)
        problems += [f"rollout {rid!r} is in two shards, {seen[rid]} and {shard.file}; "
                     f"restore an earlier checkpoint" for rid, _ in pairs if rid in seen]
        if problems:
            raise ShardCorruptedError(directory / shard.file, "; ".join(problems))
        seen.update((rid, shard.file) for rid, _ in pairs)
        sessions[shard.instance_id] += records
    return LoadedSnapshot(manifest=manifest, sessions=sessions)


class RolloutIndexEntry(NamedTuple):
    """One captured rollout, as a shard's index (or a format-2 manifest) lists it."""

    instance_id: str
    rollout_id: str
    attempt: int
    turns: int
    staging_keys: list[str]
    shard: str


def read_shard_index(directory: Path, entry: ShardEntry) -> list[RolloutIndexEntry]:
    """The rollouts a shard's index lists, read without its payloads and without
    verifying its hash (``inspect`` and ``diff``; a restore and ``verify`` verify)."""
    path = directory / entry.file
    if not is_plain_file_name(entry.file):
        raise UnsafeShardNameError(
            directory, f"shard name {entry.file!r} is not a plain file name in {directory}")
    try:
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=max(entry.bytes, 1 << 20))
            header = unpacker.unpack()
            if not isinstance(header, dict) or header.get("format") != SHARD_MAGIC:
                raise _undecodable(path, "no nemo-ckpt shard header")
            if header.get("version") == 1:  # no index: every session has to be read
                f.seek(0)
                rows = read_shard_parts(directory, entry).rows
            else:
                rows = unpacker.unpack()
    except FileNotFoundError:
        raise TornSnapshotError(path, f"shard {path}, named in the manifest, is missing"
                                ) from None
    except OSError as exc:
        raise CheckpointPathError(path, f"cannot read shard {path}: {exc.strerror or exc}"
                                  ) from exc
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise _undecodable(path, str(exc) or type(exc).__name__) from exc
    try:
        return [RolloutIndexEntry(entry.instance_id, row[0], row[1], row[3], list(row[2]),
                                  entry.file) for row in rows]
    except (TypeError, IndexError) as exc:
        raise _undecodable(path, f"its index has rows of the wrong shape ({exc})") from exc


def snapshot_rollouts(checkpoint_path: Path | str, manifest: Manifest
                      ) -> tuple[list[RolloutIndexEntry], dict[str, str]]:
    """Every captured rollout of a snapshot, and the shards whose index could not be
    read (file -> why). A format-2 manifest lists them itself; a format-3 snapshot keeps
    them in its shards' indexes, read here without the payloads."""
    if manifest.format_version < 3:
        return [RolloutIndexEntry(r.instance_id, r.rollout_id, r.attempt, r.turns,
                                  list(r.staging_keys), r.shard) for r in manifest.rollouts], {}
    directory = environment_dir(checkpoint_path)
    rollouts: list[RolloutIndexEntry] = []
    unreadable: dict[str, str] = {}
    for shard in manifest.shards:
        try:
            rollouts += read_shard_index(directory, shard)
        except SnapshotReadError as exc:
            unreadable[shard.file] = str(exc)
    return rollouts, unreadable


def _operation_stem(operation_id: str) -> str:
    """The prefix of every shard name of ``operation_id`` (temp files add a dot)."""
    return shard_file_name(operation_id, "x").rsplit("-x-", 1)[0] + "-"


_SNAPSHOT_ID = re.compile(rb'"snapshot_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


def manifest_snapshot_id(directory: Path) -> str | None:
    """The snapshot id of the manifest in ``directory`` (the environment folder), None
    if there is none. Reads only the manifest's head, where the id sits."""
    try:
        with open(directory / MANIFEST_NAME, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        return None
    match = _SNAPSHOT_ID.search(head)
    if match is not None:
        return str(json.loads(b'"' + match.group(1) + b'"'))
    try:
        return str(json.loads((directory / MANIFEST_NAME).read_bytes())["snapshot_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_snapshot_files(directory: Path, snapshot_id: str) -> bool:
    """Remove every shard, temp file and claim of snapshot ``snapshot_id`` (aborted),
    unless the manifest here names it: committed is final. Returns whether it is the
    committed snapshot (then nothing is removed but its claim)."""
    if not directory.is_dir():
        return False
    if manifest_snapshot_id(directory) == snapshot_id:
        release_claim(directory, snapshot_id)
        return True
    stem = _operation_stem(snapshot_id)
    for entry in directory.iterdir():
        name = entry.name
        if name.startswith(stem) or (name.startswith("." + stem) and _TMP_MARK in name):
            entry.unlink(missing_ok=True)
    release_claim(directory, snapshot_id)
    return False
