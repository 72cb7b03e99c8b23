"""Hashed writes and verified reads: a file written with its content hash computed on the
way out (never by reading it back), and read back only once its length and hash match
what the manifest says.

A file appears under its name only once complete and durable (the ``Folder``'s promise).
A verified file is decoded only once its hash matches, so a crafted or damaged file costs
at most its own length in memory; ``view_unpacker`` then decodes it without a copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from nemo_ckpt.errors import (
    CheckpointPathError,
    ShardCorruptedError,
    TornSnapshotError,
    UnsafeShardNameError,
)
from nemo_ckpt.storage.checkpoint_folder import as_folder
from nemo_ckpt.storage.folder import Folder, Sink
from nemo_ckpt.storage.manifest import ShardChunks, ShardEntry, TreesEntry, is_plain_file_name

__all__ = ["CHUNK_BYTES", "CONTENT_HASH", "content_hasher", "read_verified",
           "read_verified_chunks", "view_unpacker", "write_chunk_hashed", "write_hashed"]

# XXH3-128 detects torn and corrupted files as well as SHA-256 does, at ~25 GB/s a core
# instead of ~2: a cryptographic hash buys nothing here (whoever can rewrite a shard can
# rewrite the manifest too) and made persist and restore CPU-bound.
CONTENT_HASH = "xxh3-128"
_HASHERS: dict[str, Any] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}
# A shard's chunks (manifest format 6): the unit a restore verifies, then decodes, while
# the next ones are read; small enough to overlap a 16 MB shard's read in 16 steps, large
# enough that a million-session shard's manifest entry stays kilobytes.
CHUNK_BYTES = 1 << 20


def content_hasher(algorithm: str = CONTENT_HASH) -> Any:
    """A fresh hasher (``update``, ``hexdigest``) for a manifest's hash algorithm."""
    try:
        return _HASHERS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown content hash algorithm {algorithm!r}; "
                         f"one of {sorted(_HASHERS)}") from None


def _split_hash(content_hash: str) -> tuple[str, str]:
    algorithm, _, digest = content_hash.partition(":")
    return algorithm, digest


class _HashingSink:
    """Hashes every byte on its way to the folder, in the order written: the whole file,
    and each chunk of ``chunk`` bytes when asked."""

    def __init__(self, sink: Sink, chunk: int | None) -> None:
        self._sink = sink
        self.hash = content_hasher()
        self._chunk = chunk
        self._chunk_hash = content_hasher()
        self._in_chunk = 0
        self.chunk_hashes: list[str] = []

    def write(self, data: bytes | bytearray | memoryview, copy: bool = False) -> None:
        self.hash.update(data)
        if self._chunk is not None:
            view = memoryview(data).cast("B")
            while view:
                take = min(len(view), self._chunk - self._in_chunk)
                self._chunk_hash.update(view[:take])
                self._in_chunk += take
                view = view[take:]
                if self._in_chunk == self._chunk:
                    self._end_chunk()
        self._sink.write(data, copy)

    def _end_chunk(self) -> None:
        self.chunk_hashes.append(self._chunk_hash.hexdigest())
        self._chunk_hash = content_hasher()
        self._in_chunk = 0

    def finish(self) -> None:
        if self._in_chunk:
            self._end_chunk()


def write_hashed(directory: Folder | Path, name: str,
                 fill: Callable[[Sink], None]) -> tuple[int, str]:
    """Write ``name`` in ``directory`` through ``fill(sink)``; return (length, content
    hash as ``<algorithm>:<hex>``). The hash is computed while writing, never by reading
    the file back. The file appears under its name only once complete and durable; on
    any failure nothing stays and ``SnapshotWriteError`` says where and why."""
    length, digest, _ = _write(directory, name, fill, None)
    return length, digest


def write_chunk_hashed(directory: Folder | Path, name: str, fill: Callable[[Sink], None]
                       ) -> tuple[int, str, ShardChunks]:
    """``write_hashed``, and the hash of each ``CHUNK_BYTES`` of the file (format 6)."""
    length, digest, chunks = _write(directory, name, fill, CHUNK_BYTES)
    return length, digest, ShardChunks(bytes=CHUNK_BYTES, hashes=chunks)


def _write(directory: Folder | Path, name: str, fill: Callable[[Sink], None],
           chunk: int | None) -> tuple[int, str, list[str]]:
    if not is_plain_file_name(name):
        raise ValueError(f"{name!r} is not a plain file name")
    hashing: list[_HashingSink] = []

    def hashed_fill(sink: Sink) -> None:
        hashing.append(_HashingSink(sink, chunk))
        fill(hashing[0])
        hashing[0].finish()

    length = as_folder(directory).write_stream(name, hashed_fill)
    return length, f"{CONTENT_HASH}:{hashing[0].hash.hexdigest()}", hashing[0].chunk_hashes


def read_verified_chunks(directory: Folder | Path, entry: ShardEntry
                         ) -> tuple[str, Iterator[memoryview]]:
    """Shard ``entry`` (format 6) chunk by chunk, each one yielded only once its hash
    matches the manifest's, read ahead while the caller decodes the one before. The
    iterator raises ``ShardCorruptedError`` at the first chunk that does not match or is
    short, or a surplus; at its end, the whole file's length and hash are checked too.
    ``TornSnapshotError`` when the file is missing, ``CheckpointPathError`` when it
    cannot be read."""
    folder = as_folder(directory)
    if not is_plain_file_name(entry.file):
        raise UnsafeShardNameError(
            folder.describe(), f"shard name {entry.file!r} is not a plain file name in "
                               f"{folder.describe()}")
    if entry.chunks is None:
        raise ValueError(f"shard {entry.file} has no chunk hashes (format < 6)")
    return folder.describe(entry.file), _verified_chunks(folder, entry, entry.chunks)


