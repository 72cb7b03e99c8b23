"""Content-addressed blobs: the files of sandbox directories, stored once by digest.

Two places hold blobs:

- ``BlobCache``, in each holder (small blobs in memory, the rest in
  ``<sandbox_root>/.nemo-ckpt/<namespace>/<instance>/blobs``): what a turn commit's scan read, kept
  until no live session of that holder references it. Not fsynced: it only serves the
  holder's live sessions and its next snapshots, which die with the holder anyway.
- ``BlobStore``, shared by every snapshot under a checkpoint root
  (``<checkpoint_root>/blobs/<2 hex>/<32 hex>``): written by snapshots, durably, before
  their manifest; a blob already there is never written again, so snapshots are
  incremental and deduplicated across turns, rollouts and snapshots.

A blob's name is the XXH3-128 of its content, and a read checks it: a blob that does
not match is refused (``BlobCorruptedError``), never restored.

Collection and the snapshots that rely on blobs already stored must exclude each other
(a snapshot that found a blob present must not see it removed before its manifest
commits). Both sides write a claim in the store's root folder first and read the
others' after, so of two that overlap at least one sees the other:

1) (coordinator, each snapshot) ``hold(op)`` beside its path claim; renewed with it;
2) (each holder, in its persist) ``wait_for_collection()``, then ``missing(...)`` and
   ``put`` for those; the shard names what it references;
3) (coordinator) the manifest commits, then ``release(op)``;
4) (collector: after a commit, or ``nemo-ckpt gc``) ``begin_collection()``: refused while
   any snapshot holds the store; then removes blobs no committed manifest references,
   each removal within its claim's life; ``end_collection()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

from nemo_ckpt.errors import BlobCorruptedError, CheckpointPathBusyError
from nemo_ckpt.folder import Folder, Sink
from nemo_ckpt.location import join_location

__all__ = ["BLOB_DIR", "BlobStore", "BlobCache", "digest_of", "hex_of", "COLLECTOR"]

BLOB_DIR = "blobs"
COLLECTOR = "collector"  # the operation name of a collection's claim
_CLAIM_PREFIX = ".claim-"
_CHUNK = 4 << 20
_WHOLE_READ = 8 << 20  # content up to this is hashed and kept in one piece


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
            with open(source, "rb", buffering=0) as f:
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

    # --- claims (see the module docstring) ---------------------------------------------

    def _claims(self) -> dict[str, tuple[str, float]]:
        claims: dict[str, tuple[str, float]] = {}
        for name in self._root.names():
            if not (name.startswith(_CLAIM_PREFIX) and name.endswith(".json")):
                continue
            try:
                data = json.loads(self._root.read(name))
                claims[str(data["operation"])] = (str(data["owner"]), float(data["expires_at"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return claims

    def _write_claim(self, operation: str, owner: str, expires_at: float) -> None:
        self._root.prepare()
        self._root.write_bytes(_claim_name(operation), json.dumps(
            {"operation": operation, "owner": owner, "expires_at": expires_at}).encode(),
            sync=False)

    def hold(self, operation: str, owner: str, now: float, ttl_s: float) -> None:
        """A snapshot relies on the store until ``now + ttl_s`` (repeat to renew)."""
        self._write_claim(operation, owner, now + ttl_s)

    def release(self, operation: str) -> None:
        self._root.remove([_claim_name(operation)])

    def collection_until(self, now: float) -> float | None:
        """When the live collection's claim expires, or None if none is live."""
        claim = self._claims().get(COLLECTOR)
        return claim[1] if claim is not None and claim[1] > now else None

    def wait_for_collection(self, clock: Callable[[], float] = time.time,
                            sleep: Callable[[float], None] = time.sleep,
                            deadline: float | None = None) -> None:
        """Return once no collection runs (call it after ``hold``): a collection that
        began before the hold may still remove blobs, so none may be relied on yet."""
        while (until := self.collection_until(clock())) is not None:
            if deadline is not None and clock() >= deadline:
                raise CheckpointPathBusyError(
                    f"the blob store {self.where} is being collected until {until:.0f} "
                    f"(epoch seconds); the snapshot cannot rely on it before then")
            sleep(min(0.05, max(0.0, until - clock())))

    def begin_collection(self, owner: str, now: float, ttl_s: float) -> float:
        """Claim the store for a collection until ``now + ttl_s`` and return that time,
        or ``CheckpointPathBusyError`` while a snapshot holds it or another collection
        runs."""
        others = {op: c for op, c in self._claims().items() if c[1] > now}
        if COLLECTOR in others:
            raise CheckpointPathBusyError(
                f"the blob store {self.where} is already being collected by "
                f"{others[COLLECTOR][0]}")
        until = now + ttl_s
        self._write_claim(COLLECTOR, owner, until)
        holding = sorted(op for op, (_, exp) in self._claims().items()
                         if op != COLLECTOR and exp > now)
        if holding:
            self.end_collection()
            raise CheckpointPathBusyError(
                f"the blob store {self.where} is in use by snapshot(s) {holding[:5]}; "
                f"collect once they have committed or lapsed")
        return until

    def renew_collection(self, owner: str, now: float, ttl_s: float) -> float:
        """Extend this collection's claim (a snapshot that held the store meanwhile
        waits for it to end); returns the new expiry."""
        self._write_claim(COLLECTOR, owner, now + ttl_s)
        return now + ttl_s

    def end_collection(self) -> None:
        self.release(COLLECTOR)

    def clear_dead_collection(self, owner: str) -> bool:
        """Drop a collection claim of ``owner`` that its owner knows it is not running
        (a predecessor coordinator that died mid-collection): snapshots need not wait
        for it to expire. Returns whether there was one."""
        claim = self._claims().get(COLLECTOR)
        if claim is None or claim[0] != owner:
            return False
        self.end_collection()
        return True


