"""A snapshot in its folder: the manifest, written last as the commit point and read
first, and the whole snapshot read and verified.

The manifest is written last, so a folder without one holds no snapshot, whatever shards
it has. Reading verifies before it returns: the manifest's version and schema, every
shard name, then every shard (``nemo_ckpt.storage.shards``) against the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from nemo_ckpt.errors import (
    CheckpointPathBusyError,
    CheckpointPathError,
    ManifestInvalidError,
    OperationAbortedError,
    ShardCorruptedError,
    SnapshotNotFoundError,
    SnapshotReadError,
    UnsafeShardNameError,
    UnsupportedFormatVersionError,
)
from nemo_ckpt.session_record import SessionRecord
from nemo_ckpt.storage.checkpoint_folder import as_folder, environment_folder, folder_at
from nemo_ckpt.storage.folder import Folder, write_conditionally
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.storage.manifest import (
    BLOB_DIR,
    ENVIRONMENT_DIR,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    SUPPORTED_FORMAT_VERSIONS,
    Manifest,
    is_plain_file_name,
    rollouts_by_shard,
    upgrade_v1,
)
from nemo_ckpt.storage.names import SHARD_PREFIX
from nemo_ckpt.storage.path_claims import claim_of
from nemo_ckpt.storage.shards import (
    RolloutIndexEntry,
    read_shard,
    read_shard_index,
    shard_problems,
)
from nemo_ckpt.storage.stored_json import StoredJsonError, check_json, load_stored_json

__all__ = ["LoadedSnapshot", "committed_snapshots", "holds_manifest", "read_manifest",
           "read_snapshot", "snapshot_rollouts", "write_manifest"]

# The manifest each job (claim owner) last committed in each folder from this
# coordinator incarnation (its process): what its next snapshot there may replace besides
# the one it found when it claimed. Keyed by incarnation too, so a zombie never takes a
# successor's commit for its own (simulation seed 31274, where incarnations share a
# process).
_COMMITTED: dict[tuple[str, str, str], str] = {}
_MAX_COMMITTED = 1024
_MAX_DEPTH = 8  # how deep below a root snapshots are looked for


def write_manifest(directory: Folder | Path, manifest: Manifest | bytes,
                   fence: tuple[str, Collection[str]] | None = None) -> None:
    """Commit the snapshot: write ``manifest.json`` durably. Call it after every shard.

    ``manifest`` is a ``Manifest`` or its JSON from ``encode_manifest``. ``fence``,
    ``(operation id, beats)``: first require the operation's claim to hold one of the
    beats its writer wrote, or raise ``OperationAbortedError``: a coordinator taken for
    dead that runs again finds its claim removed by its successor's abort. Checked here,
    in the same call as the write, so a stall cannot fall between them on the caller's
    side. Where the folder enforces conditional writes, the manifest replaces only the
    one the claim recorded when the operation began (``nemo_ckpt.storage.path_claims``): another
    writer's commit since then refuses this one with ``CheckpointPathBusyError``."""
    folder = as_folder(directory)
    expect: str | None = None
    owner = incarnation = ""
    if fence is not None:
        operation_id, beats = fence
        claim = claim_of(folder, operation_id)
        if claim is None or claim.beat not in beats:
            raise OperationAbortedError(
                f"{operation_id} was aborted by another coordinator of this job while this "
                f"one was taken for dead (its node stalled?); it was not committed")
        expect, owner, incarnation = claim.base, claim.owner, claim.incarnation
    # Compact: it is written while the holders are paused; `nemo-ckpt inspect` reads it.
    data = manifest if isinstance(manifest, bytes) else manifest.model_dump_json().encode()
    committed = (folder.describe(), owner, incarnation)

    def write(expect: str | None) -> None:
        if expect is None:
            folder.write_bytes(MANIFEST_NAME, data)
        else:  # a retry of a write that landed finds its own manifest there
            write_conditionally(folder, MANIFEST_NAME, data, expect)

    try:
        try:
            write(expect)
        except FileExistsError:
            # This job's own earlier snapshot, committed since this one claimed the
            # folder (commits of a job are ordered), may be replaced.
            current = folder.version(MANIFEST_NAME)
            if current is None or _COMMITTED.get(committed) != current:
                raise
            write(current)
    except FileExistsError:
        raise CheckpointPathBusyError(
            f"{folder.describe(MANIFEST_NAME)} was replaced by another writer since this "
            f"snapshot began, so it was not committed: two jobs must not write snapshots "
            f"into one checkpoint path; give each job its own path") from None
    if expect is not None:
        version = folder.version(MANIFEST_NAME)
        if version is not None:
            _COMMITTED.pop(committed, None)
            _COMMITTED[committed] = version
            if len(_COMMITTED) > _MAX_COMMITTED:
                _COMMITTED.pop(next(iter(_COMMITTED)))


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
        raw = folder.read(MANIFEST_NAME, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        detail = ""
        if any(name.startswith(SHARD_PREFIX) for name in folder.names()):
            detail = ("Shards are present without a manifest: a snapshot was interrupted "
                      "before it committed.")
        raise SnapshotNotFoundError(folder.describe(), detail) from None
    except OSError as exc:
        raise CheckpointPathError(
            path, f"cannot read {path}: {exc.strerror or exc}"
        ) from exc

    try:
        text = check_json(raw, path, MAX_MANIFEST_BYTES)
    except StoredJsonError as exc:  # too large, not UTF-8, or nested too deeply
        raise ManifestInvalidError(path, f"{exc}: restore an earlier checkpoint") from None
    try:
        # The happy path parses once; only a refusal parses again, to say why.
        manifest = Manifest.model_validate_json(text)
    except ValidationError as exc:
        try:
            data = load_stored_json(text, path, MAX_MANIFEST_BYTES)
        except StoredJsonError as bad_json:
            raise ManifestInvalidError(path, f"{bad_json}: restore an earlier checkpoint"
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


def holds_manifest(where: str, subfolders: list[str]) -> bool:
    """Whether the folder ``where`` (whose subfolders are ``subfolders``) is a committed
    snapshot: its ``environment/`` holds a manifest."""
    return ENVIRONMENT_DIR in subfolders and \
        MANIFEST_NAME in folder_at(join_location(where, ENVIRONMENT_DIR)).names()


def committed_snapshots(root: str | Path) -> list[str]:
    """Every checkpoint path below ``root`` that holds a committed snapshot (a manifest),
    sorted; the blob store and hidden folders are not searched."""
    found: list[str] = []
    pending = [(str(root), 0)]
    while pending:
        where, depth = pending.pop()
        folder = folder_at(where)
        names = folder.subfolders()
        if holds_manifest(where, names):
            found.append(where)
            continue
        if depth >= _MAX_DEPTH:
            continue
        for name in names:
            if name.startswith(".") or (depth == 0 and name == BLOB_DIR):
                continue
            pending.append((join_location(where, name), depth + 1))
    return sorted(found)
