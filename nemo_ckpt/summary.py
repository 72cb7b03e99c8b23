"""What a snapshot holds, from its manifest and its shards' indexes, as plain JSON types.

``nemo-ckpt inspect`` renders ``snapshot_summary`` (or prints it as JSON with ``--json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_ckpt.manifest import Manifest
from nemo_ckpt.phases import instance_sort_key
from nemo_ckpt.sandbox import tree_stats
from nemo_ckpt.sandbox_storage import snapshot_directories
from nemo_ckpt.snapshot_files import snapshot_rollouts

__all__ = ["snapshot_summary"]


def snapshot_summary(checkpoint_path: Path | str, manifest: Manifest) -> dict[str, Any]:
    """What ``inspect`` shows, as plain JSON types: rollouts and shards by instance.

    Built from the manifest and the shards' indexes (format 3; a format-2 manifest lists
    the rollouts itself), read without the sessions' bytes and without verifying
    hashes, so a snapshot with damaged shards can still be inspected (a shard whose
    index does not read is listed in ``unreadable_shards``); ``verify`` checks it all.
    """
    by_instance: dict[str, dict[str, Any]] = {
        i: {"instance_id": i, "rollouts": [], "shards": [], "turns": 0, "bytes": 0}
        for i in manifest.instances
    }
    rollouts, unreadable = snapshot_rollouts(checkpoint_path, manifest)
    directories, unreadable_trees = snapshot_directories(checkpoint_path, manifest)
    unreadable.update(unreadable_trees)
    for r in sorted(rollouts, key=lambda r: (instance_sort_key(r.instance_id), r.rollout_id)):
        inst = by_instance[r.instance_id]
        entry: dict[str, Any] = {
            "rollout_id": r.rollout_id, "attempt": r.attempt, "turns": r.turns,
            "staging_keys": list(r.staging_keys), "shard": r.shard,
        }
        d = directories.get(r.rollout_id)
        if d is not None:
            stats = None if d.tree is None else tree_stats(d.tree)
            entry["directory"] = {
                "tree": d.tree_digest.hex(), "new_bytes": d.new_bytes,
                "files": None if stats is None else stats.files,
                "bytes": None if stats is None else stats.bytes,
                "error": d.error}
        inst["rollouts"].append(entry)
        inst["turns"] += r.turns
    for s in sorted(manifest.shards, key=lambda s: s.file):
        inst = by_instance[s.instance_id]
        inst["shards"].append({"file": s.file, "bytes": s.bytes, "sessions": s.sessions,
                               "content_hash": s.content_hash})
        inst["bytes"] += s.bytes
    return {
        "path": str(checkpoint_path),
        "snapshot_id": manifest.snapshot_id,
        "format_version": manifest.format_version,
        "created_at": manifest.created_at.isoformat(),
        "captured_rollouts": manifest.sessions,
        "restarted_rollouts": manifest.restarted_rollouts,
        "bytes": sum(s.bytes for s in manifest.shards),
        "instances": [by_instance[i] for i in sorted(by_instance, key=instance_sort_key)],
        "unreadable_shards": dict(sorted(unreadable.items())),
        "sandboxes": {
            "directories": len(directories),
            "new_blobs": sum(s.trees.new_blobs for s in manifest.shards if s.trees),
            "new_bytes": sum(s.trees.new_blob_bytes for s in manifest.shards if s.trees),
            "blob_store": manifest.blob_store,
        },
        "metrics": dict(sorted(manifest.metrics.items())),
    }