def _claim_name(operation: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in operation)
    return f"{_CLAIM_PREFIX}{safe}.json"


class BlobCache:
    """A holder's blobs on its node (see the module docstring).

    Small blobs (tree objects, small files) are held in memory up to ``memory_budget``
    bytes, and the rest in files: a turn commit that changed a small file then creates
    no file of its own (creating one is most of a capture's cost on a busy disk;
    ``benchmarks/sandboxes.py``). Both tiers die with the holder, as its sessions do."""

    def __init__(self, directory: Path, memory_budget: int = 128 << 20,
                 memory_blob_max: int = 1 << 20) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.memory_budget = memory_budget
        self.memory_blob_max = memory_blob_max
        self._memory: dict[bytes, bytes] = {}
        self.memory_bytes = 0

    def path(self, digest: bytes) -> Path:
        return self.directory / hex_of(digest)

    def held(self, digest: bytes) -> bytes | None:
        """``digest``'s content if it is held in memory."""
        return self._memory.get(digest)

    def store(self, chunks: Iterable[bytes]) -> tuple[bytes, int]:
        """Keep the content ``chunks`` make up, and return its digest and length. What the
        chunks raise propagates, and nothing of that content is kept."""
        head: list[bytes] = []
        length = 0
        it = iter(chunks)
        for chunk in it:
            head.append(chunk)
            length += len(chunk)
            if length > _WHOLE_READ:
                return self._store_stream(head, it)
        data = head[0] if len(head) == 1 else b"".join(head)
        digest = digest_of(data)
        self.put(digest, data)
        return digest, length

    def _store_stream(self, head: list[bytes], rest: Iterable[bytes]) -> tuple[bytes, int]:
        hasher = xxhash.xxh3_128()
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        length = 0
        try:
            with open(tmp, "xb") as out:
                for chunks in (head, rest):
                    for chunk in chunks:
                        hasher.update(chunk)
                        out.write(chunk)
                        length += len(chunk)
            digest = hasher.digest()
            if self.has(digest):
                tmp.unlink()
            else:
                os.replace(tmp, self.path(digest))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return digest, length

    def put(self, digest: bytes, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` (already verified as ``digest``)."""
        if digest in self._memory:
            return
        n = len(data)
        if n <= self.memory_blob_max and self.memory_bytes + n <= self.memory_budget:
            self._memory[digest] = bytes(data)
            self.memory_bytes += n
        elif not self.path(digest).exists():
            self._place(digest, data)

    def _place(self, digest: bytes, data: bytes | bytearray | memoryview) -> None:
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as out:
                out.write(data)
            os.replace(tmp, self.path(digest))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, digest: bytes, size: int | None = None) -> bytes | None:
        """The content of ``digest`` if cached and intact, else None."""
        data = self._memory.get(digest)
        if data is not None:
            return data if size is None or len(data) == size else None
        try:
            data = self.path(digest).read_bytes()
        except FileNotFoundError:
            return None
        if (size is not None and len(data) != size) or digest_of(data) != digest:
            return None
        return data

    def has(self, digest: bytes) -> bool:
        return digest in self._memory or self.path(digest).exists()

    def remove(self, digests: Iterable[bytes]) -> None:
        for d in digests:
            data = self._memory.pop(d, None)
            if data is not None:
                self.memory_bytes -= len(data)
            else:
                self.path(d).unlink(missing_ok=True)
