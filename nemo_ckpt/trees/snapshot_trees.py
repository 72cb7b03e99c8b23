"""How a snapshot stores its sessions' sandbox directories (manifest format 4).

Beside each holder's shard, a *trees file* lists, per session that owns a directory, the
digest of its tree (``nemo_ckpt.trees.tree_codec``); trees and the files they name
are blobs in the root's ``BlobStore`` (``nemo_ckpt.trees.blob_store``), so a snapshot
writes only the blobs the store lacks, and an unchanged directory costs its row in the
trees file.

Trees file: a msgpack header map, then ``[[rollout_id, attempt, tree digest, tree
length, new bytes], ...]`` in the shard's session order (sessions without a directory
are left out); ``new bytes`` are the bytes of the blobs this snapshot wrote that the
session's tree references (each counted once, for the first session that does). It is
written and verified like a shard: length and hash in the manifest (``TreesEntry``),
durable before the manifest.

Version 2 (written only when a session owns a container): a row may have a sixth
element, the session's container record (``nemo_ckpt.trees.container_record``), whose tree
is the row's; its memory blob, if any, is in the blob store beside the files. A reader
of version 1 refuses a version-2 file rather than restore a container as a directory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from nemo_ckpt.errors import NemoCkptError, SandboxError, ShardCorruptedError
from nemo_ckpt.progress import CatalogProgress, ProgressCallback
from nemo_ckpt.storage.checkpoint_folder import environment_folder, folder_at
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.storage.folder import Folder, Sink
from nemo_ckpt.storage.hashed_files import read_verified, view_unpacker, write_hashed
from nemo_ckpt.storage.location import join_location, levels_below, parent_location
from nemo_ckpt.storage.manifest import Manifest, TreesEntry
from nemo_ckpt.storage.names import restored_name_problem
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore
from nemo_ckpt.trees.container_record import decode_record
from nemo_ckpt.trees.extents import sparse_layout
from nemo_ckpt.trees.limits import TreeBudget
from nemo_ckpt.trees.node_cache import BlobCache
from nemo_ckpt.trees.tree_codec import decode_tree
from nemo_ckpt.trees.tree_types import FILE, SPARSE, Tree

__all__ = ["TreeRow", "write_trees_file", "read_trees_file", "blob_store_ref",
           "blob_store_of", "moved_blob_store", "persist_blobs", "BlobsWritten", "fetch_tree",
           "read_blob", "SessionDirectory", "snapshot_directories", "verify_directories"]

TREES_MAGIC = "nemo-ckpt-trees"
TREES_VERSION = 1
TREES_VERSION_CONTAINERS = 2

# (rollout_id, attempt, tree digest, tree length, new bytes)
TreeRow = tuple[str, int, bytes, int, int]


def blob_store_ref(checkpoint_root: str | Path, checkpoint_path: str | Path) -> str:
    """The manifest's ``blob_store`` for a snapshot at ``checkpoint_path``: the root's
    store, relative to the path. ``SandboxError`` when the path is not below the root
    (sandboxes' blobs are shared by every snapshot under it)."""
    levels = levels_below(checkpoint_root, checkpoint_path)
    if levels is None:
        raise SandboxError(
            f"checkpoint path {checkpoint_path} is not below checkpoint_root "
            f"{checkpoint_root}: sessions own sandbox directories, whose files are kept "
            f"once in {join_location(checkpoint_root, BLOB_DIR)} for every snapshot under "
            f"the root; snapshot to a path under it")
    return "../" * levels + BLOB_DIR


def blob_store_of(checkpoint_path: str | Path, manifest: Manifest) -> str | None:
    """Where the blob store of a format-4 snapshot lies (None for earlier formats)."""
    if manifest.blob_store is None:
        return None
    levels = manifest.blob_store.count("../")
    return join_location(parent_location(checkpoint_path, levels), BLOB_DIR)


def moved_blob_store(checkpoint_path: str | Path, manifest: Manifest) -> str | None:
    """Why the snapshot at ``checkpoint_path`` finds no blob store where its manifest
    says (None when it finds one, or has no sandbox directories). A snapshot names the
    root's store by its depth below the root (``blob_store_ref``): renamed within its
    parent it finds it, moved to another depth it would find none, and every blob would
    read as missing, as if damaged."""
    where = blob_store_of(checkpoint_path, manifest)
    if where is None:
        return None
    try:
        if folder_at(where).subfolders():
            return None
    except NemoCkptError:
        return None  # a store that does not list: its reads say why
    levels = str(manifest.blob_store).count("../")
    return (f"snapshot {checkpoint_path} has sandbox directories, whose files are in its "
            f"checkpoint root's blob store, {levels} level(s) above the folder it was "
            f"written to; there is no blob store at {where}, so the snapshot was moved to "
            f"another depth below its root. Move it back to a folder {levels} level(s) "
            f"below the root (renaming it within its parent folder is supported)")


def write_trees_file(directory: Folder, name: str, instance_id: str, rows: list[TreeRow],
                     blobs: int, written: BlobsWritten,
                     containers: dict[str, bytes] | None = None) -> TreesEntry:
    """Write a holder's trees file (see the module docstring) durably; its entry.
    ``containers``: the encoded container record of each row's rollout that has one."""
    def fill(sink: Sink) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        version = TREES_VERSION_CONTAINERS if containers else TREES_VERSION
        sink.write(packer.pack({"format": TREES_MAGIC, "version": version,
                                "instance_id": instance_id, "sandboxes": len(rows)}))
        if containers:
            sink.write(packer.pack([
                [*r, containers[r[0]]] if r[0] in containers else list(r) for r in rows]))
        else:
            sink.write(packer.pack([list(r) for r in rows]))

    length, digest = write_hashed(directory, name, fill)
    return TreesEntry(file=name, bytes=length, content_hash=digest, sandboxes=len(rows),
                      blobs=blobs, new_blobs=written.count, new_blob_bytes=written.total_bytes)


def read_trees_file(directory: Folder, entry: TreesEntry, instance_id: str,
                    containers: dict[str, bytes] | None = None) -> list[TreeRow]:
    """A trees file's rows, once its length and hash match ``entry``; each row's encoded
    container record, if it has one, into ``containers`` by rollout id (decode it with
    ``nemo_ckpt.trees.container_record.decode_record``: it is checked there)."""
    path, data = read_verified(directory, entry)
    try:
        unpacker = view_unpacker(data)
        header = unpacker.unpack()
        rows: Any = unpacker.unpack()
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise ShardCorruptedError(path, f"trees file {path} does not decode ({exc})") from exc
    if not (isinstance(header, dict) and header.get("format") == TREES_MAGIC
            and header.get("version") in (TREES_VERSION, TREES_VERSION_CONTAINERS)
            and header.get("instance_id") == instance_id
            and isinstance(rows, list) and len(rows) == entry.sandboxes
            and all(isinstance(r, list) and len(r) in (5, 6) and isinstance(r[0], str)
                    and (len(r) == 5 or (len(r) == 6 and isinstance(r[5], bytes) and
                                         header["version"] == TREES_VERSION_CONTAINERS))
                    and type(r[1]) is int and isinstance(r[2], bytes) and len(r[2]) == 16
                    and type(r[3]) is int and type(r[4]) is int for r in rows)):
        raise ShardCorruptedError(path, f"trees file {path} matches its hash but is not a "
                                        f"nemo-ckpt trees file of {instance_id} holding "
                                        f"{entry.sandboxes} trees; restore an earlier checkpoint")
    if containers is not None:
        containers.update((r[0], r[5]) for r in rows if len(r) == 6)
    return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]


