"""What a snapshot holds, from its manifest and its shards' indexes: ``inspect_snapshot``.

``nemo-ckpt inspect`` renders its ``SnapshotSummary`` (``--json`` prints
``SnapshotSummary.to_json()``); users call it directly (no Ray, no argparse).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from nemo_ckpt.phases import instance_sort_key
from nemo_ckpt.storage.manifest import Manifest
from nemo_ckpt.storage.snapshot_files import read_manifest, snapshot_rollouts
from nemo_ckpt.trees.snapshot_trees import snapshot_directories
from nemo_ckpt.trees.tree_types import tree_stats

__all__ = ["DirectorySummary", "InstanceSummary", "RolloutSummary", "SandboxSummary",
           "ShardSummary", "SnapshotSummary", "inspect_snapshot", "snapshot_summary"]


@dataclass(frozen=True)
class DirectorySummary:
    """A rollout's sandbox directory as the snapshot stored it. ``files`` and ``bytes``
    are None, and ``error`` says why, when its tree could not be read."""

    tree: str  # the tree's digest, hex
    new_bytes: int  # of files this snapshot added to the blob store
    files: int | None
    bytes: int | None
    error: str | None


@dataclass(frozen=True)
class RolloutSummary:
    """One captured rollout: its attempt, its committed turns, its staging rows."""

    rollout_id: str
    attempt: int
    turns: int
    staging_keys: tuple[str, ...]
    shard: str
    directory: DirectorySummary | None = None


@dataclass(frozen=True)
class ShardSummary:
    file: str
    bytes: int
    sessions: int
    content_hash: str


@dataclass
class InstanceSummary:
    """One instance's rollouts and shards, and their totals."""

    instance_id: str
    rollouts: list[RolloutSummary] = field(default_factory=list)
    shards: list[ShardSummary] = field(default_factory=list)
    turns: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class SandboxSummary:
    """The sandbox directories of a snapshot, and what it added to the blob store."""

    directories: int
    new_blobs: int
    new_bytes: int
    blob_store: str | None


@dataclass(frozen=True)
class SnapshotSummary:
    """What ``inspect_snapshot`` found: the manifest's facts, rollouts and shards by
    instance (in the runtime's instance order), the shards whose index does not read
    (file -> why), and the snapshot's metrics."""

    path: str
    snapshot_id: str
    format_version: int
    created_at: datetime
    captured_rollouts: int
    restarted_rollouts: int
    bytes: int
    instances: list[InstanceSummary]
    unreadable_shards: dict[str, str]
    sandboxes: SandboxSummary
    metrics: dict[str, float | int]

    def to_json(self) -> dict[str, Any]:
        """As plain JSON types (what ``nemo-ckpt inspect --json`` prints)."""

        def rollout(r: RolloutSummary) -> dict[str, Any]:
            entry: dict[str, Any] = {"rollout_id": r.rollout_id, "attempt": r.attempt,
                                     "turns": r.turns, "staging_keys": list(r.staging_keys),
                                     "shard": r.shard}
            if r.directory is not None:
                d = r.directory
                entry["directory"] = {"tree": d.tree, "new_bytes": d.new_bytes,
                                      "files": d.files, "bytes": d.bytes, "error": d.error}
            return entry

        return {
            "path": self.path, "snapshot_id": self.snapshot_id,
            "format_version": self.format_version, "created_at": self.created_at.isoformat(),
            "captured_rollouts": self.captured_rollouts,
            "restarted_rollouts": self.restarted_rollouts, "bytes": self.bytes,
            "instances": [{"instance_id": i.instance_id,
                           "rollouts": [rollout(r) for r in i.rollouts],
                           "shards": [{"file": s.file, "bytes": s.bytes,
                                       "sessions": s.sessions, "content_hash": s.content_hash}
                                      for s in i.shards],
                           "turns": i.turns, "bytes": i.bytes} for i in self.instances],
            "unreadable_shards": dict(self.unreadable_shards),
            "sandboxes": {"directories": self.sandboxes.directories,
                          "new_blobs": self.sandboxes.new_blobs,
                          "new_bytes": self.sandboxes.new_bytes,
                          "blob_store": self.sandboxes.blob_store},
            "metrics": dict(self.metrics),
        }


def inspect_snapshot(checkpoint_path: Path | str) -> SnapshotSummary:
    """What the snapshot at ``checkpoint_path`` holds (see ``snapshot_summary``). Raises
    the ``SnapshotReadError`` of a manifest that does not read."""
    return snapshot_summary(checkpoint_path, read_manifest(checkpoint_path))


def snapshot_summary(checkpoint_path: Path | str, manifest: Manifest) -> SnapshotSummary:
    """What ``inspect`` shows: rollouts and shards by instance.

    Built from the manifest and the shards' indexes (format 3; a format-2 manifest lists
    the rollouts itself), read without the sessions' bytes and without verifying
    hashes, so a snapshot with damaged shards can still be inspected (a shard whose
    index does not read is listed in ``unreadable_shards``); ``verify`` checks it all.
    """
    by_instance = {i: InstanceSummary(i) for i in manifest.instances}
    rollouts, unreadable = snapshot_rollouts(checkpoint_path, manifest)
    directories, unreadable_trees = snapshot_directories(checkpoint_path, manifest)
    unreadable.update(unreadable_trees)
    for r in sorted(rollouts, key=lambda r: (instance_sort_key(r.instance_id), r.rollout_id)):
        inst = by_instance[r.instance_id]
        d = directories.get(r.rollout_id)
        directory = None
        if d is not None:
            stats = None if d.tree is None else tree_stats(d.tree)
            directory = DirectorySummary(
                tree=d.tree_digest.hex(), new_bytes=d.new_bytes,
                files=None if stats is None else stats.files,
                bytes=None if stats is None else stats.bytes, error=d.error)
        inst.rollouts.append(RolloutSummary(r.rollout_id, r.attempt, r.turns,
                                            tuple(r.staging_keys), r.shard, directory))
        inst.turns += r.turns
    for s in sorted(manifest.shards, key=lambda s: s.file):
        inst = by_instance[s.instance_id]
        inst.shards.append(ShardSummary(s.file, s.bytes, s.sessions, s.content_hash))
        inst.bytes += s.bytes
    return SnapshotSummary(
        path=str(checkpoint_path),
        snapshot_id=manifest.snapshot_id,
        format_version=manifest.format_version,
        created_at=manifest.created_at,
        captured_rollouts=manifest.sessions,
        restarted_rollouts=manifest.restarted_rollouts,
        bytes=sum(s.bytes for s in manifest.shards),
        instances=[by_instance[i] for i in sorted(by_instance, key=instance_sort_key)],
        unreadable_shards=dict(sorted(unreadable.items())),
        sandboxes=SandboxSummary(
            directories=len(directories),
            new_blobs=sum(s.trees.new_blobs for s in manifest.shards if s.trees),
            new_bytes=sum(s.trees.new_blob_bytes for s in manifest.shards if s.trees),
            blob_store=manifest.blob_store),
        metrics=dict(sorted(manifest.metrics.items())),
    )