def _verified_chunks(folder: Folder, entry: ShardEntry,
                     chunks: ShardChunks) -> Iterator[memoryview]:
    path = folder.describe(entry.file)
    algorithm, expected = _split_hash(entry.content_hash)
    whole = content_hasher(algorithm)
    count = len(chunks.hashes)
    at = 0
    guarded = _guarded(lambda: folder.read_chunks(entry.file, entry.bytes, chunks.bytes),
                       path)
    try:
        for i, piece in enumerate(guarded):
            if i >= count:
                raise ShardCorruptedError(
                    path, f"shard {path} is longer than the {entry.bytes} bytes the manifest "
                          f"says: it was overwritten; restore an earlier checkpoint")
            want = min(chunks.bytes, entry.bytes - at)
            if len(piece) != want:
                raise _short(path, entry, at + len(piece))
            digest = content_hasher(algorithm)
            digest.update(piece)
            if digest.hexdigest() != chunks.hashes[i]:
                raise ShardCorruptedError(
                    path, f"chunk {i + 1} of {count} of shard {path} (bytes {at}-"
                          f"{at + want}) has {algorithm} {digest.hexdigest()}, but the "
                          f"manifest says {chunks.hashes[i]}: its content changed after "
                          f"the snapshot; restore an earlier checkpoint")
            whole.update(piece)
            at += want
            yield piece
    finally:
        guarded.close()  # stops the readers of a read left early
    if at != entry.bytes:
        raise _short(path, entry, at)
    if whole.hexdigest() != expected:
        raise ShardCorruptedError(
            path, f"shard {path} has {algorithm} {whole.hexdigest()}, but the manifest says "
                  f"{expected}, though each chunk matches: the manifest was altered; "
                  f"restore an earlier checkpoint")


def _short(path: str, entry: ShardEntry, got: int) -> ShardCorruptedError:
    return ShardCorruptedError(
        path, f"shard {path} ends after {got} bytes, but the manifest says {entry.bytes}: "
              f"it was truncated or overwritten; restore an earlier checkpoint")


def _guarded(pieces: Callable[[], Iterator[memoryview]], path: str
             ) -> Generator[memoryview]:
    """What ``pieces()`` yields, with a missing file and a failed read as the errors a
    restore names, whether the folder raises them when called or while iterated."""
    try:
        yield from pieces()
    except FileNotFoundError:
        raise TornSnapshotError(
            path, f"shard {path}, named in the manifest, is missing: the snapshot is torn "
                  f"(files were removed or not copied); restore an earlier checkpoint"
        ) from None
    except OSError as exc:
        raise CheckpointPathError(
            path, f"cannot read shard {path}: {exc.strerror or exc}") from exc


def read_verified(directory: Folder | Path, entry: ShardEntry | TreesEntry
                  ) -> tuple[str, memoryview]:
    """The bytes of shard ``entry``, once their length and hash match the manifest: a
    view of the buffer they were read into (``view_unpacker`` decodes it)."""
    folder = as_folder(directory)
    if not is_plain_file_name(entry.file):
        raise UnsafeShardNameError(
            folder.describe(), f"shard name {entry.file!r} is not a plain file name in "
                               f"{folder.describe()}")
    path = folder.describe(entry.file)
    algorithm, expected = _split_hash(entry.content_hash)
    digest = content_hasher(algorithm)
    try:
        # One request: a longer file shows as one byte too many (a bucket's HEAD first
        # would add a round trip to every shard); its true size only for the message.
        data = folder.read_view(entry.file, entry.bytes + 1)
        if len(data) != entry.bytes:
            size = folder.size(entry.file)
            raise ShardCorruptedError(
                path, f"shard {path} is {size} bytes, but the manifest says "
                      f"{entry.bytes}: it was truncated or overwritten; restore an "
                      f"earlier checkpoint"
            )
    except FileNotFoundError:
        raise TornSnapshotError(
            path, f"shard {path}, named in the manifest, is missing: the snapshot is torn "
                  f"(files were removed or not copied); restore an earlier checkpoint or "
                  f"copy the whole {folder.describe()} again"
        ) from None
    except OSError as exc:
        raise CheckpointPathError(
            path, f"cannot read shard {path}: {exc.strerror or exc}"
        ) from exc
    digest.update(data)
    if digest.hexdigest() != expected:
        raise ShardCorruptedError(
            path, f"shard {path} has {algorithm} {digest.hexdigest()}, but the manifest says "
                  f"{expected}: its content changed after the snapshot; restore an "
                  f"earlier checkpoint"
        )
    return path, data


# How much of a shard's view the unpacker copies in at a time: its buffer, reused.
_UNPACK_READ_BYTES = 1 << 20


def view_unpacker(view: memoryview) -> msgpack.Unpacker:
    """A ``msgpack.Unpacker`` over a verified file's view, copying in only what it
    decodes next (``io.BytesIO`` of a view copies all of it); an object may be as large
    as the file."""
    return msgpack.Unpacker(_ViewReader(view), raw=False, read_size=_UNPACK_READ_BYTES,
                            max_buffer_size=max(len(view), 1 << 20))


class _ViewReader:
    """A read-only file over a view."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._at = 0

    def read(self, size: int = -1) -> bytes:
        start = self._at
        end = len(self._view) if size is None or size < 0 else min(len(self._view),
                                                                     start + size)
        self._at = end
        return bytes(self._view[start:end])
