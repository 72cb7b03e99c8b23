"""The snapshot manifest: what one committed environment snapshot holds.

On disk::

    <checkpoint_path>/environment/manifest.json   # written last: present means complete
    <checkpoint_path>/environment/<shard files>   # msgpack, one or more per holder

The manifest is JSON, validated by the pydantic models below. It carries each shard's
byte length, content hash and session count, so a restore verifies every byte before it
installs anything.

Format versions: 6 (written for every snapshot) is 5's content (trees and finished
rollouts optional) plus, per shard, the hash of each of its fixed-size chunks
(``ShardChunks``), so a restore verifies and decodes a shard chunk by chunk while the rest
is still arriving; and, where a coordinator committed it, the snapshot's ``sequence``: its
place in its root's order of commits, by which ``nemo_ckpt.catalog.listing`` lists newest first,
since the committing hosts' clocks cannot be compared. Earlier releases refuse it by its
version. 5 (written, until 6, when a
shard holds finished, unacknowledged rollouts, ``nemo_ckpt.receipts``) is 3 or 4 plus, per
shard, how many of its sessions are finished (``ShardEntry.finished``); their index rows
carry a sixth element, ``true``, and their state slot holds the result. Earlier releases
refuse it by its version rather than continue a finished rollout. 4 (written, until 6,
when sessions own sandbox directories) is 3 plus, per shard, the file of its sessions'
directory trees (``TreesEntry``) and, once, where the blob store that holds their files
lies relative to the checkpoint path (``blob_store``). 3 lists no
rollouts: each shard holds its own index (one row per session, ``nemo_ckpt.storage.shards``),
so the manifest stays a few kilobytes at a million rollouts. 2 (still read) listed every
rollout and the shard that holds it, and named each shard's hash with its algorithm
(XXH3-128 by default); 1 (still read) carried a bare SHA-256 per shard, read as
``sha256:<hex>``.
"""

from __future__ import annotations

import functools
import json
import json.encoder
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import PurePosixPath, PureWindowsPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "current_figures",
    "MAX_MANIFEST_BYTES",
    "FORMAT_VERSION",
    "SANDBOX_FORMAT_VERSION",
    "RECEIPTS_FORMAT_VERSION",
    "TreesEntry",
    "CONTENT_HASH_PATTERN",
    "SUPPORTED_FORMAT_VERSIONS",
    "BLOB_DIR",
    "ENVIRONMENT_DIR",
    "MANIFEST_NAME",
    "ShardEntry",
    "ShardChunks",
    "MIN_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "RolloutEntry",
    "Manifest",
    "is_plain_file_name",
    "upgrade_v1",
    "check_consistency",
    "check_shards",
    "encode_manifest",
    "rollouts_by_shard",
]

# The version every snapshot is written as; the others name where a feature came in.
FORMAT_VERSION: Literal[6] = 6
SANDBOX_FORMAT_VERSION: Literal[4] = 4
RECEIPTS_FORMAT_VERSION: Literal[5] = 5
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2, 3, 4, 5, 6})
ENVIRONMENT_DIR = "environment"
MANIFEST_NAME = "manifest.json"
# The blob store's folder under a checkpoint root (``nemo_ckpt.trees.blob_store``).
BLOB_DIR = "blobs"
# The blob store relative to a checkpoint path: one or more "../", then the store's folder.
BLOB_STORE_PATTERN = rf"^(\.\./)+{BLOB_DIR}$"

# "<algorithm>:<hex digest>"; storage.content_hasher knows each algorithm.
CONTENT_HASH_PATTERN = r"^(xxh3-128:[0-9a-f]{32}|sha256:[0-9a-f]{64})$"
# A chunk's hash, in its shard's algorithm (format 6 writes xxh3-128).
CHUNK_HASH_PATTERN = r"^([0-9a-f]{32}|[0-9a-f]{64})$"
# The chunk sizes a manifest may claim: a reader allocates one chunk at a time.
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 64 << 20

# The most a manifest is read as (nemo_ckpt.storage.stored_json): formats 1 and 2 list
# every rollout, about 150 bytes each, so this is over a million; later formats are a
# few kilobytes.
MAX_MANIFEST_BYTES = 256 << 20

