"""How a snapshot stores its sessions' sandbox directories (manifest format 4).

Beside each holder's shard, a *trees file* lists, per session that owns a directory, the
digest of its tree (``nemo_ckpt.sandbox``); trees and the files they name are blobs in
the root's ``BlobStore`` (``nemo_ckpt.blobs``), so a snapshot writes only the blobs the
store lacks, and an unchanged directory costs its row in the trees file.

Trees file: a msgpack header map, then ``[[rollout_id, attempt, tree digest, tree
length], ...]`` in the shard's session order (sessions without a directory are left
out). It is written and verified like a shard: length and hash in the manifest
(``TreesEntry``), durable before the manifest.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgpack

from nemo_ckpt.blobs import BLOB_DIR, BlobCache, BlobStore
from nemo_ckpt.errors import SandboxError, ShardCorruptedError
from nemo_ckpt.folder import Folder, Sink
from nemo_ckpt.location import join_location, levels_below, parent_location
from nemo_ckpt.manifest import Manifest, TreesEntry
from nemo_ckpt.sandbox import FILE, Tree, decode_tree

__all__ = ["TreeRow", "write_trees_file", "read_trees_file", "blob_store_ref",
           "blob_store_of", "persist_blobs", "BlobsWritten", "fetch_tree", "tree_refs"]

TREES_MAGIC = "nemo-ckpt-trees"
TREES_VERSION = 1

# (rollout_id, attempt, tree digest, tree length)
TreeRow = tuple[str, int, bytes, int]


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


def write_trees_file(directory: Folder, name: str, instance_id: str, rows: list[TreeRow],
                     blobs: int, written: BlobsWritten) -> TreesEntry:
    from nemo_ckpt.storage import write_hashed

    def fill(sink: Sink) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        sink.write(packer.pack({"format": TREES_MAGIC, "version": TREES_VERSION,
                                "instance_id": instance_id, "sandboxes": len(rows)}))
        sink.write(packer.pack([list(r) for r in rows]))

    length, digest = write_hashed(directory, name, fill)
    return TreesEntry(file=name, bytes=length, content_hash=digest, sandboxes=len(rows),
                      blobs=blobs, new_blobs=written.count, new_blob_bytes=written.bytes)


def read_trees_file(directory: Folder, entry: TreesEntry, instance_id: str) -> list[TreeRow]:
    """A trees file's rows, once its length and hash match ``entry``."""
    from nemo_ckpt.storage import read_verified

    path, data = read_verified(directory, entry)
    try:
        unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
        header = unpacker.unpack()
        rows: Any = unpacker.unpack()
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise ShardCorruptedError(path, f"trees file {path} does not decode ({exc})") from exc
    if not (isinstance(header, dict) and header.get("format") == TREES_MAGIC
            and header.get("version") == TREES_VERSION
            and header.get("instance_id") == instance_id
            and isinstance(rows, list) and len(rows) == entry.sandboxes
            and all(isinstance(r, list) and len(r) == 4 and isinstance(r[0], str)
                    and type(r[1]) is int and isinstance(r[2], bytes) and len(r[2]) == 16
                    and type(r[3]) is int for r in rows)):
        raise ShardCorruptedError(path, f"trees file {path} matches its hash but is not a "
                                        f"nemo-ckpt trees file of {instance_id} holding "
                                        f"{entry.sandboxes} trees; restore an earlier checkpoint")
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def tree_refs(tree: Tree) -> set[bytes]:
    """The file blobs ``tree`` references."""
    return {e.data for e in tree.values() if e.kind == FILE}


class BlobsWritten:
    """What ``persist_blobs`` wrote."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0


def persist_blobs(store: BlobStore, cache: BlobCache, needed: Iterable[bytes],
                  clock: Callable[[], float] = time.time,
                  deadline: float | None = None) -> BlobsWritten:
    """Make every blob of ``needed`` durable in ``store``, copying from ``cache`` those it
    lacks. Call it with the store held by the snapshot (``BlobStore.hold``): it first
    waits out a collection that began before the hold (``clock`` is the wall clock the
    claims are written in)."""
    store.wait_for_collection(clock=clock, deadline=deadline)
    written = BlobsWritten()
    for digest in sorted(store.missing(needed)):
        source = cache.path(digest)
        if not source.exists():
            raise SandboxError(
                f"blob {digest.hex()} of a captured sandbox is neither in the blob store "
                f"{store.where} nor in this holder's cache {cache.directory}; something "
                f"removed it from the cache")
        written.bytes += store.put(digest, source)
        written.count += 1
    return written


def fetch_tree(store: BlobStore, cache: BlobCache | None, digest: bytes, size: int,
               where: str) -> Tree:
    """The tree of ``digest``, from the cache or the store, verified and checked safe."""
    data = cache.read(digest, size) if cache is not None else None
    if data is None:
        data = store.read(digest, size)
        if cache is not None:
            cache.put(digest, data)
    return decode_tree(data, where)
