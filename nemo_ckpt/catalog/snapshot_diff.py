"""Comparing two snapshots rollout by rollout, and their rollouts' directories:
``diff_snapshots``.

``nemo-ckpt diff`` renders its ``SnapshotDiff``; users call it directly (no Ray, no
argparse).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nemo_ckpt.errors import SnapshotReadError
from nemo_ckpt.phases import instance_sort_key
from nemo_ckpt.storage.manifest import Manifest
from nemo_ckpt.storage.shards import RolloutIndexEntry
from nemo_ckpt.storage.snapshot_files import read_manifest, snapshot_rollouts
from nemo_ckpt.trees.snapshot_trees import snapshot_directories
from nemo_ckpt.trees.tree_types import diff_trees

__all__ = ["SnapshotDiff", "compare_directories", "diff_manifests", "diff_snapshots",
           "rollout_sort_key", "snapshot_index"]


def rollout_sort_key(r: RolloutIndexEntry) -> tuple[tuple[int, str], str]:
    """Rollouts by instance (as the runtime orders instances), then by id."""
    return instance_sort_key(r.instance_id), r.rollout_id


@dataclass(frozen=True)
class SnapshotDiff:
    """How snapshot B differs from snapshot A, rollout by rollout (matched by rollout id).

    ``added`` are in B only; ``finished`` are in A only (they completed, or were
    retired or dropped, in between); ``continued`` pairs A's entry with B's.
    """

    a: Manifest
    b: Manifest
    added: tuple[RolloutIndexEntry, ...]
    finished: tuple[RolloutIndexEntry, ...]
    continued: tuple[tuple[RolloutIndexEntry, RolloutIndexEntry], ...]
    # rollout id -> {"added"|"removed"|"changed": paths}, for continued rollouts whose
    # directory changed (or could not be read: {"error": [why]})
    directories: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    @property
    def turns_advanced(self) -> int:
        """Turns run in between by the rollouts present in both."""
        return sum(b.turns - a.turns for a, b in self.continued)


def diff_manifests(a: Manifest, b: Manifest, rollouts_a: list[RolloutIndexEntry],
                   rollouts_b: list[RolloutIndexEntry]) -> SnapshotDiff:
    """Compare two snapshots, given their manifests and their rollouts
    (``snapshot_rollouts``)."""
    in_a = {r.rollout_id: r for r in rollouts_a}
    in_b = {r.rollout_id: r for r in rollouts_b}
    return SnapshotDiff(
        a=a, b=b,
        added=tuple(sorted((r for k, r in in_b.items() if k not in in_a),
                           key=rollout_sort_key)),
        finished=tuple(sorted((r for k, r in in_a.items() if k not in in_b),
                              key=rollout_sort_key)),
        continued=tuple(sorted(((in_a[k], r) for k, r in in_b.items() if k in in_a),
                               key=lambda pair: rollout_sort_key(pair[1]))),
    )


def compare_directories(diff: SnapshotDiff, path_a: Path | str, path_b: Path | str) -> None:
    """Fill ``diff.directories`` with the paths each continued rollout's directory
    added, removed and changed from A (at ``path_a``) to B (at ``path_b``)."""
    dirs_a, _ = snapshot_directories(path_a, diff.a)
    dirs_b, _ = snapshot_directories(path_b, diff.b)
    for ra, rb in diff.continued:
        da, db = dirs_a.get(ra.rollout_id), dirs_b.get(rb.rollout_id)
        if da is None or db is None:
            continue
        if da.tree is None or db.tree is None:
            diff.directories[rb.rollout_id] = {"error": [da.error or db.error or "?"]}
        elif da.tree_digest != db.tree_digest:
            diff.directories[rb.rollout_id] = diff_trees(da.tree, db.tree)


def snapshot_index(checkpoint_path: Path | str) -> tuple[Manifest, list[RolloutIndexEntry]]:
    """A snapshot's manifest and its rollouts, every shard's index read; the
    ``SnapshotReadError`` of a manifest or a shard index that does not read."""
    manifest = read_manifest(checkpoint_path)
    rollouts, unreadable = snapshot_rollouts(checkpoint_path, manifest)
    if unreadable:
        file, why = next(iter(sorted(unreadable.items())))
        raise SnapshotReadError(checkpoint_path, f"shard {file} of {checkpoint_path} does "
                                                 f"not read: {why}; run verify")
    return manifest, rollouts


def diff_snapshots(path_a: Path | str, path_b: Path | str, directories: bool = True
                   ) -> SnapshotDiff:
    """How the snapshot at ``path_b`` differs from the one at ``path_a``, rollout by
    rollout, and with ``directories`` each continued rollout's directory, path by path.
    Reads manifests and shard indexes, no session bytes; raises the
    ``SnapshotReadError`` of the first that does not read."""
    a, rollouts_a = snapshot_index(path_a)
    b, rollouts_b = snapshot_index(path_b)
    diff = diff_manifests(a, b, rollouts_a, rollouts_b)
    if directories:
        compare_directories(diff, path_a, path_b)
    return diff