@functools.lru_cache(maxsize=4096)  # manifests and trees ask about the same names often
def is_plain_file_name(name: str) -> bool:
    """Whether ``name`` names a file directly inside its folder, on any platform."""
    if not name or name in (".", ".."):
        return False
    if "/" in name or "\\" in name or "\x00" in name:
        return False
    return PurePosixPath(name).name == name and PureWindowsPath(name).name == name


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class TreesEntry(_Model):
    """The directory trees of one shard's sessions (format 4): a file beside the shard."""

    file: str = Field(description="Plain file name inside the environment folder.")
    bytes: int = Field(ge=0, description="Exact byte length of the file.")
    content_hash: str = Field(pattern=CONTENT_HASH_PATTERN,
                              description="The file's hash as '<algorithm>:<hex digest>'.")
    sandboxes: int = Field(ge=0, description="How many of the shard's sessions own one.")
    blobs: int = Field(ge=0, description="Distinct blobs (files and trees) they reference.")
    new_blobs: int = Field(ge=0, description="Of those, how many this snapshot wrote.")
    new_blob_bytes: int = Field(ge=0, description="The bytes of the blobs it wrote.")


class ShardChunks(_Model):
    """Format 6: a shard's bytes cut into chunks of ``bytes`` each (the last one may be
    shorter), and each chunk's hash in the shard's ``content_hash`` algorithm."""

    bytes: int = Field(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES,
                       description="Every chunk's length but the last one's.")
    hashes: list[Annotated[str, Field(pattern=CHUNK_HASH_PATTERN)]] = Field(
        description="Each chunk's hex digest, in the file's order.")


