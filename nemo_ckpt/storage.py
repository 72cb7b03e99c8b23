"""Writing and reading snapshot files under ``<checkpoint_path>/environment/``.

Files go through a ``Folder`` (``nemo_ckpt.folder``; on a filesystem,
``nemo_ckpt.local_folder``), which makes each appear whole once durable, or not at
all. The content hash is computed while writing, never by reading the file back. The
manifest is written last, so a folder without one holds no snapshot, whatever shards
it has.

Reading verifies before it returns: the manifest's version and schema, every shard
name, every shard's length and hash, then what each shard holds against the manifest.
A shard is decoded only once its hash matches, so a crafted or damaged file costs at
most its own length in memory. Each refusal has its own exception class (see
``nemo_ckpt.errors``), and a refused read changes nothing on disk.

Committed is final: a file the manifest at a path names is never removed by anything
here until a newer manifest replaces it. Operations in progress hold a *claim* on the
folder (``.claim-<operation>.json``: its owner, a ttl and a beat it renews, judged on
the reader's own clock: ``nemo_ckpt.claims``), so that a commit's clean-up leaves
another operation's files alone and a second job's snapshot into the same folder is
refused instead of cleaned away.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import xxhash
from pydantic import ValidationError

from nemo_ckpt.claims import Claim, ClaimWatch, decode_claim, encode_claim
from nemo_ckpt.errors import (
    CheckpointPathBusyError,
    CheckpointPathError,
    ManifestInvalidError,
    OperationAbortedError,
    ShardCorruptedError,
    SnapshotNotFoundError,
    SnapshotReadError,
    TornSnapshotError,
    UnsafeShardNameError,
    UnsupportedFormatVersionError,
)
from nemo_ckpt.folder import Folder, Sink
from nemo_ckpt.local_folder import TMP_MARK, LocalFolder
from nemo_ckpt.location import ObjectLocation, parse_location
from nemo_ckpt.manifest import (
    ENVIRONMENT_DIR,
    MANIFEST_NAME,
    SHARD_PREFIX,
    SHARD_SUFFIX,
    SUPPORTED_FORMAT_VERSIONS,
    Manifest,
    ShardEntry,
    TreesEntry,
    is_plain_file_name,
    load_json,
    rollouts_by_shard,
    safe_name_part,
    shard_file_name,
    shard_problems,
    upgrade_v1,
)
from nemo_ckpt.sessions import SessionRecord, body_head, record_of, record_parts

__all__ = [
    "environment_dir",
    "environment_folder",
    "folder_at",
    "as_folder",
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
    "claim_beat",
    "LoadedSnapshot",
    "CONTENT_HASH",
    "content_hasher",
    "write_hashed",
    "read_verified",
    "view_unpacker",
]

SHARD_MAGIC = "nemo-ckpt-shard"
# Shard layouts: 3 (written): a header, the index (one row per session), then one
# payload per session (``nemo_ckpt.sessions``); 1 (read): a header, then one map per
# session (manifest formats 1 and 2).
SHARD_VERSION = 3
# Pieces of a shard's small sessions are joined into about this much before they go to
# the folder's sink; a state at least _DIRECT_WRITE long goes by reference, uncopied.
_DIRECT_WRITE = 16 << 10
_SMALL_PIECE_BUFFER = 256 << 10
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


# Where check_startup's probes go, under the checkpoint root.
PROBE_DIR = ".nemo_ckpt_probe"


def folder_at(where: Path | str) -> Folder:
    """The ``Folder`` at a path or URL (``nemo_ckpt.location``)."""
    location = parse_location(where)
    if isinstance(location, ObjectLocation):
        from nemo_ckpt.object_folder import ObjectFolder  # obstore only when used

        return ObjectFolder(location)
    return LocalFolder(location.path)


def environment_folder(checkpoint_path: Path | str) -> Folder:
    """The ``Folder`` that holds the environment's half of a checkpoint."""
    location = parse_location(checkpoint_path)
    if isinstance(location, ObjectLocation):
        from nemo_ckpt.object_folder import ObjectFolder

        prefix = f"{location.prefix}/{ENVIRONMENT_DIR}" if location.prefix else ENVIRONMENT_DIR
        return ObjectFolder(ObjectLocation(location.scheme, location.bucket, prefix))
    return LocalFolder(environment_dir(location.path))


