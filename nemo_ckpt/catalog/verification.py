"""Verifying a snapshot on disk: every check a restore makes, all failures listed.

``nemo-ckpt verify`` renders ``verify_snapshot``'s report; tests and users call it
directly (no Ray, no argparse).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nemo_ckpt.errors import SnapshotReadError
from nemo_ckpt.progress import CatalogProgress, ProgressCallback
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.manifest import Manifest, ShardEntry, rollouts_by_shard
from nemo_ckpt.storage.shards import read_shard, shard_problems
from nemo_ckpt.storage.snapshot_files import read_manifest
from nemo_ckpt.trees.snapshot_trees import verify_directories

__all__ = ["VerifyReport", "one_line", "verify_snapshot"]


def one_line(error: BaseException) -> str:
    """An error's message on one line (pydantic's validation errors span several)."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())


@dataclass
class VerifyReport:
    """What ``verify_snapshot`` found: the manifest (if it reads) and each shard's verdict.

    ``shards`` maps each shard file to ``None`` when intact, else to its problems.
    ``problems`` lists every problem found, manifest and shards alike.
    """

    path: Path | str
    manifest: Manifest | None = None
    manifest_error: SnapshotReadError | None = None
    shards: dict[str, list[str] | None] = field(default_factory=dict)
    directory_problems: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when a restore from this snapshot would pass every storage check."""
        return self.manifest is not None and not self.problems


def verify_snapshot(checkpoint_path: Path | str,
                    progress: ProgressCallback | None = None) -> VerifyReport:
    """Make every check a restore makes on ``checkpoint_path``, and report all failures.

    A restore stops at its first refusal; this goes on shard by shard, so one run lists
    every missing, truncated, altered or undecodable shard. The checks are the ones
    ``read_manifest`` and ``read_shard`` make for a restore (version, schema, shard
    names, lengths, hashes, decoding), plus the cross-check of ``read_snapshot``: each
    shard holds exactly the rollouts and attempts its manifest lists there.

    ``progress`` hears of each shard verified ("shards verified", from 0 of all), then
    of each sandbox directory ("directories verified"), in the calling thread; an
    exception it raises stops the verification and propagates.
    """
    path = checkpoint_path
    report = VerifyReport(path=path)
    try:
        manifest = read_manifest(path)
    except SnapshotReadError as exc:
        report.manifest_error = exc
        report.problems.append(one_line(exc))
        return report
    report.manifest = manifest
    directory = environment_folder(path)
    listed = rollouts_by_shard(manifest)
    seen: dict[str, str] = {}  # rollout id -> the shard that holds it
    total = len(manifest.shards)
    if progress is not None:
        progress(CatalogProgress("shards verified", 0, total))
    for done, shard in enumerate(manifest.shards, 1):
        report.shards[shard.file] = _shard_problems(directory, shard, listed, seen)
        if progress is not None:
            progress(CatalogProgress("shards verified", done, total, shard.file))
    for found in report.shards.values():
        report.problems += found or []
    report.directory_problems = verify_directories(path, manifest, progress=progress)
    report.problems += report.directory_problems
    return report


def _shard_problems(directory: Folder, shard: ShardEntry,
                    listed: dict[str, dict[str, int]] | None,
                    seen: dict[str, str]) -> list[str] | None:
    """One shard's problems (None when intact); ``seen``, the shard that holds each
    rollout so far, gains this shard's."""
    try:
        records = read_shard(directory, shard)
    except SnapshotReadError as exc:
        return [one_line(exc)]
    pairs = [(r.episode.rollout_id, r.episode.attempt) for r in records]
    problems = shard_problems(
        None if listed is None else listed.get(shard.file, {}), pairs,
        directory.describe(shard.file))
    problems += [f"rollout {rid!r} is in two shards, {seen[rid]} and {shard.file}; "
                 f"restore an earlier checkpoint" for rid, _ in pairs if rid in seen]
    seen.update((rid, shard.file) for rid, _ in pairs)
    return problems or None