class ShardEntry(_Model):
    """One shard file of the snapshot."""

    file: str = Field(description="Plain file name inside the environment folder.")
    bytes: int = Field(ge=0, description="Exact byte length of the file.")
    content_hash: str = Field(
        pattern=CONTENT_HASH_PATTERN,
        description="The file's hash as '<algorithm>:<hex digest>' (xxh3-128 or sha256).")
    instance_id: str = Field(min_length=1, description="The instance whose sessions it holds.")
    sessions: int = Field(ge=0, description="How many sessions it holds.")
    trees: TreesEntry | None = Field(
        None, description="Its sessions' directory trees (format 4), if any owns one.")
    finished: int | None = Field(
        None, ge=1, description="Format 5: how many of its sessions are finished rollouts "
                                "whose results RL has not acknowledged yet.")
    chunks: ShardChunks | None = Field(
        None, description="Format 6: the hash of each chunk of the file, checked before "
                          "the chunk is decoded.")

    @model_validator(mode="after")
    def _chunks_cover_the_file(self) -> ShardEntry:
        if self.chunks is not None:
            expected = -(-self.bytes // self.chunks.bytes)
            if len(self.chunks.hashes) != expected:
                raise ValueError(f"shard {self.file!r} of {self.bytes} bytes in chunks of "
                                 f"{self.chunks.bytes} has {expected} chunks, not "
                                 f"{len(self.chunks.hashes)}")
            digest = self.content_hash.partition(":")[2]
            if any(len(h) != len(digest) for h in self.chunks.hashes):
                raise ValueError(f"shard {self.file!r}: its chunks' hashes are not in its "
                                 f"content hash's algorithm")
        return self


class RolloutEntry(_Model):
    """One captured rollout: where it lives and what it references."""

    instance_id: str = Field(min_length=1, description="The instance that captured it.")
    rollout_id: str = Field(min_length=1, description="The rollout's base id.")
    attempt: int = Field(ge=0, description="The attempt that was captured.")
    turns: int = Field(ge=0, description="Turns committed when it was captured.")
    staging_keys: list[str] = Field(description="Staging rows it references, sorted.")
    shard: str = Field(description="The shard file that holds its session.")


class Manifest(_Model):
    """A committed environment snapshot. Written last; its presence means complete."""

    format_version: Literal[1, 2, 3, 4, 5, 6] = Field(
        description="Version of this on-disk format.")
    snapshot_id: str = Field(min_length=1, description="Id carried by every phase.")
    created_at: datetime = Field(description="When the snapshot was committed (UTC).")
    instances: list[str] = Field(
        description="Every instance that took part, including those that held nothing."
    )
    shards: list[ShardEntry] = Field(description="Every shard file of the snapshot.")
    rollouts: list[RolloutEntry] = Field(
        default_factory=list,
        description="Every captured rollout (formats 1 and 2; format 3 keeps them in each "
                    "shard's index).")
    restarted_rollouts: int = Field(ge=0, description="Rollouts held but not captured.")
    metrics: dict[str, float | int] = Field(
        description="The snapshot's figures (``RaySnapshot.figures``): seconds as floats, "
                    "bytes and counts as ints. ``holders_paused_seconds`` is the time from "
                    "``snapshot()`` entered to its block's exit, when the holders are "
                    "released; releases before issue 36 recorded it as ``paused_seconds``, "
                    "and their counts as floats: both are read under today's name and type.")
    blob_store: str | None = Field(
        None, pattern=BLOB_STORE_PATTERN,
        description="Format 4: the blob store of the sandboxes' files, relative to the "
                    "checkpoint path (\"../blobs\" when the path is directly under the root).")
    sequence: int | None = Field(
        None, ge=1,
        description="Format 6, written by a coordinator: the number its commit took "
                    "under its root (``nemo_ckpt.storage.commit_sequence``); newest first lists "
                    "by it, not by a host's clock.")

    @field_validator("metrics")
    @classmethod
    def _current_figures(cls, metrics: dict[str, float | int]) -> dict[str, float | int]:
        return current_figures(metrics)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        has_trees = any(s.trees is not None for s in self.shards)
        has_finished = any(s.finished is not None for s in self.shards)
        if self.format_version == 4 and (self.blob_store is None or not has_trees):
            raise ValueError("a format-4 manifest names its blob store and trees")
        if self.format_version < 4 and (self.blob_store is not None or has_trees):
            raise ValueError(f"a format-{self.format_version} manifest has no sandbox "
                             f"trees or blob store")
        has_chunks = [s.chunks is not None for s in self.shards]
        if self.format_version == 6:
            if not all(has_chunks):
                raise ValueError("a format-6 manifest has every shard's chunk hashes")
            if has_trees != (self.blob_store is not None):
                raise ValueError("a format-6 manifest names a blob store exactly when it "
                                 "has sandbox trees")
        elif any(has_chunks):
            raise ValueError(f"a format-{self.format_version} manifest has no chunk hashes")
        if self.format_version < 6 and self.sequence is not None:
            raise ValueError(f"a format-{self.format_version} manifest has no sequence")
        if self.format_version == 5:
            if not has_finished:
                raise ValueError("a format-5 manifest has a shard of finished rollouts")
            if has_trees != (self.blob_store is not None):
                raise ValueError("a format-5 manifest names a blob store exactly when it "
                                 "has sandbox trees")
        elif has_finished and self.format_version < 5:
            raise ValueError(f"a format-{self.format_version} manifest holds no finished "
                             f"rollouts")
        for shard in self.shards:
            if shard.finished is not None and shard.finished > shard.sessions:
                raise ValueError(f"shard {shard.file!r} says {shard.finished} finished of "
                                 f"{shard.sessions} sessions")
        if self.format_version >= 3:
            if self.rollouts:
                raise ValueError("a format-3 manifest lists no rollouts: each shard holds "
                                 "its own index")
            check_shards(self.instances, self.shards, None)
        else:
            check_consistency(self.instances, self.shards,
                              ((r.rollout_id, r.instance_id, r.shard) for r in self.rollouts))
        return self

    @property
    def sessions(self) -> int:
        """How many sessions the snapshot holds (the shards' counts)."""
        return sum(s.sessions for s in self.shards)


def check_consistency(instances: Iterable[str], shards: Iterable[ShardEntry],
                      rollouts: Iterable[tuple[str, str, str]]) -> None:
    """Raise ValueError unless shards and rollouts fit together: no rollout listed twice,
    and what ``check_shards`` requires. Rollouts are ``(rollout_id, instance_id, shard)``."""
    seen: set[str] = set()
    twice: set[str] = set()
    per_shard: Counter[tuple[str, str]] = Counter()
    for rollout_id, instance_id, file in rollouts:
        if rollout_id in seen:
            twice.add(rollout_id)
        seen.add(rollout_id)
        per_shard[(file, instance_id)] += 1
    if twice:
        raise ValueError(f"rollouts listed twice: {sorted(twice)}")
    check_shards(instances, shards, per_shard)


def check_shards(instances: Iterable[str], shards: Iterable[ShardEntry],
                 per_shard: Mapping[tuple[str, str], int] | None) -> None:
    """Raise ValueError unless the shards fit the rollouts that name them
    (``per_shard``: rollouts per ``(shard file, instance_id)``; None for a format that
    keeps rollouts in the shards): no shard listed twice, every rollout in a known shard
    of its own instance, each shard's session count equal to the rollouts naming it,
    and every shard's instance listed in ``instances``."""
    shards = list(shards)
    files = Counter(s.file for s in shards)
    if dup := sorted(f for f, n in files.items() if n > 1):
        raise ValueError(f"shard files listed twice: {dup}")
    if per_shard is None:
        if missing := sorted({s.instance_id for s in shards} - set(instances)):
            raise ValueError(f"shards of instances not listed in instances: {missing}")
        return
    shard_of = {s.file: s for s in shards}
    per_file: Counter[str] = Counter()
    for (file, instance_id), n in sorted(per_shard.items()):
        shard = shard_of.get(file)
        if shard is None:
            raise ValueError(f"{n} rollout(s) of {instance_id} name unknown shard {file!r}")
        if shard.instance_id != instance_id:
            raise ValueError(f"{n} rollout(s) of {instance_id} sit in shard {file!r} "
                             f"of {shard.instance_id}")
        per_file[file] += n
    for s in shards:
        if s.sessions != per_file[s.file]:
            raise ValueError(f"shard {s.file!r} says {s.sessions} sessions but "
                             f"{per_file[s.file]} rollouts name it")
    if missing := sorted({s.instance_id for s in shards} - set(instances)):
        raise ValueError(f"shards of instances not listed in instances: {missing}")


def current_figures(metrics: Mapping[str, float | int]) -> dict[str, float | int]:
    """A manifest's figures under today's names and types: an older release's
    ``paused_seconds`` (the holders' pause, as the driver measured it) is
    ``holders_paused_seconds``, and a count or byte figure it wrote as a float (every
    figure not in seconds) is an int."""
    figures: dict[str, float | int] = {}
    for key, value in metrics.items():
        if key == "paused_seconds" and "holders_paused_seconds" not in metrics:
            key = "holders_paused_seconds"
        if isinstance(value, float) and not key.endswith("_seconds") \
                and value.is_integer():
            value = int(value)
        figures[key] = value
    return figures


def encode_manifest(*, snapshot_id: str, created_at: datetime, instances: list[str],
                    shards: list[ShardEntry], restarted_rollouts: int,
                    metrics: dict[str, float | int], blob_store: str | None = None,
                    sequence: int | None = None) -> bytes:
    """The JSON of a current-version ``Manifest``: a few kilobytes, whatever the number
    of rollouts (they are in the shards' indexes). ``Manifest.model_validate_json`` reads
    it back (tested)."""
    check_shards(instances, shards, None)
    sandboxes = any(s.trees is not None for s in shards)
    if sandboxes and blob_store is None:
        raise ValueError("shards with directory trees need the blob store's location")
    if any(s.chunks is None for s in shards):
        raise ValueError("every shard of a new snapshot carries its chunk hashes")
    data: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "snapshot_id": snapshot_id,
        "created_at": created_at.isoformat(),
        "instances": instances,
        "shards": [s.model_dump(exclude_none=True) for s in shards],
        "restarted_rollouts": restarted_rollouts,
        "metrics": metrics,
    }
    if sandboxes:
        data["blob_store"] = blob_store
    if sequence is not None:
        data["sequence"] = sequence
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


def rollouts_by_shard(manifest: Manifest) -> dict[str, dict[str, int]] | None:
    """For each shard file, the rollouts its manifest lists there and their attempts;
    None for a format-3 manifest, which lists none (each shard holds its index)."""
    if manifest.format_version >= 3:
        return None
    listed: dict[str, dict[str, int]] = {s.file: {} for s in manifest.shards}
    for r in manifest.rollouts:
        listed.setdefault(r.shard, {})[r.rollout_id] = r.attempt
    return listed


def upgrade_v1(data: Any) -> Any:
    """A version-1 manifest's JSON data in the version-2 shape (its version kept): v1
    named each shard's SHA-256 ``sha256``; v2 says ``content_hash: "sha256:<hex>"``.
    Anything else is returned as it is, for validation to refuse."""
    if not (isinstance(data, dict) and data.get("format_version") == 1
            and isinstance(data.get("shards"), list)):
        return data
    shards = []
    for shard in data["shards"]:
        if isinstance(shard, dict) and "sha256" in shard:
            shard = dict(shard)
            shard["content_hash"] = f"sha256:{shard.pop('sha256')}"
        shards.append(shard)
    return {**data, "shards": shards}