def as_folder(directory: Folder | Path | str) -> Folder:
    """``directory`` as a ``Folder``: a path is a local folder, a URL a bucket's prefix."""
    if isinstance(directory, (Path, str)):
        return folder_at(directory)
    return directory


# --- writing -------------------------------------------------------------------------


class _HashingSink:
    """Hashes every byte on its way to the folder, in the order written."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self.hash = content_hasher()

    def write(self, data: bytes | bytearray | memoryview, copy: bool = False) -> None:
        self.hash.update(data)
        self._sink.write(data, copy)


def _write_durably(directory: Folder | Path, name: str,
                   fill: Callable[[Sink], None]) -> tuple[int, str]:
    """Write ``name`` in ``directory`` through ``fill(sink)``; return (length, content
    hash as ``<algorithm>:<hex>``). The hash is computed while writing, never by reading
    the file back. The file appears under its name only once complete and durable; on
    any failure nothing stays and ``SnapshotWriteError`` says where and why."""
    if not is_plain_file_name(name):
        raise ValueError(f"{name!r} is not a plain file name")
    hashing: list[_HashingSink] = []

    def hashed_fill(sink: Sink) -> None:
        hashing.append(_HashingSink(sink))
        fill(hashing[0])

    length = as_folder(directory).write_stream(name, hashed_fill)
    return length, f"{CONTENT_HASH}:{hashing[0].hash.hexdigest()}"


def prepare_environment_dir(checkpoint_path: Path | str) -> Path:
    """Create ``<checkpoint_path>/environment`` if needed and return it."""
    folder = LocalFolder(environment_dir(checkpoint_path))
    folder.prepare()
    return folder.path


def write_shard(
    directory: Folder | Path, name: str, instance_id: str, sessions: Iterable[SessionRecord]
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


def write_shard_parts(directory: Folder | Path, name: str, instance_id: str, index: bytes,
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

    def fill(w: Sink) -> None:
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


def write_manifest(directory: Folder | Path, manifest: Manifest | bytes,
                   fence: tuple[str, Collection[str]] | None = None) -> None:
    """Commit the snapshot: write ``manifest.json`` durably. Call it after every shard.

    ``manifest`` is a ``Manifest`` or its JSON from ``encode_manifest``. ``fence``,
    ``(operation id, beats)``: first require the operation's claim to hold one of the
    beats its writer wrote, or raise ``OperationAbortedError``: a coordinator taken for
    dead that runs again finds its claim removed by its successor's abort. Checked here,
    in the same call as the write, so a stall cannot fall between them on the caller's
    side; a folder offers no conditional rename to close the rest (a bucket's
    conditional writes would)."""
    folder = as_folder(directory)
    if fence is not None:
        operation_id, beats = fence
        if claim_beat(folder, operation_id) not in beats:
            raise OperationAbortedError(
                f"{operation_id} was aborted by another coordinator of this job while this "
                f"one was taken for dead (its node stalled?); it was not committed")
    # Compact: it is written while the holders are paused; `nemo-ckpt inspect` reads it.
    data = manifest if isinstance(manifest, bytes) else manifest.model_dump_json().encode()
    folder.write_bytes(MANIFEST_NAME, data)


def remove_files(directory: Folder | Path, names: Iterable[str]) -> None:
    """Remove the named plain files from ``directory``; missing ones are fine."""
    as_folder(directory).remove([name for name in names if is_plain_file_name(name)])


def manifest_shard_files(directory: Folder | Path) -> set[str]:
    """The shard files the manifest in ``directory`` names now (none without one)."""
    folder = as_folder(directory)
    try:
        data = load_json(folder.read(MANIFEST_NAME))
        files = {str(s["file"]) for s in data["shards"]}
        return files | {str(s["trees"]["file"]) for s in data["shards"] if s.get("trees")}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # A manifest that does not parse protects nothing we can name: remove nothing.
        where = folder.describe(MANIFEST_NAME)
        raise CheckpointPathError(
            where, f"cannot read the shard list of {where} ({exc}); nothing was removed"
        ) from exc


def _is_ours(name: str) -> bool:
    """A shard or a temp file: the only files clean-up touches."""
    return (name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)) or (
        name.startswith(".") and TMP_MARK in name)


def remove_unreferenced_files(directory: Folder | Path,
                              protect: Collection[str] = ()) -> list[str]:
    """After a commit, remove shards and temp files that the manifest here now does not
    name: an older snapshot's that a newer one replaced, or an aborted one's.

    What the manifest names is read here, not passed in, so a clean-up that runs late
    never removes a newer commit's files. Files of the operations in ``protect`` (in
    progress here: see ``live_claims``) stay too, and only files whose names nemo-ckpt
    makes are touched. Returns the names removed.
    """
    folder = as_folder(directory)
    keep = manifest_shard_files(folder)
    stems = [_operation_stem(op) for op in protect]
    removed = [name for name in folder.names()
               if _is_ours(name) and name not in keep
               and not any(name.lstrip(".").startswith(s) for s in stems)]
    folder.remove(removed)
    return removed


# --- claims of operations in progress -----------------------------------------------

CLAIM_PREFIX = ".claim-"
# An operation in progress in a checkpoint folder (``nemo_ckpt.claims``).
PathClaim = Claim


def _claim_name(operation_id: str) -> str:
    return f"{CLAIM_PREFIX}{safe_name_part(operation_id)}.json"


def read_claims(directory: Folder | Path) -> list[PathClaim]:
    """Every claim in ``directory`` (one gone since the listing, or not a claim at all,
    is skipped). A claim that cannot be read raises ``CheckpointPathError``: skipped, it
    could let a clean-up remove the files of the operation it protects."""
    folder = as_folder(directory)
    claims: list[PathClaim] = []
    for name in folder.names():
        if not (name.startswith(CLAIM_PREFIX) and name.endswith(".json")):
            continue
        try:
            data = folder.read(name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            where = folder.describe(name)
            raise CheckpointPathError(where, f"cannot read the claim {where}: "
                                             f"{exc.strerror or exc}") from exc
        try:
            claims.append(decode_claim(data))
        except (ValueError, KeyError, TypeError):
            continue
    return claims


def live_claims(directory: Folder | Path, owner: str, watch: ClaimWatch,
                ours: Collection[str], incarnation: str = "") -> set[str]:
    """The operations whose files must stay: ``ours`` (this incarnation's operations
    open now), and every other claim ``watch`` has not seen unchanged for its ttl:
    another owner's, or one of this owner's other incarnations (Ray may have declared a
    coordinator dead that runs again; a successor's claims are not its leftovers). Only
    a claim of this very incarnation outside ``ours`` protects nothing: its operation
    ended here."""
    folder = as_folder(directory)
    claims = read_claims(folder)
    live = {c.operation for c in watch.live(folder.describe(), claims)}
    return {c.operation for c in claims
            if c.operation in ours or (c.operation in live and (
                c.owner != owner or not incarnation or c.incarnation != incarnation))}


def claim_beat(directory: Folder | Path, operation_id: str) -> str | None:
    """The beat of ``operation_id``'s claim as it is now, None when there is none."""
    folder = as_folder(directory)
    try:
        return decode_claim(folder.read(_claim_name(operation_id))).beat
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return ""  # not a claim any writer of ours made
    except OSError as exc:
        where = folder.describe(_claim_name(operation_id))
        raise CheckpointPathError(where, f"cannot read the claim {where}: "
                                         f"{exc.strerror or exc}") from exc


def claim_path(directory: Folder | Path, operation_id: str, owner: str, watch: ClaimWatch,
               ttl_s: float, incarnation: str = "", beat: str | None = None,
               renewing: Collection[str] | None = None) -> None:
    """Claim ``directory`` for ``operation_id`` for ``ttl_s`` seconds; calling it again
    renews the claim. Refuses with ``CheckpointPathBusyError`` while another owner's
    claim is live: one ``watch`` has not seen unchanged for its ttl (so a claim seen for
    the first time refuses; keep one watch per job). This owner's own operations need
    no refusal: its holders run one at a time, and clean-up spares the ones open.
    ``renewing``, the beats the caller wrote it with: a renewal, refused with
    ``OperationAbortedError`` when the claim is gone or another's (a successor that
    took the caller for dead aborted the operation: its claim must not come back)."""
    folder = as_folder(directory)
    found = read_claims(folder)
    if renewing is not None and not any(
            c.operation == operation_id and c.beat in renewing for c in found):
        raise OperationAbortedError(
            f"{operation_id} was aborted by another coordinator of this job while this one "
            f"was taken for dead (its node stalled?); its claim is not renewed")
    claims = [c for c in found if c.operation != operation_id]
    left = watch.observe(folder.describe(), claims)
    for claim in claims:
        if claim.owner != owner and left[claim.operation] > 0:
            raise CheckpointPathBusyError(
                f"{folder.describe()} is in use by {claim.operation} of {claim.owner}: two "
                f"jobs must not write snapshots into one checkpoint path; give each job "
                f"its own path (a claim whose job died is taken as abandoned once this "
                f"job has seen it unchanged for {left[claim.operation]:.0f}s more)")
    data, _ = encode_claim(operation_id, owner, ttl_s, incarnation, beat)
    folder.write_bytes(_claim_name(operation_id), data, sync=False)


def release_claim(directory: Folder | Path, operation_id: str) -> None:
    """Drop the claim of ``operation_id``, if any."""
    as_folder(directory).remove([_claim_name(operation_id)])


# --- reading -------------------------------------------------------------------------


def read_manifest(checkpoint_path: Path | str) -> Manifest:
    """Read and validate the manifest of the snapshot at ``checkpoint_path``.

    Raises one of ``SnapshotNotFoundError``, ``CheckpointPathError``,
    ``UnsupportedFormatVersionError``, ``ManifestInvalidError`` or
    ``UnsafeShardNameError``. Shards are not read; see ``read_snapshot``.
    """
    folder = environment_folder(checkpoint_path)
    problem = folder.problem()
    if problem is not None:
        raise CheckpointPathError(
            folder.describe(), f"checkpoint path {checkpoint_path} cannot hold a snapshot: "
                               f"{problem}; pass the folder that snapshot() was given (the "
                               f"one holding {ENVIRONMENT_DIR}/)")
    path = folder.describe(MANIFEST_NAME)
    try:
        raw = folder.read(MANIFEST_NAME)
    except FileNotFoundError:
        detail = ""
        if any(name.startswith(SHARD_PREFIX) for name in folder.names()):
            detail = ("Shards are present without a manifest: a snapshot was interrupted "
                      "before it committed.")
        raise SnapshotNotFoundError(folder.describe(), detail) from None
    except OSError as exc:
        raise CheckpointPathError(
            path, f"cannot read {path}: {exc.strerror or exc}; check its permissions"
        ) from exc

    try:
        # The happy path parses once; only a refusal parses again, to say why.
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        try:
            data = load_json(raw)
        except ValueError as bad_json:  # not JSON, not UTF-8, or nested too deeply
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
                return _check_shard_names(path, folder, manifest)
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
    return _check_shard_names(path, folder, manifest)


def _check_shard_names(path: str, folder: Folder, manifest: Manifest) -> Manifest:
    for shard in manifest.shards:
        for name in (shard.file, shard.trees.file if shard.trees else shard.file):
            if not is_plain_file_name(name):
                raise UnsafeShardNameError(
                    path, f"{path} names shard {name!r}, which is not a plain file name "
                          f"in {folder.describe()}; refusing to read outside the snapshot "
                          f"folder. The manifest was tampered with or damaged: restore an "
                          f"earlier checkpoint")
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


def read_shard(directory: Folder | Path, entry: ShardEntry) -> list[SessionRecord]:
    """Read and verify one shard (``read_shard_parts``), every session decoded."""
    parts = read_shard_parts(directory, entry)
    path = as_folder(directory).describe(entry.file)
    try:
        return parts.records()
    except ValueError as exc:
        raise _undecodable(path, str(exc)) from exc


def read_shard_parts(directory: Folder | Path, entry: ShardEntry) -> ShardParts:
    """Read one shard and verify its length and hash, then split it into sessions.

    Nothing is decoded before the whole file's hash matches the manifest's: a damaged
    or crafted file of N bytes costs N bytes of memory, never the objects it could
    unpack into. Then only the index is decoded; each session's turns are a slice of
    the file and its state one bytes object.
    Shards of the older layout (a map per session) are read too.
    """
    path, data = _read_verified(directory, entry)
    unpacker = view_unpacker(data)
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
            turns.append(bytes(data[start:tell()]))
            states.append(unpack())
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise _undecodable(path, str(exc) or type(exc).__name__) from exc
    if unpacker.tell() != len(data):
        raise _undecodable(path, f"{len(data) - unpacker.tell()} trailing bytes")
    if any(type(state) is not bytes for state in states):
        raise _undecodable(path, "a session's state is not bytes")
    return ShardParts(entry.instance_id, rows, turns, states)


def _legacy_parts(path: str, entry: ShardEntry, unpacker: msgpack.Unpacker,
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


def _undecodable(path: str, why: str) -> ShardCorruptedError:
    return ShardCorruptedError(
        path, f"shard {path} matches its hash but does not decode ({why}); it was "
              f"written by a different tool: restore an earlier checkpoint")


# How much of a shard's view the unpacker copies in at a time: its buffer, reused.
_UNPACK_READ_BYTES = 1 << 20


def view_unpacker(view: memoryview) -> msgpack.Unpacker:
    """A ``msgpack.Unpacker`` over a verified file's view, copying in only what it
    decodes next (``io.BytesIO`` of a view copies all of it); an object may be as large
    as the file."""
    return msgpack.Unpacker(_ViewReader(view), raw=False, read_size=_UNPACK_READ_BYTES,
                            max_buffer_size=max(len(view), 1 << 20))


class _ViewReader:
    """A read-only file over a view."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._at = 0

    def read(self, size: int = -1) -> bytes:
        start = self._at
        end = len(self._view) if size is None or size < 0 else min(len(self._view),
                                                                     start + size)
        self._at = end
        return bytes(self._view[start:end])


def _read_verified(directory: Folder | Path, entry: ShardEntry | TreesEntry
                   ) -> tuple[str, memoryview]:
    """The bytes of shard ``entry``, once their length and hash match the manifest: a
    view of the buffer they were read into (``view_unpacker`` decodes it)."""
    folder = as_folder(directory)
    if not is_plain_file_name(entry.file):
        raise UnsafeShardNameError(
            folder.describe(), f"shard name {entry.file!r} is not a plain file name in "
                               f"{folder.describe()}")
    path = folder.describe(entry.file)
    algorithm, expected = _split_hash(entry.content_hash)
    digest = content_hasher(algorithm)
    try:
        # One request: a longer file shows as one byte too many (a bucket's HEAD first
        # would add a round trip to every shard); its true size only for the message.
        data = folder.read_view(entry.file, entry.bytes + 1)
        if len(data) != entry.bytes:
            size = folder.size(entry.file)
            raise ShardCorruptedError(
                path, f"shard {path} is {size} bytes, but the manifest says "
                      f"{entry.bytes}: it was truncated or overwritten; restore an "
                      f"earlier checkpoint"
            )
    except FileNotFoundError:
        raise TornSnapshotError(
            path, f"shard {path}, named in the manifest, is missing: the snapshot is torn "
                  f"(files were removed or not copied); restore an earlier checkpoint or "
                  f"copy the whole {folder.describe()} again"
        ) from None
    except OSError as exc:
        raise CheckpointPathError(
            path, f"cannot read shard {path}: {exc.strerror or exc}; check its permissions"
        ) from exc
    digest.update(data)
    if digest.hexdigest() != expected:
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
    directory = environment_folder(checkpoint_path)
    sessions: dict[str, list[SessionRecord]] = {i: [] for i in manifest.instances}
    listed = rollouts_by_shard(manifest)
    seen: dict[str, str] = {}  # rollout id -> the shard that holds it
    for shard in manifest.shards:
        records = read_shard(directory, shard)
        where = directory.describe(shard.file)
        pairs = [(r.episode.rollout_id, r.episode.attempt) for r in records]
        problems = shard_problems(None if listed is None else listed.get(shard.file, {}),
                                  pairs, where)
        problems += [f"rollout {rid!r} is in two shards, {seen[rid]} and {shard.file}; "
                     f"restore an earlier checkpoint" for rid, _ in pairs if rid in seen]
        if problems:
            raise ShardCorruptedError(where, "; ".join(problems))
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


def read_shard_index(directory: Folder | Path, entry: ShardEntry) -> list[RolloutIndexEntry]:
    """The rollouts a shard's index lists, read without its payloads and without
    verifying its hash (``inspect`` and ``diff``; a restore and ``verify`` verify)."""
    folder = as_folder(directory)
    path = folder.describe(entry.file)
    if not is_plain_file_name(entry.file):
        raise UnsafeShardNameError(
            folder.describe(), f"shard name {entry.file!r} is not a plain file name in "
                               f"{folder.describe()}")
    try:
        # The manifest's length is a claim: the buffer (and msgpack's largest array or
        # string, which it allocates as claimed) is bounded by what is there.
        limit = max(min(entry.bytes, folder.size(entry.file)), 1 << 20)
        with folder.open_read(entry.file) as f:
            unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=limit)
            header = unpacker.unpack()
            if not isinstance(header, dict) or header.get("format") != SHARD_MAGIC:
                raise _undecodable(path, "no nemo-ckpt shard header")
            if header.get("version") == 1:  # no index: every session has to be read
                rows = read_shard_parts(folder, entry).rows
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
    directory = environment_folder(checkpoint_path)
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


def manifest_snapshot_id(directory: Folder | Path) -> str | None:
    """The snapshot id of the manifest in ``directory`` (the environment folder), None
    if there is none. Reads only the manifest's head, where the id sits."""
    folder = as_folder(directory)
    try:
        head = folder.read(MANIFEST_NAME, 4096)
    except FileNotFoundError:
        return None
    match = _SNAPSHOT_ID.search(head)
    if match is not None:
        return str(json.loads(b'"' + match.group(1) + b'"'))
    try:
        return str(load_json(folder.read(MANIFEST_NAME))["snapshot_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_snapshot_files(directory: Folder | Path, snapshot_id: str) -> bool:
    """Remove every shard, temp file and claim of snapshot ``snapshot_id`` (aborted),
    unless the manifest here names it: committed is final. Returns whether it is the
    committed snapshot (then nothing is removed but its claim)."""
    folder = as_folder(directory)
    if manifest_snapshot_id(folder) == snapshot_id:
        release_claim(folder, snapshot_id)
        return True
    stem = _operation_stem(snapshot_id)
    folder.remove([name for name in folder.names()
                   if name.startswith(stem) or (name.startswith("." + stem) and TMP_MARK in name)])
    release_claim(folder, snapshot_id)
    return False


# For the other files a snapshot writes beside its shards (``nemo_ckpt.sandbox_storage``).
write_hashed = _write_durably
read_verified = _read_verified
