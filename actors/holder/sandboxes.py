"""The sandbox directories of one holder's sessions, and the node cache behind them.

A ``SessionHolder`` keeps one ``Sandbox`` per live session that owns a directory: where
it is, its tree's digest as of the session's last committed turn, the file blobs that
tree references, and what the next scan may skip. The holder calls the blocking
methods here through its runtime's ``run_blocking`` (a thread under Ray), and the
bookkeeping ones (``install``, ``drop``) with no await between them and the session
table's change, so a capture sees a session and its tree as one.

Every blob a live session's tree references stays in the node's ``BlobCache`` (the
reference counts below): a snapshot's persist copies from it whatever the shared store
lacks, even after the files changed on disk. Blobs nothing references any more are
removed by ``sweep``, which the holder runs only while no snapshot or restore is open
(their captures may still need them).

Layout under ``sandbox_root`` (the same path on every node):

    <sandbox_root>/<anything>/...             sessions' directories (the worker's)
    <sandbox_root>/<capture key>              a restored session's directory (or
                                              <capture key>.<restore id> if that is taken)
    <sandbox_root>/.nemo-ckpt/<namespace>/<instance>/blobs      the cache's files
    <sandbox_root>/.nemo-ckpt/<namespace>/<instance>/restore-<id>/<capture key>
                                              a restore's staging
    <sandbox_root>/.nemo-ckpt/<namespace>/<instance>/containers/
                                              containers' recording and restore files;
        made-by-restores/<container name>     a container a restore made, not live
                                              yet: removed by the next holder of the
                                              instance if this one dies first

A session's container (``nemo_ckpt.containers``) is recorded into the same cache and
store; a restore creates it running, and its undo removes it. A restore's sandboxes
(staged, placed, undone) are the part ``Sandboxes.restores``
(``actors.holder.sandbox_restores``).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from actors.holder.sandbox_restores import SandboxRestores
from nemo_ckpt.containers.backend import ContainerBackend
from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.errors import ContainerRuntimeError, SandboxError
from nemo_ckpt.phases import TreesRef
from nemo_ckpt.sandbox_backend import (
    ContainerRef,
    Recorded,
    SandboxBackend,
    SandboxLocation,
)
from nemo_ckpt.sandboxes.directories import PRIVATE_DIR, DirectoryBackend
from nemo_ckpt.sandboxes.provided import ProvidedSandboxes, provided_label
from nemo_ckpt.shard_refs import trees_ref
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.names import (
    MAX_SANDBOX_ID_BYTES,
    restored_name_problem,
    safe_name_part,
    trees_file_name,
)
from nemo_ckpt.trees.blob_store import BlobStore
from nemo_ckpt.trees.container_record import encode_record
from nemo_ckpt.trees.limits import SandboxLimits, TreeBudget
from nemo_ckpt.trees.node_cache import BlobCache
from nemo_ckpt.trees.snapshot_trees import (
    BlobsWritten,
    persist_blobs,
    write_trees_file,
)

__all__ = ["Sandbox", "Recorded", "Sandboxes", "SandboxCapture", "PRIVATE_DIR"]

log = logging.getLogger("nemo_ckpt.holder")


@dataclass(slots=True)
class Sandbox:
    """One live session's sandbox: a directory, or a container."""

    location: SandboxLocation
    recorded: Recorded


@dataclass
class SandboxCapture:
    """The sandboxes of one snapshot's captured sessions (see ``Sandboxes.capture``): the
    live sandboxes as of the cut, and the captured sessions. Their rows are made after
    the pause (``rows``), from this copy."""

    boxes: dict[str, Sandbox]
    sessions: Sequence[Session]

    def any(self) -> bool:
        """Whether a captured session owns a sandbox."""
        boxes = self.boxes
        return bool(boxes) and any(s.rollout_id in boxes for s in self.sessions)

    def rows(self) -> tuple[list[tuple[str, int, bytes, int]], list[frozenset[bytes]]]:
        """Per captured session with a sandbox, in order: ``(rollout_id, attempt, top
        tree, tree size)``, and every blob its tree references."""
        rows: list[tuple[str, int, bytes, int]] = []
        blobs: list[frozenset[bytes]] = []
        for session in self.sessions:
            box = self.boxes.get(session.rollout_id)
            if box is not None:
                rec = box.recorded
                rows.append((session.rollout_id, session.attempt, rec.tree, rec.tree_size))
                blobs.append(rec.blobs)
        return rows, blobs

    def containers(self) -> dict[str, bytes]:
        """The encoded container record of each captured session that owns a container."""
        out: dict[str, bytes] = {}
        for session in self.sessions:
            box = self.boxes.get(session.rollout_id)
            if box is not None and box.recorded.container is not None:
                out[session.rollout_id] = encode_record(box.recorded.container)
        return out


