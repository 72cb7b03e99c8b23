"""Content-addressed blobs: the files of sandbox directories, stored once by digest.

Two places hold blobs:

- ``BlobCache`` (``nemo_ckpt.trees.node_cache``), in each holder (small blobs in
  memory, the rest in ``<sandbox_root>/.nemo-ckpt/<namespace>/<instance>/blobs``): what a
  turn commit's scan read, kept until no live session of that holder references it. Not
  fsynced: it only serves the holder's live sessions and its next snapshots, which die
  with the holder anyway.
- ``BlobStore``, shared by every snapshot under a checkpoint root
  (``<checkpoint_root>/blobs/<2 hex>/<32 hex>``): written by snapshots, durably, before
  their manifest; a blob already there is never written again, so snapshots are
  incremental and deduplicated across turns, rollouts and snapshots.

A blob's name is the XXH3-128 of its content, and a read checks it: a blob that does
not match is refused (``BlobCorruptedError``), never restored.

Snapshots and collection exclude each other through claims in the store's root folder
(``BlobStore.claims``, ``nemo_ckpt.trees.blob_claims``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

from nemo_ckpt.errors import BlobCorruptedError, CheckpointPathError
from nemo_ckpt.storage.folder import Folder, Sink
from nemo_ckpt.storage.local_folder import open_regular
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.storage.manifest import BLOB_DIR  # the store's folder: the format's name
from nemo_ckpt.trees.blob_claims import BlobClaims

__all__ = ["BLOB_DIR", "BlobStore", "digest_of", "hex_of"]

_CHUNK = 4 << 20


def digest_of(data: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def hex_of(digest: bytes) -> str:
    return digest.hex()


class BlobStore:
    """The blobs shared under one checkpoint root (see the module docstring)."""

    def __init__(self, where: str, folder_at: Callable[[str], Folder]) -> None:
        self.where = where
        self._folder_at = folder_at
        self._root = folder_at(where)
        self._folders: dict[str, Folder] = {}
        self.claims = BlobClaims(where, self._root)

    def _folder(self, prefix: str) -> Folder:
        folder = self._folders.get(prefix)
        if folder is None:
            folder = self._folders[prefix] = self._folder_at(join_location(self.where, prefix))
        return folder

    def describe(self, digest: bytes) -> str:
        name = hex_of(digest)
        return self._folder(name[:2]).describe(name)

    def missing(self, digests: Iterable[bytes]) -> set[bytes]:
        """Of ``digests``, those the store lacks (one listing per fan-out folder)."""
        by_prefix: dict[str, set[bytes]] = {}
        for d in digests:
            by_prefix.setdefault(hex_of(d)[:2], set()).add(d)
        lacking: set[bytes] = set()
        for prefix, wanted in by_prefix.items():
            present = set(self._folder(prefix).names())
            lacking.update(d for d in wanted if hex_of(d) not in present)
        return lacking

    def put(self, digest: bytes, source: Path | bytes) -> int:
        """Store ``source``'s content (a file's, or these bytes) as ``digest`` durably;
        returns its length. The content is hashed as it is copied: a source that
        changed is refused."""
        name = hex_of(digest)
        folder = self._folder(name[:2])
        folder.prepare()
        if isinstance(source, bytes):
            if digest_of(source) != digest:
                raise BlobCorruptedError(
                    folder.describe(name),
                    f"the blob held in memory as {name} no longer matches its digest")
            folder.write_bytes(name, source)
            return len(source)
        hasher = xxhash.xxh3_128()

        def fill(sink: Sink) -> None:
            with os.fdopen(open_regular(source), "rb", buffering=0) as f:
                while chunk := f.read(_CHUNK):
                    hasher.update(chunk)
                    sink.write(chunk, copy=True)
            if hasher.digest() != digest:
                raise BlobCorruptedError(
                    source, f"cached blob {source} no longer matches its digest {name}; "
                            f"it was changed on disk after it was cached")

        return folder.write_stream(name, fill)

    def read(self, digest: bytes, size: int | None = None) -> bytes:
        """The content of ``digest``, verified; ``BlobCorruptedError`` when it is missing
        or does not match."""
        name = hex_of(digest)
        folder = self._folder(name[:2])
        try:
            data = folder.read(name)
        except FileNotFoundError:
            raise BlobCorruptedError(
                folder.describe(name),
                f"blob {folder.describe(name)} is missing from the blob store, but a "
                f"snapshot references it: restore an earlier checkpoint") from None
        except OSError as exc:
            raise CheckpointPathError(
                folder.describe(name), f"cannot read blob {folder.describe(name)}: "
                                       f"{exc.strerror or exc}") from exc
        if (size is not None and len(data) != size) or digest_of(data) != digest:
            raise BlobCorruptedError(
                folder.describe(name),
                f"blob {folder.describe(name)} does not match its digest (damaged or "
                f"overwritten): restore an earlier checkpoint")
        return data

    def size(self, digest: bytes) -> int:
        name = hex_of(digest)
        return self._folder(name[:2]).size(name)

    def remove_temp_files(self) -> int:
        """Remove what writes that died left in the fan-out folders (call it only while
        collecting: no write runs then). Returns how many."""
        removed = 0
        for prefix in self._root.subfolders():
            if len(prefix) != 2:
                continue
            folder = self._folder(prefix)
            stale = [n for n in folder.names() if n.startswith(".") and ".tmp-" in n]
            folder.remove(stale)
            removed += len(stale)
        return removed

    def digests(self) -> set[bytes]:
        """Every blob the store holds."""
        found: set[bytes] = set()
        for prefix in self._root.subfolders():
            if len(prefix) != 2:
                continue
            for name in self._folder(prefix).names():
                with contextlib.suppress(ValueError):
                    if len(name) == 32 and name.startswith(prefix):
                        found.add(bytes.fromhex(name))
        return found

    def remove(self, digests: Iterable[bytes]) -> None:
        by_prefix: dict[str, list[str]] = {}
        for d in digests:
            name = hex_of(d)
            by_prefix.setdefault(name[:2], []).append(name)
        for prefix, names in by_prefix.items():
            self._folder(prefix).remove(names)
