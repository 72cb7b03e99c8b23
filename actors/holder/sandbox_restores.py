"""A restore's sandboxes on one holder: made in a staging folder from a shard's trees
file (``prepare_restore``), checked and put in place (``commit_restore``), and undone
(the staging folder discarded, what was made doomed and removed).

``SandboxRestores`` is a part of the holder's ``actors.holder.sandboxes.Sandboxes``,
which makes one and shares with it the node cache, the backends and the reference
counts; the holder's restore phases (``actors.holder.restore``) and its shard reads
(``actors.holder.shards``) call it as ``sandboxes.restores``. Its methods block (the
holder runs them through ``run_blocking``), but for ``doom`` and ``forget_restore``,
bookkeeping on the event loop.
"""

from __future__ import annotations

import concurrent.futures
import functools
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from nemo_ckpt.containers.backend import ContainerBackend
from nemo_ckpt.errors import ContainerRuntimeError, RestoreConflictError, SandboxError
from nemo_ckpt.phases import ShardRef
from nemo_ckpt.sandbox_backend import (
    Recorded,
    SandboxBackend,
    SandboxLocation,
    Staged,
    StoredSandbox,
)
from nemo_ckpt.sandboxes.directories import DirectoryBackend
from nemo_ckpt.shard_refs import shard_entry
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.names import restored_name_problem, safe_name_part
from nemo_ckpt.trees.blob_store import BlobStore
from nemo_ckpt.trees.node_cache import BlobCache
from nemo_ckpt.trees.snapshot_trees import TreeRow, read_blob, read_trees_file


class SandboxHome(Protocol):
    """What a restore's sandboxes need of the holder's ``Sandboxes``, whose part this is
    (typed here so that neither module imports the other)."""

    instance_id: str
    root: Path | None
    private: Path | None
    container_env: dict[str, str] | None

    @property
    def cache(self) -> BlobCache: ...

    @property
    def containers(self) -> ContainerBackend: ...

    @property
    def directories(self) -> DirectoryBackend: ...

    def backend_of(self, location: SandboxLocation) -> SandboxBackend: ...

    def forget_unused(self, recorded: Recorded) -> None: ...

__all__ = ["RestoredSandbox", "SandboxRestores", "in_threads"]

T = TypeVar("T")

_RESTORE_MEMORY = 256 << 20  # verified blobs a restore keeps in memory per shard

# A sandbox a restore made, not live yet (the name the holder's parts use).
RestoredSandbox = Staged


def in_threads(calls: Sequence[Callable[[], T]], threads: int) -> list[T]:
    """Each of ``calls``' results, in order, run ``threads`` at a time. The first error
    is raised once the calls already running have ended; the rest never start."""
    if len(calls) <= 1 or threads <= 1:
        return [call() for call in calls]
    with concurrent.futures.ThreadPoolExecutor(
            min(threads, len(calls)), thread_name_prefix="nemo-ckpt-restore") as pool:
        futures = [pool.submit(call) for call in calls]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


