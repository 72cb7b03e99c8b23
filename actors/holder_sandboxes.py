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
store; a restore creates it running (``prepare_restore``), and its undo removes it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nemo_ckpt.containers.podman import Podman
from nemo_ckpt.containers.record import ContainerRecord, decode_record, encode_record
from nemo_ckpt.containers.sandbox import ContainerSandboxes
from nemo_ckpt.errors import ContainerRuntimeError, RestoreConflictError, SandboxError
from nemo_ckpt.sandboxes.backend import ContainerRef, SandboxLocation
from nemo_ckpt.sandboxes.blob_store import BlobStore
from nemo_ckpt.sandboxes.limits import SandboxLimits, TreeBudget
from nemo_ckpt.sandboxes.materialize import materialize
from nemo_ckpt.sandboxes.node_cache import BlobCache
from nemo_ckpt.sandboxes.scan import Listings, scan
from nemo_ckpt.sandboxes.snapshot_trees import (
    BlobsWritten,
    TreeRow,
    persist_blobs,
    read_blob,
    read_trees_file,
    write_trees_file,
)
from nemo_ckpt.sandboxes.tree_codec import decode_tree
from nemo_ckpt.sandboxes.tree_types import tree_digests, tree_stats
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.manifest import (
    MAX_SANDBOX_ID_BYTES,
    NAME_MAX,
    ShardEntry,
    TreesEntry,
    restored_name_problem,
    safe_name_part,
    trees_file_name,
)

__all__ = ["Sandbox", "Recorded", "Sandboxes", "RestoredSandbox", "SandboxCapture", "PRIVATE_DIR"]

PRIVATE_DIR = ".nemo-ckpt"
_MADE = "made-by-restores"  # markers of containers made by restores not live yet
log = logging.getLogger("nemo_ckpt.holder")
_RESTORE_MEMORY = 256 << 20  # verified blobs a restore keeps in memory per shard


@dataclass(frozen=True, slots=True)
class Recorded:
    """A directory's tree as one scan recorded it."""

    listings: Listings  # what the next scan may skip
    tree: bytes  # its top tree object's digest
    tree_size: int
    blobs: frozenset[bytes]  # every blob it references: tree objects, files, memory
    file_count: int
    file_bytes: int
    # A container's: its image, config, deletions and memory (its tree is ``tree``).
    container: ContainerRecord | None = None


@dataclass(slots=True)
class Sandbox:
    """One live session's sandbox: a directory, or a container."""

    location: SandboxLocation
    recorded: Recorded


@dataclass(slots=True)
class RestoredSandbox:
    """A sandbox a restore made, not yet live: a directory in its staging folder, to be
    moved to ``target``; or a container, created (running) under its name."""

    rollout_id: str
    staging: Path | None
    target: SandboxLocation
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


def _beside(key: str, restore_id: str) -> str:
    """The name of a restored directory beside one left in place: ``<key>.<restore id>``,
    or, when that passes ``NAME_MAX``, a 16-digit tag of the restore id in its place."""
    name = f"{safe_name_part(key)}.{safe_name_part(restore_id)}"
    if len(name) > NAME_MAX:
        tag = hashlib.blake2b(restore_id.encode("utf-8", "surrogatepass"),
                              digest_size=8).hexdigest()
        name = f"{safe_name_part(key)}.{tag}"
    return name


def _container_name(text: str) -> str:
    """``text`` as a podman container name: other characters become ``_``; past 128
    characters, its end is a 16-digit tag of the whole."""
    name = re.sub(r"[^a-zA-Z0-9_.-]", "_", text)
    if len(name) > 128:
        tag = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8)
        name = f"{name[:111]}.{tag.hexdigest()}"
    return name


class Session(Protocol):
    """A captured session, as a capture names it (the holder's ``Held``)."""

    @property
    def rollout_id(self) -> str: ...

    @property
    def attempt(self) -> int: ...