class BlobsWritten:
    """What ``persist_blobs`` wrote: each blob's length, by digest."""

    def __init__(self) -> None:
        self.lengths: dict[bytes, int] = {}

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def total_bytes(self) -> int:
        return sum(self.lengths.values())

    def attribute(self, rows: list[tuple[str, int, bytes, int]],
                  files: list[frozenset[bytes]]) -> list[TreeRow]:
        """``rows`` with each one's new bytes (see the module docstring)."""
        left = dict(self.lengths)
        out: list[TreeRow] = []
        for (rollout_id, attempt, tree, size), refs in zip(rows, files, strict=True):
            new = left.pop(tree, 0)
            if left:
                for d in refs & left.keys():
                    new += left.pop(d)
            out.append((rollout_id, attempt, tree, size, new))
        return out


def persist_blobs(store: BlobStore, cache: BlobCache, needed: Iterable[bytes],
                  clock: Callable[[], float] = time.monotonic,
                  deadline: float | None = None,
                  watch: ClaimWatch | None = None) -> BlobsWritten:
    """Make every blob of ``needed`` durable in ``store``, copying from ``cache`` those it
    lacks. Call it with the store held by the snapshot (``BlobStore.hold``): it first
    waits out a collection that began before the hold, judged on ``clock``, this
    process's monotonic clock (``deadline`` is on it; ``BlobStore.wait_for_collection``)."""
    store.claims.wait_for_collection(clock=clock, deadline=deadline, watch=watch)
    written = BlobsWritten()
    for digest in sorted(store.missing(needed)):
        source: Path | bytes | None = cache.held(digest)
        if source is None:
            source = cache.path(digest)
        if isinstance(source, Path) and not source.exists():
            raise SandboxError(
                f"blob {digest.hex()} of a captured sandbox is neither in the blob store "
                f"{store.where} nor in this holder's cache {cache.directory}; something "
                f"removed it from the cache")
        written.lengths[digest] = store.put(digest, source)
    return written