class SandboxRestores:
    """The restores of one holder's sandboxes (see the module docstring)."""

    def __init__(self, sandboxes: SandboxHome) -> None:
        self._boxes = sandboxes
        self.instance_id = sandboxes.instance_id
        # Directories of an undone restore, to remove before any restore materializes
        # (its retry makes the same ones); the lock makes a restore wait for a removal
        # that a background thread has begun.
        self._doomed: list[SandboxLocation] = []
        self._doomed_lock = threading.Lock()

    def prepare_restore(self, restore_id: str, directory: Folder, entry: ShardRef,
                        blob_store: str | None, new_keys: dict[str, str],
                        threads: int = 1) -> list[RestoredSandbox]:
        """Materialize the directories of shard ``entry``'s sessions in a staging folder,
        ``threads`` at a time (``Runtime.threads``); ``new_keys`` maps each rollout to the
        capture key it is restored as."""
        trees = shard_entry(entry).trees  # storage reads the manifest's own class
        assert trees is not None
        boxes = self._boxes
        if boxes.root is None or boxes.private is None:
            raise SandboxError(
                f"{self.instance_id}: shard {entry.file} holds sandbox directories, but "
                f"CheckpointConfig.sandbox_root is not set here to restore them into")
        if blob_store is None:
            raise SandboxError(f"{self.instance_id}: shard {entry.file} holds sandbox "
                               f"directories, but its manifest names no blob store")
        from nemo_ckpt.storage.checkpoint_folder import folder_at

        self.remove_doomed()  # an undone restore's directories: its retry makes them again
        store = BlobStore(blob_store, folder_at)
        cache = boxes.cache
        staging = self._make_staging(boxes.private, restore_id)
        # Blobs verified once, kept in memory while the shard's directories are made:
        # rollouts started from one repository share most of their files.
        verified: dict[bytes, bytes] = {}
        held = 0
        reading = threading.Lock()  # directories are made in threads; a blob read once

        def fetch(digest: bytes, size: int) -> bytes:
            nonlocal held
            data = verified.get(digest)
            if data is not None:
                return data
            with reading:
                data = verified.get(digest)
                if data is not None:
                    return data
                data = read_blob(store, cache, digest, size)
                if held + len(data) <= _RESTORE_MEMORY:
                    verified[digest] = data
                    held += len(data)
            return data

        containers: dict[str, bytes] = {}
        rows = read_trees_file(directory, trees, self.instance_id, containers)
        self._check_restored_names(rows, new_keys, directory, trees.file)
        made: list[Callable[[], RestoredSandbox]] = []  # in the rows' order
        for rollout_id, attempt, tree_digest, tree_size, _ in rows:
            raw = containers.get(rollout_id)
            if raw is not None and boxes.container_env is None:
                raise ContainerRuntimeError(
                    f"{self.instance_id}: the snapshot holds the container of rollout "
                    f"{rollout_id!r}, but CheckpointConfig.containers is off here; turn "
                    f"it on to restore it")
            stored = StoredSandbox(
                rollout_id, attempt, tree_digest, tree_size, raw,
                f"{rollout_id} (attempt {attempt}) in {directory.describe(trees.file)}")
            backend = boxes.containers if raw is not None else boxes.directories
            made.append(functools.partial(backend.restore, stored, fetch,
                                          new_keys[rollout_id], restore_id, staging))
        if containers:  # the container runtime's calls, one at a time
            return [make() for make in made]
        return in_threads(made, threads)

    def _make_staging(self, private: Path, restore_id: str) -> Path:
        """The restore's staging folder, made (a retry's is reused)."""
        staging = private / f"restore-{safe_name_part(restore_id)}"
        try:
            staging.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SandboxError(f"{self.instance_id}: cannot make the restore's staging "
                               f"folder {staging}: {exc.strerror or exc}") from exc
        return staging

    def _check_restored_names(self, rows: list[TreeRow], new_keys: dict[str, str],
                              directory: Folder, trees_file: str) -> None:
        """Refuse the restore, before any directory is made, when a row of the trees
        file names a rollout its shard does not hold or one whose restored name is not
        a safe directory name."""
        for rollout_id, attempt, _, _, _ in rows:
            key = new_keys.get(rollout_id)
            if key is None:
                raise SandboxError(f"trees file {trees_file} names rollout "
                                   f"{rollout_id!r}, which its shard does not hold")
            problem = restored_name_problem(key)
            if problem is not None:
                raise SandboxError(f"{self.instance_id}: cannot restore the directory of "
                                   f"rollout {rollout_id!r} (attempt {attempt}) of "
                                   f"{directory.describe(trees_file)}: {problem}; "
                                   f"the snapshot was written before rollout ids were "
                                   f"bounded, or crafted: restore another one")

    def commit_restore(self, restored: list[RestoredSandbox]) -> None:
        """Put a prepared restore's sandboxes in place (blocking): directories moved,
        containers made the sessions'. Every place is checked before any moves."""
        for box in restored:
            problem = self._boxes.backend_of(box.target).conflict(box)
            if problem is not None:
                raise RestoreConflictError(problem)
        for box in restored:
            self._boxes.backend_of(box.target).place(box)

    def discard_staging(self, restore_id: str) -> None:
        """Remove a restore's staging folder (blocking)."""
        if self._boxes.private is not None:
            shutil.rmtree(self._boxes.private / f"restore-{safe_name_part(restore_id)}",
                          ignore_errors=True)

    def doom(self, made: Iterable[SandboxLocation]) -> None:
        """Directories and containers an undone restore made: ``remove_doomed`` removes
        them."""
        self._doomed.extend(made)

    def remove_doomed(self) -> None:
        """Remove the doomed directories and containers (blocking; waits for a removal
        under way)."""
        with self._doomed_lock:
            doomed, self._doomed = self._doomed, []
            for d in doomed:
                self._boxes.backend_of(d).discard(d)

    def forget_restore(self, restored: Iterable[RestoredSandbox]) -> None:
        for box in restored:
            self._boxes.forget_unused(box.recorded)