class Session(Protocol):
    """A captured session, as a capture names it (the holder's ``Held``)."""

    @property
    def rollout_id(self) -> str: ...

    @property
    def attempt(self) -> int: ...


class _Sink:
    """A recording's blobs into the holder's cache and orphan account (``BlobSink``)."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self._cache = sandboxes.cache
        self.orphan = sandboxes._orphan
        self.store = self._cache.store

    def put(self, digest: bytes, data: bytes) -> None:
        self._cache.put(digest, data)


class Sandboxes:
    """The sandboxes of one holder (see the module docstring): the sessions' table and
    the node cache's account, routing each sandbox's work to its backend
    (``nemo_ckpt.sandbox_backend``: directories, containers)."""

    def __init__(self, instance_id: str, sandbox_root: str | None,
                 blob_root: str | None, namespace: str = "nemo_ckpt",
                 limits: SandboxLimits | None = None, restore_setid: bool = False,
                 tree_budget: TreeBudget | None = None,
                 container_env: dict[str, str] | None = None) -> None:
        self.instance_id = instance_id
        self.namespace = namespace
        # None: sessions may not own containers (CheckpointConfig.containers is off).
        self.container_env = container_env
        self._containers: ContainerBackend | None = None
        self._directories: DirectoryBackend | None = None
        # Sessions classed restart-only, with their sandbox if they own one (never
        # recorded: the worker still finds it in its session): never captured,
        # reported restarting.
        self.restart_only: dict[str, SandboxLocation | None] = {}
        # The staging keys of each session's last turn whose commit failed recording
        # its sandbox (the worker got the error): a snapshot's orphan rows are named as
        # theirs, not blamed on RL's data plane. One set per session, gone with it.
        self.unrecorded: dict[str, frozenset[str]] = {}
        self.limits = limits or SandboxLimits()
        self.tree_budget = tree_budget or TreeBudget()
        self.restore_setid = restore_setid
        self.root = None if sandbox_root is None else Path(os.path.abspath(sandbox_root))
        self.blob_root = blob_root
        # Jobs of other namespaces may share the root and their instances' names.
        # This holder's own folder (cache, staging, containers' files).
        self.private = None if self.root is None else \
            self.root / PRIVATE_DIR / safe_name_part(namespace) / safe_name_part(instance_id)
        self._cache: BlobCache | None = None
        self._cache_lock = threading.Lock()
        self._by_rollout: dict[str, Sandbox] = {}
        self._refs: Counter[bytes] = Counter()
        self._unreferenced: set[bytes] = set()
        # Scans running in threads: a sweep waits for none of them, it is skipped (a
        # scan may find a blob in the cache that the sweep is about to remove). The
        # holder counts a scan from before its thread starts until its caller has the
        # result; ``record`` counts it while its thread runs (it may outlive a cancelled
        # caller). Both in ``finally``: a scan that fails never leaves one counted.
        self.scans_in_flight = 0
        self._scans_running = 0
        # Blobs a scan kept but its tree does not reference (a file read again because
        # it changed, or a scan that failed), for the sweep; from threads, so locked.
        self._orphans: set[bytes] = set()
        self._scan_lock = threading.Lock()
        # What this holder saw of the store's collection claim, across persists: a claim
        # a dead collector left is taken as abandoned once seen unchanged for its ttl.
        self._collection_watch: ClaimWatch | None = None
        # A restore's sandboxes: made in staging, placed, undone (its own part).
        self.restores = SandboxRestores(self)
        # Sandboxes a provider made for this instance's sessions (NeMo Gym's): released
        # with their session; what an earlier holder of the instance left is removed now,
        # before any session of this one (blocking, at the holder's start).
        self.provided = None if self.root is None else \
            ProvidedSandboxes(self.root, namespace, instance_id)
        # The rollouts whose sandboxes the earlier holder had marked: a restore that
        # continues one marks the continued attempt's sandbox in turn.
        self.provided_rollouts: set[str] = set()
        self.removed_at_start = 0 if self.provided is None else self._remove_left()

    def _remove_left(self) -> int:
        """Remove the provided sandboxes an earlier holder of this instance left (marked,
        or containers labelled for it), and say how many."""
        assert self.provided is not None
        removed = 0
        try:
            if self.provided.marked():
                self.provided_rollouts = self.provided.rollouts()
                removed += self.provided.remove_left(self._container_remover())
            if self.container_env is not None:
                podman = Podman(env=self.container_env)
                for name in podman.text(
                        "ps", "-a", "--filter",
                        f"label={provided_label(self.namespace, self.instance_id)}",
                        "--format", "{{.Names}}").split():
                    podman.remove(name)
                    removed += 1
        except (OSError, ContainerRuntimeError) as exc:
            log.warning("%s: could not remove every sandbox an earlier holder of this "
                        "instance left: %s", self.instance_id, exc)
        if removed:
            log.warning("%s: removed %d sandboxes left by an earlier holder of this "
                        "instance (their sessions died with it)", self.instance_id, removed)
        return removed

    def _container_remover(self) -> Callable[[str], None] | None:
        if self.container_env is None:
            return None
        return Podman(env=self.container_env).remove

    def count(self) -> int:
        """Live sessions' sandboxes on this holder: recorded, or restart-only (the
        ``sandboxes`` gauge)."""
        return len(self._by_rollout) + sum(
            1 for where in self.restart_only.values() if where is not None)

    def marked(self, capture_keys: Iterable[str]) -> list[str]:
        """Which of these sessions' sandboxes a provider marked (a stat each: called on
        the event loop, so that a holder with none never waits for a thread)."""
        if self.provided is None:
            return []
        return [k for k in capture_keys if self.provided.is_marked(k)]

    def mark_restored(self, restored: Iterable[tuple[str, str, SandboxLocation]]) -> None:
        """Mark the sandboxes a restore made for ``(rollout id, capture key, where)`` of
        rollouts whose sandboxes were marked (blocking): released as theirs were."""
        assert self.provided is not None
        for rollout_id, key, where in restored:
            if rollout_id not in self.provided_rollouts:
                continue
            try:  # the restore is live already: a mark not written is only logged
                if isinstance(where, ContainerRef):
                    self.provided.mark(key, container=where.name, rollout_id=rollout_id)
                else:
                    self.provided.mark(key, directory=where, rollout_id=rollout_id)
            except OSError as exc:
                log.warning("%s: the sandbox %s restored for %s is not marked (%s): it is "
                            "removed only once Gym's provider connects to it",
                            self.instance_id, where, key, exc)

    def release_provided(self, capture_keys: Iterable[str]) -> int:
        """Remove the provided sandboxes of these sessions, which left for good
        (blocking); returns how many were removed."""
        if self.provided is None:
            return 0
        remover = self._container_remover()
        return sum(self.provided.release(k, remover) for k in capture_keys)

    def __len__(self) -> int:
        return len(self._by_rollout)

    def get(self, rollout_id: str) -> Sandbox | None:
        return self._by_rollout.get(rollout_id)

    def location(self, rollout_id: str) -> SandboxLocation | None:
        """Where the session's sandbox is, recorded or (restart-only) not."""
        box = self._by_rollout.get(rollout_id)
        return box.location if box is not None else self.restart_only.get(rollout_id)

    @property
    def cache(self) -> BlobCache:
        """The cache, made on first use (blocking): what an earlier holder of this
        instance left (its cache, a restore's staging) is removed first, as nothing
        live refers to it and a file of it may not have survived a crash whole."""
        with self._cache_lock:
            if self._cache is None:
                assert self.private is not None
                if self.container_env is not None:  # before the folder goes
                    ContainerBackend.remove_left(self.instance_id, self.container_env,
                                                 self.private / "containers")
                if self.private.exists():
                    shutil.rmtree(self.private)
                self._cache = BlobCache(self.private / "blobs")
            return self._cache

    @property
    def containers(self) -> ContainerBackend:
        """The node's container backend, made on first use (blocking)."""
        if self._containers is None:
            cache = self.cache
            assert self.private is not None and self.container_env is not None
            self._containers = ContainerBackend(
                self.instance_id, self.namespace, self.container_env, cache,
                self.private / "containers", self.limits, self.tree_budget,
                self.restore_setid)
        return self._containers

    @property
    def directories(self) -> DirectoryBackend:
        assert self.root is not None
        if self._directories is None:
            self._directories = DirectoryBackend(self.instance_id, self.root, self.limits,
                                                 self.tree_budget, self.restore_setid)
        return self._directories

    def backend_of(self, location: SandboxLocation) -> SandboxBackend:
        """The backend of a sandbox: the sessions' router's one decision."""
        if isinstance(location, ContainerRef):
            return self.containers
        return self.directories

    def check_containers(self) -> tuple[list[str], list[str]]:
        """(problems, warnings) of this node's container runtime (check_startup)."""
        if self.container_env is None:
            return [], []
        if self.private is None:
            return [f"{self.instance_id}: CheckpointConfig.containers is on but "
                    f"sandbox_root is not set; set it (the node cache of containers' "
                    f"files lives there)"], []
        return self.containers.check()

    def probe(self) -> None:
        """Make the cache folder and write and remove a file in it (check_startup):
        ``SandboxError`` saying why this node cannot hold sandboxes' files."""
        if self.private is None:
            return
        try:
            probe = self.cache.directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"probe")
            probe.unlink()
        except OSError as exc:
            raise SandboxError(f"{self.instance_id} cannot write its cache under "
                               f"sandbox_root {self.root}: {exc}") from None

    # --- recording (blocking) --------------------------------------------------------

    def check_directory(self, directory: str | os.PathLike[str], where: str) -> Path:
        """``directory`` as the session's sandbox, or ``SandboxError``: it must be a
        directory inside ``sandbox_root``, outside its private folder."""
        if self.root is None:
            raise SandboxError(
                f"{self.instance_id}: session {where} was opened with directory "
                f"{directory}, but CheckpointConfig.sandbox_root is not set; set it to the "
                f"folder (on every node) that holds the rollouts' sandboxes")
        return self.directories.check_location(directory, where)

    def check_location(self, location: str | ContainerRef, where: str) -> SandboxLocation:
        """A session's sandbox as given to open it: a directory (``check_directory``)
        or a container, which needs ``CheckpointConfig.containers`` and a
        ``sandbox_root`` (its files are cached there)."""
        if not isinstance(location, ContainerRef):
            return self.check_directory(location, where)
        if self.container_env is None:
            raise ContainerRuntimeError(
                f"{self.instance_id}: session {where} was opened with container "
                f"{location.name}, but CheckpointConfig.containers is off; turn it on "
                f"(and set container_env if podman needs one) to record containers")
        if self.root is None:
            raise ContainerRuntimeError(
                f"{self.instance_id}: session {where} was opened with container "
                f"{location.name}, but CheckpointConfig.sandbox_root is not set; set it "
                f"(the node cache of containers' files lives there)")
        return location

    def restart_only_reason(self, location: SandboxLocation) -> str | None:
        """Why a session with this sandbox cannot be captured on this node (blocking):
        a container that needs its memory where CRIU does not work; else None."""
        if isinstance(location, ContainerRef):
            return self.containers.restart_only_reason(location)
        return None

    def record(self, location: SandboxLocation, previous: Recorded | None) -> Recorded:
        """Record the sandbox at ``location`` through its backend (re-reading only what
        changed since ``previous``): its new blobs go into the cache."""
        backend = self.backend_of(location)
        sink = _Sink(self)
        with self._scan_lock:
            self._scans_running += 1
        try:
            return backend.record(location, previous, sink)
        finally:
            with self._scan_lock:
                self._scans_running -= 1

    # --- bookkeeping (no await around these and the table's change) ------------------

    def install(self, rollout_id: str, location: SandboxLocation,
                recorded: Recorded) -> None:
        old = self._by_rollout.get(rollout_id)
        self._by_rollout[rollout_id] = Sandbox(location, recorded)
        if old is None:
            self._count(recorded.blobs, +1)
        else:  # a turn's new tree shares most of its blobs with the one it replaces
            self._count(recorded.blobs - old.recorded.blobs, +1)
            self._count(old.recorded.blobs - recorded.blobs, -1)

    def drop(self, rollout_id: str) -> Sandbox | None:
        self.restart_only.pop(rollout_id, None)
        self.unrecorded.pop(rollout_id, None)
        old = self._by_rollout.pop(rollout_id, None)
        if old is not None:
            self._count(old.recorded.blobs, -1)
        return old

    def park(self, rollout_ids: Iterable[str]) -> list[ContainerRef]:
        """Drop the sandboxes of these sessions, parked by a stop snapshot (their blobs
        go at the next ``sweep``). Returns their containers, for ``remove_containers``:
        a directory stays, its worker's."""
        containers = []
        for rollout_id in rollout_ids:
            location = self.location(rollout_id)
            self.drop(rollout_id)
            if isinstance(location, ContainerRef):
                containers.append(location)
        return containers

    def remove_containers(self, containers: Iterable[ContainerRef]) -> None:
        """Remove these containers (blocking), whoever made them."""
        for container in containers:
            self.containers.discard(container)

    def _orphan(self, digests: set[bytes]) -> None:
        if digests:
            with self._scan_lock:
                self._orphans |= digests

    async def record_all(self, run_blocking: Callable[..., Awaitable[Recorded]],
                         directories: list[tuple[str, SandboxLocation]],
                         previous: Recorded | None = None) -> dict[str, Recorded]:
        """Each sandbox, recorded through ``run_blocking`` (a thread); keyed by its
        session's capture key. The cache is not swept while they are scanned."""
        out: dict[str, Recorded] = {}
        if not directories:
            return out
        self.scans_in_flight += 1
        try:
            for key, directory in directories:
                out[key] = await run_blocking(self.record, directory, previous)
        except BaseException:
            for rec in out.values():
                self.forget_unused(rec)
            raise
        finally:
            self.scans_in_flight -= 1
        return out

    def forget_unused(self, recorded: Recorded) -> None:
        """A recording no session took (its turn was refused): its blobs may go."""
        for d in recorded.blobs:
            if self._refs[d] <= 0:
                self._unreferenced.add(d)

    def _count(self, blobs: Iterable[bytes], delta: int) -> None:
        refs = self._refs
        for d in blobs:
            n = refs[d] + delta
            if n > 0:
                refs[d] = n
            else:
                del refs[d]
                self._unreferenced.add(d)

    def capture(self, sessions: Sequence[Session]) -> SandboxCapture:
        """The sandboxes of the captured ``sessions``, as of now. Called in the pause, it
        only copies the table (a turn installs a new ``Sandbox``, it never changes one):
        walking every session's tree record here was most of what sandboxes added to
        the pause (``benchmarks/sandboxes.py``)."""
        return SandboxCapture(dict(self._by_rollout), sessions)

    # --- a snapshot's persist (blocking) -------------------------------------------

    def persist(self, capture: SandboxCapture, directory: Folder, snapshot_id: str,
                clock: Callable[[], float]) -> TreesRef:
        """Make the captured trees' blobs durable in the store, then write the trees file."""
        if self.blob_root is None:
            raise SandboxError(f"{self.instance_id}: sessions own sandboxes but no blob "
                               f"store is configured (CheckpointConfig.checkpoint_root)")
        from nemo_ckpt.storage.checkpoint_folder import folder_at

        store = BlobStore(self.blob_root, folder_at)
        rows, refs = capture.rows()
        for rollout_id, attempt, _, _ in rows:  # never commit what a restore cannot name
            problem = restored_name_problem(f"{rollout_id}-a{attempt + 1}")
            if problem is not None:
                raise SandboxError(
                    f"{self.instance_id}: snapshot {snapshot_id} cannot hold the directory "
                    f"of rollout {rollout_id!r} (attempt {attempt}): {problem}; close the "
                    f"session (a shorter id fits: at most {MAX_SANDBOX_ID_BYTES} bytes)")
        needed: set[bytes] = set()
        for blobs in refs:
            needed |= blobs
        if self._collection_watch is None or self._collection_watch.clock != clock:
            self._collection_watch = ClaimWatch(clock)
        written: BlobsWritten = persist_blobs(store, self.cache, needed, clock,
                                              watch=self._collection_watch)
        return trees_ref(write_trees_file(
            directory, trees_file_name(snapshot_id, self.instance_id), self.instance_id,
            written.attribute(rows, refs), len(needed), written, capture.containers()))

    # --- the cache's collection ----------------------------------------------------

    def sweep(self) -> int:
        """Remove the cached blobs no live session references; returns how many. Call
        it on the event loop, only while no snapshot or restore is open (their captures
        may still need them); it does nothing while a scan runs."""
        if self.scans_in_flight or self.private is None:
            return 0
        with self._scan_lock:  # no scan starts while the cache loses blobs
            if self._scans_running:
                return 0
            self._unreferenced |= self._orphans
            self._orphans.clear()
            if not self._unreferenced:
                return 0
            gone = {d for d in self._unreferenced if self._refs.get(d, 0) <= 0}
            self._unreferenced.clear()
            self.cache.remove(gone)
        return len(gone)