def fetch_tree(store: BlobStore, cache: BlobCache | None, digest: bytes, size: int,
               where: str, budget: TreeBudget | None = None) -> tuple[Tree, dict[bytes, int]]:
    """The tree whose top object is ``digest``, its objects read from the cache or the
    store (verified, and kept in the cache), checked safe and within ``budget``; and
    those objects."""
    return decode_tree(digest, size, lambda d, n: read_blob(store, cache, d, n), where,
                       budget)


def read_blob(store: BlobStore, cache: BlobCache | None, digest: bytes, size: int) -> bytes:
    """Blob ``digest`` (``size`` bytes), verified: from the cache if it holds it, else from
    the store, then kept in the cache."""
    data = cache.read(digest, size) if cache is not None else None
    if data is None:
        data = store.read(digest, size)
        if cache is not None:
            cache.put(digest, data)
    return data


@dataclass
class SessionDirectory:
    """One captured session's directory, as the CLI reads it back: its tree (None when
    it does not read, with ``error`` saying why) and the bytes this snapshot wrote for it."""

    instance_id: str
    rollout_id: str
    attempt: int
    tree_digest: bytes
    new_bytes: int
    tree: Tree | None = None
    error: str | None = None
    memory: tuple[bytes, int] | None = None  # a container's memory blob, if captured
    container_image: str | None = None  # a container's image id


