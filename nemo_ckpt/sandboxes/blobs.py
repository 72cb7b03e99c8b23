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

Claims carry no time to compare: each reader judges them on its own monotonic clock
(``nemo_ckpt.storage.claims``), so a host whose clock is ahead cannot take a live hold as over.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

from nemo_ckpt.errors import (
    BlobCorruptedError,
    CheckpointPathBusyError,
    CheckpointPathError,
    NemoCkptError,
)
from nemo_ckpt.storage.claims import (
    STALE_FACTOR,
    Claim,
    ClaimWatch,
    decode_claim,
    encode_claim,
    write_claim,
)
from nemo_ckpt.storage.folder import Folder, Sink, remove_if_holds
from nemo_ckpt.storage.location import join_location

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
        # This collection's claim, every write of it (the last one may have failed and
        # landed all the same); empty when none runs.
        self._collecting: list[bytes] = []

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

    # --- claims (see the module docstring) ---------------------------------------------

    def _claims(self) -> dict[str, tuple[Claim, bytes]]:
        """Every claim, by operation, with the bytes it was read from (one gone since the
        listing, or not a claim at all, is skipped). A claim that cannot be read raises
        ``CheckpointPathError``: skipped, a hold could let a collection remove what its
        snapshot relies on."""
        claims: dict[str, tuple[Claim, bytes]] = {}
        for name in self._root.names():
            if not (name.startswith(_CLAIM_PREFIX) and name.endswith(".json")):
                continue
            try:
                data = self._root.read(name)
            except FileNotFoundError:
                continue
            except OSError as exc:
                where = self._root.describe(name)
                raise CheckpointPathError(where, f"cannot read the claim {where}: "
                                                 f"{exc.strerror or exc}") from exc
            try:
                claim = decode_claim(data)
            except (ValueError, KeyError, TypeError):
                continue
            claims[claim.operation] = (claim, data)
        return claims

    def _observe(self, watch: ClaimWatch) -> tuple[dict[str, tuple[Claim, bytes]],
                                                    dict[str, float]]:
        claims = self._claims()
        return claims, watch.observe(self.where, [c for c, _ in claims.values()])

    def hold(self, operation: str, owner: str, ttl_s: float) -> None:
        """A snapshot relies on the store for ``ttl_s`` seconds (repeat to renew)."""
        self._root.prepare()
        data, _ = encode_claim(operation, owner, ttl_s)
        self._root.write_bytes(_claim_name(operation), data, sync=False)

    def release(self, operation: str) -> None:
        self._root.remove([_claim_name(operation)])

    def live_collection(self, watch: ClaimWatch) -> Claim | None:
        """The collection's claim, unless none is there or ``watch`` has seen it
        unchanged for its ttl (its collector died)."""
        claims, left = self._observe(watch)
        found = claims.get(COLLECTOR)
        return found[0] if found is not None and left[COLLECTOR] > 0 else None

    def wait_for_collection(self, clock: Callable[[], float] = time.monotonic,
                            sleep: Callable[[float], None] = time.sleep,
                            deadline: float | None = None,
                            watch: ClaimWatch | None = None) -> None:
        """Return once no collection runs (call it after ``hold``): a collection that
        began before the hold may still remove blobs, so none may be relied on yet. A
        collection's claim ends when its collector drops it, or once seen unchanged for
        its ttl on ``clock`` (this process's monotonic clock; ``deadline`` is on it).
        ``watch``, on ``clock``, kept by the caller across waits: a claim it saw before
        is taken as abandoned sooner than by a new one."""
        watch = watch or ClaimWatch(clock)
        while True:
            claims, left = self._observe(watch)
            if COLLECTOR not in claims or left[COLLECTOR] <= 0:
                return
            if deadline is not None and clock() >= deadline:
                raise CheckpointPathBusyError(
                    f"the blob store {self.where} is being collected by "
                    f"{claims[COLLECTOR][0].owner}; the snapshot cannot rely on it "
                    f"before that ends (or its claim is seen unchanged for "
                    f"{left[COLLECTOR]:.0f}s more)")
            sleep(min(0.05, left[COLLECTOR]))

    def begin_collection(self, owner: str, ttl_s: float, watch: ClaimWatch) -> None:
        """Claim the store for a collection of ``ttl_s`` seconds (renew it within that,
        on the collector's own clock), or ``CheckpointPathBusyError`` while a snapshot
        holds it or another collection runs, as ``watch`` judges them: a claim it sees
        for the first time is live. On a local folder, and on a bucket whose store
        enforces conditional writes, two collectors cannot both begin (an exclusive
        create); on other buckets the claim is advisory (docs/DESIGN.md)."""
        name = _claim_name(COLLECTOR)
        self._root.prepare()
        claims, left = self._observe(watch)
        if COLLECTOR in claims:
            claim, data = claims[COLLECTOR]
            if left[COLLECTOR] > 0:
                raise self._busy_collecting(claim.owner, left[COLLECTOR])
            # Abandoned: its collector died. Drop exactly the write judged so.
            if not remove_if_holds(self._root, name, (data,)) and \
                    self._root.version(name) is not None:
                raise self._busy_collecting(claim.owner, claim.ttl_s * STALE_FACTOR)
        data, _ = encode_claim(COLLECTOR, owner, ttl_s)
        try:
            # Our own claim met by a retry is ours; one that failed otherwise is gone.
            write_claim(self._root, name, data)
        except FileExistsError:
            raise self._busy_collecting("another collector", ttl_s * STALE_FACTOR) from None
        self._collecting = [data]
        try:
            claims, left = self._observe(watch)
        except BaseException:
            # Ours must not linger with no collection behind it: every snapshot's
            # persist would wait on it until it is taken as abandoned.
            self._drop_own(name)
            raise
        mine = claims.get(COLLECTOR)
        if mine is None or mine[1] != data:  # a bucket: another collector wrote since
            self._drop_own(name)
            raise self._busy_collecting(mine[0].owner if mine else "another collector",
                                        ttl_s * STALE_FACTOR)
        holding = {op: left[op] for op in claims if op != COLLECTOR and left[op] > 0}
        if holding:
            self.end_collection()
            raise CheckpointPathBusyError(
                f"the blob store {self.where} is in use by snapshot(s) "
                f"{sorted(holding)[:5]}; collect once they have committed (a hold whose "
                f"snapshot died is taken as abandoned once seen unchanged for "
                f"{max(holding.values()):.0f}s more)")

    def _drop_own(self, name: str) -> None:
        """Remove the claim ``name`` if it is still one this collection wrote (best
        effort: it expires by itself otherwise), and forget them."""
        ours, self._collecting = self._collecting, []
        with contextlib.suppress(OSError, NemoCkptError):
            remove_if_holds(self._root, name, ours)

    def _busy_collecting(self, owner: str, left_s: float) -> CheckpointPathBusyError:
        return CheckpointPathBusyError(
            f"the blob store {self.where} is already being collected by {owner} (a "
            f"collection whose collector died is taken as abandoned once its claim is "
            f"seen unchanged for {left_s:.0f}s more)")

    def renew_collection(self, owner: str, ttl_s: float) -> None:
        """Extend this collection's claim by ``ttl_s`` seconds from now (a snapshot that
        held the store meanwhile waits for it to end); ``CheckpointPathBusyError`` if
        the claim is no longer this collection's (it overran, and another took it)."""
        name = _claim_name(COLLECTOR)
        try:
            current: bytes | None = self._root.read(name)
        except FileNotFoundError:
            current = None
        if current is None or current not in self._collecting:
            self._collecting = []
            raise CheckpointPathBusyError(
                f"the collection of {self.where} lost its claim (it was renewed too late "
                f"and dropped); run it again")
        data, _ = encode_claim(COLLECTOR, owner, ttl_s)
        # Kept before the write: it may land and still raise, and the collection's end
        # must remove it then too.
        self._collecting.append(data)
        self._root.write_bytes(name, data, sync=False)

    def end_collection(self) -> None:
        """Drop this collection's claim (not another collector's that replaced it)."""
        ours, self._collecting = self._collecting, []
        if ours:
            remove_if_holds(self._root, _claim_name(COLLECTOR), ours)

    def clear_dead_collection(self, owner: str) -> bool:
        """Drop a collection claim of ``owner`` that its owner knows it is not running
        (a collection of this coordinator incarnation that ended without its release):
        snapshots need not wait for it to be seen abandoned. Returns whether there was
        one. A predecessor incarnation's claim is another owner's: it may run again."""
        claim = self._claims().get(COLLECTOR)
        if claim is None or claim[0].owner != owner:
            return False
        self.release(COLLECTOR)
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