class Sandboxes:
    """The sandboxes of one holder (see the module docstring)."""

    def __init__(self, instance_id: str, sandbox_root: str | None,
                 blob_root: str | None, namespace: str = "nemo_ckpt",
                 limits: SandboxLimits | None = None, restore_setid: bool = False,
                 tree_budget: TreeBudget | None = None,
                 container_env: dict[str, str] | None = None) -> None:
        self.instance_id = instance_id
        self.namespace = namespace
        # None: sessions may not own containers (CheckpointConfig.containers is off).
        self.container_env = container_env
        self._containers: ContainerSandboxes | None = None
        # Sessions classed restart-only, with their sandbox if they own one (never
        # recorded: the worker still finds it in its session): never captured,
        # reported restarting.
        self.restart_only: dict[str, SandboxLocation | None] = {}
        self.limits = limits or SandboxLimits()
        self.tree_budget = tree_budget or TreeBudget()
        self.restore_setid = restore_setid
        self.root = None if sandbox_root is None else Path(os.path.abspath(sandbox_root))
        self.blob_root = blob_root
        # Jobs of other namespaces may share the root and their instances' names.
        self._private = None if self.root is None else \
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
        # Directories of an undone restore, to remove before any restore materializes
        # (its retry makes the same ones); the lock makes a restore wait for a removal
        # that a background thread has begun.
        self._doomed: list[SandboxLocation] = []
        self._doomed_lock = threading.Lock()
        # What this holder saw of the store's collection claim, across persists: a claim
        # a dead collector left is taken as abandoned once seen unchanged for its ttl.
        self._collection_watch: ClaimWatch | None = None

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
                assert self._private is not None
                self._remove_left_containers(self._private)
                if self._private.exists():
                    shutil.rmtree(self._private)
                self._cache = BlobCache(self._private / "blobs")
            return self._cache

    def _remove_left_containers(self, private: Path) -> None:
        """Remove the containers an earlier holder of this instance made in restores
        that never went live (it died mid-restore): each was marked before it was made,
        and unmarked once its restore went live or it was removed."""
        made = private / "containers" / _MADE
        if self.container_env is None or not made.is_dir():
            return
        podman = Podman(env=self.container_env)
        for marker in made.iterdir():
            try:
                podman.remove(marker.name)
                log.warning("%s: removed container %s, made by a restore of an earlier "
                            "holder of this instance that never went live",
                            self.instance_id, marker.name)
            except ContainerRuntimeError as exc:
                log.warning("%s: container %s, left by an earlier holder's restore, could "
                            "not be removed: %s", self.instance_id, marker.name, exc)

    def _mark(self, name: str, made: bool) -> None:
        """Mark (or unmark) the container ``name`` as made by a restore not live yet."""
        assert self._private is not None
        marker = self._private / "containers" / _MADE / name
        if made:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    @property
    def containers(self) -> ContainerSandboxes:
        """The node's container backend, made on first use (blocking)."""
        if self._containers is None:
            cache = self.cache
            assert self._private is not None
            self._containers = ContainerSandboxes(
                Podman(env=self.container_env), cache, self._private / "containers",
                self.limits, self.tree_budget, self.restore_setid)
        return self._containers

    def check_containers(self) -> tuple[list[str], list[str]]:
        """(problems, warnings) of this node's container runtime (check_startup)."""
        if self.container_env is None:
            return [], []
        if self._private is None:
            return [f"{self.instance_id}: CheckpointConfig.containers is on but "
                    f"sandbox_root is not set; set it (the node cache of containers' "
                    f"files lives there)"], []
        problems, warnings = self.containers.check()
        return ([f"{self.instance_id}: {p}" for p in problems],
                [f"{self.instance_id}: {w}" for w in warnings])

    def probe(self) -> None:
        """Make the cache folder and write and remove a file in it (check_startup):
        ``SandboxError`` saying why this node cannot hold sandboxes' files."""
        if self._private is None:
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
        if isinstance(location, ContainerRef) and location.memory == "required":
            return self.containers.criu_problem()
        return None

    def record(self, location: SandboxLocation, previous: Recorded | None) -> Recorded:
        """Record the sandbox at ``location`` (re-reading only what changed since
        ``previous``): a directory's or a container's new files and tree objects, and a
        container's memory, go into the cache."""
        if isinstance(location, ContainerRef):
            return self._record_container(location, previous)
        directory = location
        cache = self.cache
        kept: set[bytes] = set()
        reads = 0

        def store(chunks: Iterable[bytes]) -> tuple[bytes, int]:
            nonlocal reads
            reads += 1
            digest, length = cache.store(chunks)
            kept.add(digest)
            return digest, length

        with self._scan_lock:
            self._scans_running += 1
        try:
            result = scan(directory, previous.listings if previous else None, store,
                          limits=self.limits)
        except BaseException:
            self._orphan(kept)
            raise
        finally:
            with self._scan_lock:
                self._scans_running -= 1
        if reads > result.files_read:  # some file was read again, or is gone
            self._orphan(kept - result.blobs())
        if previous is not None and result.root == previous.tree:  # nothing changed
            return Recorded(result.listings, previous.tree, previous.tree_size,
                            previous.blobs, previous.file_count, previous.file_bytes)
        for digest, data in result.objects.items():
            cache.put(digest, data)
        return Recorded(result.listings, result.root, result.root_size, result.blobs(),
                        result.file_count(), result.file_bytes())

    def _record_container(self, ref: ContainerRef, previous: Recorded | None) -> Recorded:
        containers = self.containers
        with self._scan_lock:
            self._scans_running += 1
        try:
            got = containers.record(ref.name, previous.listings if previous else None,
                                    memory=ref.memory != "off", policy=ref.memory)
        finally:
            with self._scan_lock:
                self._scans_running -= 1
        return Recorded(got.listings, got.record.tree, got.record.tree_size, got.blobs,
                        got.file_count, got.file_bytes, got.record)

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
        old = self._by_rollout.pop(rollout_id, None)
        if old is not None:
            self._count(old.recorded.blobs, -1)
        return old

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
                clock: Callable[[], float]) -> TreesEntry:
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
        return write_trees_file(directory, trees_file_name(snapshot_id, self.instance_id),
                                self.instance_id, written.attribute(rows, refs),
                                len(needed), written, capture.containers())

    # --- a restore (blocking, then bookkeeping) --------------------------------------

    def target_of(self, capture_key: str) -> Path:
        assert self.root is not None
        return self.root / safe_name_part(capture_key)

    def prepare_restore(self, restore_id: str, directory: Folder, entry: ShardEntry,
                        blob_store: str | None, new_keys: dict[str, str]
                        ) -> list[RestoredSandbox]:
        """Materialize the directories of shard ``entry``'s sessions in a staging folder;
        ``new_keys`` maps each rollout to the capture key it is restored as."""
        assert entry.trees is not None
        if self.root is None or self._private is None:
            raise SandboxError(
                f"{self.instance_id}: shard {entry.file} holds sandbox directories, but "
                f"CheckpointConfig.sandbox_root is not set here to restore them into")
        if blob_store is None:
            raise SandboxError(f"{self.instance_id}: shard {entry.file} holds sandbox "
                               f"directories, but its manifest names no blob store")
        from nemo_ckpt.storage.checkpoint_folder import folder_at

        self.remove_doomed()  # an undone restore's directories: its retry makes them again
        store = BlobStore(blob_store, folder_at)
        cache = self.cache
        staging = self._make_staging(self._private, restore_id)
        restored: list[RestoredSandbox] = []
        # Blobs verified once, kept in memory while the shard's directories are made:
        # rollouts started from one repository share most of their files.
        verified: dict[bytes, bytes] = {}
        held = 0

        def fetch(digest: bytes, size: int) -> bytes:
            nonlocal held
            data = verified.get(digest)
            if data is not None:
                return data
            data = read_blob(store, cache, digest, size)
            if held + len(data) <= _RESTORE_MEMORY:
                verified[digest] = data
                held += len(data)
            return data

        containers: dict[str, bytes] = {}
        rows = read_trees_file(directory, entry.trees, self.instance_id, containers)
        self._check_restored_names(rows, new_keys, directory, entry.trees.file)
        for rollout_id, attempt, tree_digest, tree_size, _ in rows:
            key = new_keys[rollout_id]
            if rollout_id in containers:
                restored.append(self._restore_container(
                    containers[rollout_id], rollout_id, attempt, tree_digest, tree_size,
                    key, restore_id, fetch, directory.describe(entry.trees.file)))
                continue
            target = self._restore_target(self.root, key, restore_id)
            tree, objects = decode_tree(
                tree_digest, tree_size, fetch,
                f"{rollout_id} (attempt {attempt}) in {directory.describe()}",
                self.tree_budget)

            place = staging / safe_name_part(key)
            try:
                if os.path.lexists(place):
                    shutil.rmtree(place)
                materialize(tree, place, fetch, allow_setid=self.restore_setid)
            except OSError as exc:
                raise SandboxError(
                    f"{self.instance_id}: cannot restore the directory of rollout "
                    f"{rollout_id!r} (attempt {attempt}) into {exc.filename or place}: "
                    f"{exc.strerror or exc}") from exc
            stats = tree_stats(tree)
            restored.append(RestoredSandbox(
                rollout_id, place, target,
                Recorded({}, tree_digest, tree_size,
                         frozenset(objects) | tree_digests(tree), stats.files, stats.bytes)))
        return restored

    def _restore_container(self, raw: bytes, rollout_id: str, attempt: int,
                           tree_digest: bytes, tree_size: int, key: str, restore_id: str,
                           fetch: Callable[[bytes, int], bytes], trees_file: str
                           ) -> RestoredSandbox:
        """Create the container of one stored session (running, not live yet)."""
        where = f"{rollout_id} (attempt {attempt}) in {trees_file}"
        record = decode_record(raw, where)
        if (record.tree, record.tree_size) != (tree_digest, tree_size):
            raise ContainerRuntimeError(f"the container record of {where} names another "
                                        f"tree than its row: crafted or damaged")
        if self.container_env is None:
            raise ContainerRuntimeError(
                f"{self.instance_id}: the snapshot holds the container of {where}, but "
                f"CheckpointConfig.containers is off here; turn it on to restore it")
        if record.policy == "required" and record.memory is not None \
                and self.containers.criu_problem() is not None:
            raise ContainerRuntimeError(
                f"{self.instance_id}: the container of {where} needs its processes' memory "
                f"(opened with memory='required'), which this node cannot restore "
                f"({self.containers.criu_problem()}); restore where CRIU works "
                f"(check_startup warns of each node where it does not)")
        name = self._container_target(key, restore_id)
        self._mark(name, True)
        try:
            made = self.containers.restore(record, fetch, name, key, where)
        except BaseException:
            self._mark(name, False)  # restore() removed what it made
            raise
        if record.memory is not None and not made.running:
            log.warning("%s: the container of %s was restored with its files only, its "
                        "command started again: %s", self.instance_id, where,
                        self.containers.criu_problem() or "memory capture is off")
        return RestoredSandbox(
            rollout_id, None, ContainerRef(name, record.policy),  # type: ignore[arg-type]
            Recorded({}, tree_digest, tree_size, made.blobs, made.file_count,
                     made.file_bytes, record))

    def _container_target(self, key: str, restore_id: str) -> str:
        """The name of a restored session's container: ``nemo-ckpt-<namespace>-<key>``,
        or beside one of that name left by an earlier restore; refuses the restore
        when both are taken."""
        base = _container_name(f"nemo-ckpt-{self.namespace}-{key}")
        for name in (base, _container_name(f"{base}.{_beside(key, restore_id)}")):
            if not self.containers.podman.exists(name):
                return name
        raise RestoreConflictError(
            f"{self.instance_id}: cannot restore the container of {key}: containers "
            f"{base} and the one beside it already exist; remove them, or restore into "
            f"a fresh job")

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

    def _restore_target(self, root: Path, key: str, restore_id: str) -> Path:
        """Where the directory restored as ``key`` goes live: its own place, or beside
        it when that is taken; refuses the restore when both are."""
        target = self.target_of(key)
        if os.path.lexists(target):
            # Left by a restore of this snapshot that did not survive (its holder
            # died after it went live), or someone else's: keep it, and go beside it.
            target = root / _beside(key, restore_id)
        if os.path.lexists(target):
            raise RestoreConflictError(
                f"{self.instance_id}: cannot restore the directory of {key}: "
                f"{target} already exists; remove it, or restore into a fresh job")
        return target

    def commit_restore(self, restored: list[RestoredSandbox]) -> None:
        """Move a prepared restore's directories into place (blocking); its containers
        are in place already."""
        for box in restored:
            if isinstance(box.target, Path) and box.staging is not None \
                    and os.path.lexists(box.target):
                raise RestoreConflictError(
                    f"{self.instance_id}: {box.target} appeared during the restore")
        for box in restored:
            if box.staging is None:
                assert isinstance(box.target, ContainerRef)
                self._mark(box.target.name, False)  # the session's from now on
                continue
            assert isinstance(box.target, Path)
            try:
                os.rename(box.staging, box.target)
            except OSError as exc:
                raise SandboxError(
                    f"{self.instance_id}: cannot move the restored directory of rollout "
                    f"{box.rollout_id!r} from {box.staging} to {box.target}: "
                    f"{exc.strerror or exc}") from exc

    def discard_staging(self, restore_id: str) -> None:
        """Remove a restore's staging folder (blocking)."""
        if self._private is not None:
            shutil.rmtree(self._private / f"restore-{safe_name_part(restore_id)}",
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
                if isinstance(d, ContainerRef):
                    try:
                        self.containers.discard(d.name)
                        self._mark(d.name, False)
                    except ContainerRuntimeError as exc:
                        log.warning("%s: the container %s of an undone restore could not "
                                    "be removed: %s", self.instance_id, d.name, exc)
                else:
                    shutil.rmtree(d, ignore_errors=True)

    def forget_restore(self, restored: Iterable[RestoredSandbox]) -> None:
        for box in restored:
            self.forget_unused(box.recorded)

    # --- the cache's collection ----------------------------------------------------

    def sweep(self) -> int:
        """Remove the cached blobs no live session references; returns how many. Call
        it on the event loop, only while no snapshot or restore is open (their captures
        may still need them); it does nothing while a scan runs."""
        if self.scans_in_flight or self._private is None:
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