def snapshot_directories(checkpoint_path: str | Path, manifest: Manifest,
                         budget: TreeBudget | None = None
                         ) -> tuple[dict[str, SessionDirectory], dict[str, str]]:
    """Every captured session's directory by rollout id, and the trees files that do not
    read (file -> why). Trees and trees files are verified as they are read; the files'
    blobs are not read here (``verify_directories`` does)."""
    where = blob_store_of(checkpoint_path, manifest)
    found: dict[str, SessionDirectory] = {}
    unreadable: dict[str, str] = {}
    if where is None:
        return found, unreadable
    store = BlobStore(where, folder_at)
    directory = environment_folder(checkpoint_path)
    for shard in manifest.shards:
        if shard.trees is None:
            continue
        containers: dict[str, bytes] = {}
        try:
            rows = read_trees_file(directory, shard.trees, shard.instance_id, containers)
        except NemoCkptError as exc:
            unreadable[shard.trees.file] = str(exc)
            continue
        for rollout_id, attempt, digest, size, new in rows:
            entry = SessionDirectory(shard.instance_id, rollout_id, attempt, digest, new)
            if rollout_id in containers:
                try:
                    record = decode_record(containers[rollout_id],
                                           f"{rollout_id} in {checkpoint_path}")
                except NemoCkptError as exc:
                    entry.error = str(exc)
                    found[rollout_id] = entry
                    continue
                entry.container_image = record.config.image
                if record.memory is not None:
                    entry.memory = (record.memory, record.memory_size)
            problem = restored_name_problem(f"{rollout_id}-a{attempt + 1}")
            if problem is not None:  # a restore refuses it before it reads the tree
                entry.error = (f"a restore cannot make it: {problem}; the snapshot was "
                               f"written before rollout ids were bounded, or crafted")
                found[rollout_id] = entry
                continue
            try:
                entry.tree, _ = fetch_tree(store, None, digest, size,
                                           f"{rollout_id} in {checkpoint_path}", budget)
            except NemoCkptError as exc:
                entry.error = str(exc)
            found[rollout_id] = entry
    return found, unreadable


def verify_directories(checkpoint_path: str | Path, manifest: Manifest,
                       budget: TreeBudget | None = None,
                       progress: ProgressCallback | None = None) -> list[str]:
    """Every problem with the directories a restore of this snapshot would materialize:
    trees files, names, trees (each read within ``budget``), and every file blob (read
    and hashed, each once). ``progress`` hears of each directory verified."""
    directories, unreadable = snapshot_directories(checkpoint_path, manifest, budget)
    if moved := moved_blob_store(checkpoint_path, manifest):
        return [moved]  # not a missing blob per file: the snapshot is not where it was
    problems = [f"trees file {name}: {why}" for name, why in sorted(unreadable.items())]
    where = blob_store_of(checkpoint_path, manifest)
    if where is None:
        return problems
    store = BlobStore(where, folder_at)
    checked: dict[bytes, str | None] = {}
    total = len(directories)
    if progress is not None and total:
        progress(CatalogProgress("directories verified", 0, total))
    for done, d in enumerate(sorted(directories.values(), key=lambda d: d.rollout_id), 1):
        problems += _directory_problems(d, store, checked)
        if progress is not None:
            progress(CatalogProgress("directories verified", done, total, d.rollout_id))
    return problems


def _directory_problems(d: SessionDirectory, store: BlobStore,
                        checked: dict[bytes, str | None]) -> list[str]:
    """The problems of one directory's tree and file blobs; ``checked``, each blob's
    verdict so far (a blob shared by directories is read once)."""
    if d.tree is None:
        return [f"directory of {d.rollout_id}: {d.error}"]
    problems: list[str] = []
    if d.memory is not None:
        digest, size = d.memory
        if digest not in checked:
            try:
                store.read(digest, size)
                checked[digest] = None
            except NemoCkptError as exc:
                checked[digest] = str(exc)
        if checked[digest] is not None:
            problems.append(f"container of {d.rollout_id}, its processes' memory: "
                            f"{checked[digest]}")
    for path, e in sorted(d.tree.items()):
        if e.kind not in (FILE, SPARSE):
            continue
        if e.data not in checked:
            try:
                data = store.read(e.data, e.size)
                if e.kind == SPARSE:
                    sparse_layout(data, path)
                checked[e.data] = None
            except NemoCkptError as exc:
                checked[e.data] = str(exc)
        if checked[e.data] is not None:
            problems.append(f"directory of {d.rollout_id}, {path}: {checked[e.data]}")
    return problems
