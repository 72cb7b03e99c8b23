"""Sandbox directories as a sandbox backend (``nemo_ckpt.sandbox_backend``; blocking).

A session's directory lies inside ``CheckpointConfig.sandbox_root`` on its node. It is
recorded with ``nemo_ckpt.trees.scan`` (only what changed re-read), restored with
``nemo_ckpt.trees.materialize`` into the restore's staging folder, and moved into
place when the restore goes live: to ``<sandbox_root>/<capture key>``, or beside it
(``<capture key>.<restore id>``) when that is taken.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from nemo_ckpt.errors import RestoreConflictError, SandboxError
from nemo_ckpt.sandbox_backend import BlobSink, Fetch, Recorded, Staged, StoredSandbox
from nemo_ckpt.storage.names import beside, safe_name_part
from nemo_ckpt.trees.limits import SandboxLimits, TreeBudget
from nemo_ckpt.trees.materialize import materialize
from nemo_ckpt.trees.scan import scan
from nemo_ckpt.trees.tree_codec import decode_tree
from nemo_ckpt.trees.tree_types import tree_digests, tree_stats

__all__ = ["DirectoryBackend", "PRIVATE_DIR"]

PRIVATE_DIR = ".nemo-ckpt"  # under sandbox_root: nemo-ckpt's own, never a sandbox


class DirectoryBackend:
    """Sandbox directories under one node's ``sandbox_root`` (see the module docstring)."""

    def __init__(self, instance_id: str, root: Path, limits: SandboxLimits,
                 tree_budget: TreeBudget, restore_setid: bool) -> None:
        self.instance_id = instance_id
        self.root = root
        self.limits = limits
        self.tree_budget = tree_budget
        self.restore_setid = restore_setid

    def check_location(self, directory: str | os.PathLike[str], where: str) -> Path:
        """``directory`` as a session's sandbox, or ``SandboxError``: it must be a
        directory inside ``sandbox_root``, outside its private folder."""
        path = Path(os.path.realpath(directory))
        root = Path(os.path.realpath(self.root))
        if path == root or root not in path.parents:
            raise SandboxError(
                f"{self.instance_id}: the directory {directory} of session {where} is not "
                f"inside sandbox_root {self.root}; create rollouts' sandboxes under it")
        if (root / PRIVATE_DIR) in (path, *path.parents):
            raise SandboxError(
                f"{self.instance_id}: the directory {directory} of session {where} lies in "
                f"{root / PRIVATE_DIR}, which nemo-ckpt keeps for itself")
        if not path.is_dir():
            raise SandboxError(
                f"{self.instance_id}: the directory {directory} of session {where} does "
                f"not exist or is not a directory")
        return path

    def record(self, location: Path, previous: Recorded | None, sink: BlobSink) -> Recorded:
        kept: set[bytes] = set()
        reads = 0

        def store(chunks: Iterable[bytes]) -> tuple[bytes, int]:
            nonlocal reads
            reads += 1
            digest, length = sink.store(chunks)
            kept.add(digest)
            return digest, length

        try:
            result = scan(location, previous.listings if previous else None, store,
                          limits=self.limits)
        except BaseException:
            sink.orphan(kept)
            raise
        if reads > result.files_read:  # some file was read again, or is gone
            sink.orphan(kept - result.blobs())
        if previous is not None and result.root == previous.tree:  # nothing changed
            return Recorded(result.listings, previous.tree, previous.tree_size,
                            previous.blobs, previous.file_count, previous.file_bytes)
        for digest, data in result.objects.items():
            sink.put(digest, data)
        return Recorded(result.listings, result.root, result.root_size, result.blobs(),
                        result.file_count(), result.file_bytes())

    def target_of(self, capture_key: str) -> Path:
        return self.root / safe_name_part(capture_key)

    def restore(self, stored: StoredSandbox, fetch: Fetch, key: str, restore_id: str,
                staging: Path) -> Staged:
        target = self._target(key, restore_id)
        tree, objects = decode_tree(stored.tree, stored.tree_size, fetch, stored.where,
                                    self.tree_budget)
        place = staging / safe_name_part(key)
        try:
            if os.path.lexists(place):
                shutil.rmtree(place)
            materialize(tree, place, fetch, allow_setid=self.restore_setid)
        except OSError as exc:
            raise SandboxError(
                f"{self.instance_id}: cannot restore the directory of rollout "
                f"{stored.rollout_id!r} (attempt {stored.attempt}) into "
                f"{exc.filename or place}: {exc.strerror or exc}") from exc
        stats = tree_stats(tree)
        return Staged(stored.rollout_id, place, target,
                      Recorded({}, stored.tree, stored.tree_size,
                               frozenset(objects) | tree_digests(tree), stats.files,
                               stats.bytes))

    def _target(self, key: str, restore_id: str) -> Path:
        """Where the directory restored as ``key`` goes live: its own place, or beside
        it when that is taken; refuses the restore when both are."""
        target = self.target_of(key)
        if os.path.lexists(target):
            # Left by a restore of this snapshot that did not survive (its holder
            # died after it went live), or someone else's: keep it, and go beside it.
            target = self.root / beside(key, restore_id)
        if os.path.lexists(target):
            raise RestoreConflictError(
                f"{self.instance_id}: cannot restore the directory of {key}: "
                f"{target} already exists; remove it, or restore into a fresh job")
        return target

    def conflict(self, staged: Staged) -> str | None:
        assert isinstance(staged.target, Path)
        if os.path.lexists(staged.target):
            return f"{self.instance_id}: {staged.target} appeared during the restore"
        return None

    def place(self, staged: Staged) -> None:
        assert isinstance(staged.target, Path) and staged.staging is not None
        try:
            os.rename(staged.staging, staged.target)
        except OSError as exc:
            raise SandboxError(
                f"{self.instance_id}: cannot move the restored directory of rollout "
                f"{staged.rollout_id!r} from {staged.staging} to {staged.target}: "
                f"{exc.strerror or exc}") from exc

    def discard(self, location: Path) -> None:
        shutil.rmtree(location, ignore_errors=True)
