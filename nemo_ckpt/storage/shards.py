"""A shard: one holder's sessions in one file, written from their encoded parts as holders
keep them (``nemo_ckpt.session_record``) and read back verified.

A shard is a stream of msgpack objects: a header map, the index (one row per session,
readable without the rest), then each session's body, ``[turns, state]``. Reading
verifies the whole file's length and hash first (``nemo_ckpt.storage.hashed_files``), then what
it holds against its manifest entry; each refusal has its own exception class (see
``nemo_ckpt.errors``), and a refused read changes nothing on disk.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgpack

from nemo_ckpt.errors import (
    CheckpointPathError,
    ShardCorruptedError,
    TornSnapshotError,
    UnsafeShardNameError,
)
from nemo_ckpt.session_record import SessionRecord, body_head, record_of, record_parts
from nemo_ckpt.storage.checkpoint_folder import as_folder
from nemo_ckpt.storage.folder import Folder, Sink
from nemo_ckpt.storage.hashed_files import (
    read_verified,
    read_verified_chunks,
    view_unpacker,
    write_chunk_hashed,
)
from nemo_ckpt.storage.manifest import ShardEntry, is_plain_file_name

__all__ = ["SHARD_MAGIC", "SHARD_VERSION", "RolloutIndexEntry", "ShardParts", "read_shard",
           "read_shard_index", "read_shard_parts", "shard_problems", "write_shard",
           "write_shard_parts"]

SHARD_MAGIC = "nemo-ckpt-shard"
# Shard layouts: 3 (written): a header, the index (one row per session), then one
# payload per session (``nemo_ckpt.session_record``); 1 (read): a header, then one map per
# session (manifest formats 1 and 2).
SHARD_VERSION = 3
# Pieces of a shard's small sessions are joined into about this much before they go to
# the folder's sink; a state at least _DIRECT_WRITE long goes by reference, uncopied.
_DIRECT_WRITE = 16 << 10
_SMALL_PIECE_BUFFER = 256 << 10

# A session's turns blob or state as a read hands it on: a view of the verified bytes
# (kept alive by it), or bytes.
Bytes = bytes | memoryview


def write_shard(
    directory: Folder | Path, name: str, instance_id: str, sessions: Iterable[SessionRecord]
) -> ShardEntry:
    """Write ``sessions`` of ``instance_id`` as shard ``name`` (see ``write_shard_parts``)."""
    rows, bodies = [], []
    for record in sessions:
        if record.instance_id != instance_id:
            raise ValueError(
                f"session {record.episode.capture_key} belongs to "
                f"{record.instance_id}, not to shard instance {instance_id}"
            )
        row, turns_blob, state = record_parts(record)
        rows.append(row)
        bodies.append((turns_blob, state))
    index = msgpack.Packer().pack_array_header(len(rows)) + b"".join(rows)
    return write_shard_parts(directory, name, instance_id, index, len(rows), bodies)


def write_shard_parts(directory: Folder | Path, name: str, instance_id: str, index: bytes,
                      count: int,
                      bodies: Iterable[tuple[bytes | Sequence[Bytes], Bytes]]
                      ) -> ShardEntry:
    """Write one shard from sessions already encoded, as holders keep them, and return
    its manifest entry: ``index`` is the msgpack array of the ``count`` sessions' rows
    (a capture's ``captured_msgpack``), ``bodies`` yields each one's turns blob (or the
    pieces it is joined from, ``Held.turns_pieces``) and state in the same order.

    The shard is a stream of msgpack objects: a header map, the index, then each
    session's body, ``[turns, state]``. It is joined from those bytes as they are (big
    states by reference): nothing is re-encoded, no list per session is built (at a
    million small sessions each would be memory the snapshot adds), and the index can
    be read without the bodies.
    """

    def fill(w: Sink) -> None:
        packer = msgpack.Packer(use_bin_type=True)
        w.write(packer.pack({"format": SHARD_MAGIC, "version": SHARD_VERSION,
                             "instance_id": instance_id, "sessions": count}))
        # Written as it is (by reference when big): the capture already holds it.
        w.write(index)
        batch: list[Bytes] = []
        size = 0
        written = 0
        for turns_blob, state in bodies:
            written += 1
            head = body_head(turns_blob, len(state))
            if len(state) >= _DIRECT_WRITE:  # big: by reference, without a copy
                batch.append(head)
                w.write(b"".join(batch), copy=True)
                w.write(state)
                batch, size = [], 0
                continue
            batch += (head, state)
            size += len(head) + len(state)
            if size >= _SMALL_PIECE_BUFFER:
                w.write(b"".join(batch), copy=True)
                batch, size = [], 0
        if batch:
            w.write(b"".join(batch), copy=True)
        if written != count:
            raise ValueError(f"shard {name}: an index of {count} sessions, "
                             f"{written} bodies")

    length, digest, chunks = write_chunk_hashed(directory, name, fill)
    return ShardEntry(file=name, bytes=length, content_hash=digest, instance_id=instance_id,
                      sessions=count, chunks=chunks)


@dataclass(frozen=True)
class ShardParts:
    """A verified shard's sessions, still encoded: each one's decoded row
    (``[rollout_id, attempt, staging keys, turns, earlier capture keys]``), its turns
    blob and its state (views of the bytes read), in the shard's order."""

    instance_id: str
    rows: list[list[Any]]
    turns: list[Bytes]
    states: list[Bytes]

    def records(self) -> list[SessionRecord]:
        """Every session as a ``SessionRecord`` (decodes every turns blob)."""
        return [record_of(self.instance_id, row, turns, bytes(state))
                for row, turns, state in zip(self.rows, self.turns, self.states, strict=True)]


def read_shard(directory: Folder | Path, entry: ShardEntry) -> list[SessionRecord]:
    """Read and verify one shard (``read_shard_parts``), every session decoded."""
    parts = read_shard_parts(directory, entry)
    path = as_folder(directory).describe(entry.file)
    try:
        return parts.records()
    except ValueError as exc:
        raise _undecodable(path, str(exc)) from exc


def read_shard_parts(directory: Folder | Path, entry: ShardEntry) -> ShardParts:
    """Read one shard and verify its length and hash, then split it into sessions.

    Nothing is decoded before the whole file's hash matches the manifest's: a damaged
    or crafted file of N bytes costs N bytes of memory, never the objects it could
    unpack into. Then only the index is decoded; each session's turns blob and state
    are views of the verified bytes, uncopied (``_bodies``).
    Shards of the older layout (a map per session) are read too.

    A shard with chunk hashes (manifest format 6) is read as a stream instead: each chunk
    is decoded once its own hash matches, while the next ones are read
    (``read_verified_chunks``), so a crafted shard is never unpacked past a chunk that
    does not match, and memory holds the sessions plus a few chunks.
    """
    if entry.chunks is not None:
        return _streamed_parts(directory, entry, entry.chunks.bytes)
    path, data = read_verified(directory, entry)
    unpacker = view_unpacker(data)
    try:
        header = _header(unpacker, path, entry)
        if header.get("version") == 1:
            return _legacy_parts(path, entry, unpacker, len(data))
        if header.get("version") != SHARD_VERSION:
            raise _undecodable(path, f"shard layout {header.get('version')!r} is not one "
                                     f"this nemo-ckpt reads")
        rows = _index(unpacker, path, entry, header)
        stream = _VerifiedStream(iter((data,)))
        turns, states, end = _bodies(stream, unpacker.tell(), entry.sessions, len(data),
                                     path)
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise _undecodable(path, str(exc) or type(exc).__name__) from exc
    if end != len(data):
        raise _undecodable(path, f"{len(data) - end} trailing bytes")
    return ShardParts(entry.instance_id, rows, turns, states)


def _header(unpacker: msgpack.Unpacker, path: str, entry: ShardEntry) -> dict[str, Any]:
    """The shard's header, once it names this format and the entry's instance."""
    header = unpacker.unpack()
    if not isinstance(header, dict) or header.get("format") != SHARD_MAGIC:
        raise _undecodable(path, "no nemo-ckpt shard header")
    if header.get("instance_id") != entry.instance_id:
        raise _undecodable(path, f"header {header!r} does not fit the manifest entry "
                                 f"for {entry.instance_id}")
    return header


def _index(unpacker: msgpack.Unpacker, path: str, entry: ShardEntry,
           header: dict[str, Any]) -> list[Any]:
    """The shard's index, once it holds the sessions its header and manifest entry say."""
    rows = unpacker.unpack()
    if not isinstance(rows, list) or len(rows) != entry.sessions \
            or header.get("sessions") != entry.sessions:
        raise _undecodable(path, f"its index does not hold the {entry.sessions} "
                                 f"sessions the manifest says")
    return rows


def _streamed_parts(directory: Folder | Path, entry: ShardEntry, chunk: int) -> ShardParts:
    path, chunks = read_verified_chunks(directory, entry)
    stream = _VerifiedStream(chunks)
    try:
        unpacker = msgpack.Unpacker(stream, raw=False, read_size=chunk,
                                    max_buffer_size=max(entry.bytes, 1 << 20))
        try:
            header = _header(unpacker, path, entry)
            if header.get("version") != SHARD_VERSION:
                raise _undecodable(path, f"shard layout {header.get('version')!r} is not "
                                         f"the one a chunked shard has")
            rows = _index(unpacker, path, entry, header)
            # The bodies are parsed in place from here, not through msgpack's buffer.
            turns, states, end = _bodies(stream, unpacker.tell(), entry.sessions,
                                         entry.bytes, path)
        except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
            raise _undecodable(path, str(exc) or type(exc).__name__) from exc
        # Read to the end, so that the file's length and whole hash are checked.
        if end != entry.bytes or stream.pull():
            raise _undecodable(path, f"bytes after its last session, at {end}")
    finally:
        stream.close()
    return ShardParts(entry.instance_id, rows, turns, states)


def _bodies(stream: _VerifiedStream, at: int, count: int, length: int, path: str
            ) -> tuple[list[Bytes], list[Bytes], int]:
    """``count`` sessions' bodies, ``[turns, state]`` each, from offset ``at`` of a
    verified file of ``length`` bytes: each one's turns blob and state a view of the
    chunk holding it, uncopied (copied once where it spans two chunks). msgpack's
    ``Unpacker`` copied each chunk into its buffer and each state out again, and the
    fresh memory a copy needs cost more than the copy (benchmarks/README.md, the
    grid). Every length in the file is a claim: one past its end is refused before
    anything is read for it. Returns the turns blobs, the states, and the offset after
    the last body."""
    turns: list[Bytes] = []
    states: list[Bytes] = []
    byte, copy, view, keep = stream.byte, stream.copy, stream.view, stream.keep
    for _ in range(count):
        keep(at)
        if byte(at) != 0x92:
            raise _undecodable(path, "a session's body is not [turns, state]")
        start = at + 1
        tag = byte(start)
        if 0x90 <= tag <= 0x9f:
            n, at = tag & 0x0f, start + 1
        elif tag in (0xdc, 0xdd):
            size = 2 if tag == 0xdc else 4
            n, at = int.from_bytes(copy(start + 1, start + 1 + size), "big"), \
                start + 1 + size
        else:
            raise _undecodable(path, "a session's turns are not an array")
        if 2 * n > length - at:  # a turn record takes two bytes at least
            raise _undecodable(path, f"a session claims {n} turn records, more than "
                                     f"the shard's remaining {length - at} bytes hold")
        for _ in range(n):
            at = _bin_end(stream, at, length, path)[1]
        turns.append(view(start, at))
        data, at = _bin_end(stream, at, length, path)
        states.append(view(data, at))
    return turns, states, at


def _bin_end(stream: _VerifiedStream, at: int, length: int, path: str) -> tuple[int, int]:
    """Where the data of the msgpack bin object at ``at`` starts and ends."""
    tag = stream.byte(at)
    if tag == 0xc4:
        size, head = stream.byte(at + 1), 2
    elif tag in (0xc5, 0xc6):
        head = 3 if tag == 0xc5 else 5
        size = int.from_bytes(stream.copy(at + 1, at + head), "big")
    else:
        raise _undecodable(path, "a session's turn record or state is not bytes")
    end = at + head + size
    if end > length:
        raise _undecodable(path, f"a session's bytes claim {size} bytes at {at}, past "
                                 f"the shard's end")
    return at + head, end


class _VerifiedStream:
    """A shard's verified chunks, keeping the bytes from the last ``keep`` on: read as
    a file by msgpack (the header and the index), and read in place by offset
    (``byte``, ``copy``) for the sessions' bodies. ``pull`` is the one way a chunk
    comes in, each only once its hash matched."""

    def __init__(self, chunks: Iterator[memoryview]) -> None:
        self._chunks = chunks
        self._pieces: list[tuple[int, memoryview]] = []  # (offset, chunk), kept ones
        self._end = 0  # the offset after the last chunk taken
        self._at = 0  # what ``read`` has handed out

    def pull(self) -> bool:
        """Take the next verified chunk; False at the end (where the iterator checked
        the whole file's length and hash)."""
        chunk = next(self._chunks, None)
        if chunk is None:
            return False
        self._pieces.append((self._end, chunk))
        self._end += len(chunk)
        return True

    def _chunk_at(self, at: int) -> tuple[int, memoryview]:
        """The kept chunk holding offset ``at`` and its offset, pulling up to it."""
        while at >= self._end:
            if not self.pull():
                raise msgpack.OutOfData(f"the file ends before byte {at}")
        for offset, chunk in reversed(self._pieces):
            if offset <= at:
                return offset, chunk
        raise ValueError(f"byte {at} is before the bytes kept")

    def byte(self, at: int) -> int:
        """The byte at offset ``at``."""
        offset, chunk = self._chunk_at(at)
        return chunk[at - offset]

    def view(self, start: int, stop: int) -> Bytes:
        """The bytes ``[start, stop)``: a view of the chunk holding them, or, where they
        span chunks, a copy."""
        if stop <= start:
            return b""
        offset, chunk = self._chunk_at(stop - 1)
        if start >= offset:
            return chunk[start - offset:stop - offset]
        return self.copy(start, stop)

    def copy(self, start: int, stop: int) -> bytes:
        """The bytes ``[start, stop)``, copied once out of the chunks holding them."""
        if stop <= start:
            return b""
        self._chunk_at(stop - 1)
        parts = [chunk[max(0, start - offset):stop - offset]
                 for offset, chunk in self._pieces
                 if offset < stop and offset + len(chunk) > start]
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    def read(self, size: int = -1) -> bytes:
        while self._at >= self._end:
            if not self.pull():
                return b""
        offset, chunk = next(p for p in reversed(self._pieces) if p[0] <= self._at)
        start = self._at - offset
        stop = len(chunk) if size is None or size < 0 else min(len(chunk), start + size)
        self._at = offset + stop
        whole = chunk.obj
        if start == 0 and stop == len(chunk) and type(whole) is bytes \
                and len(whole) == stop:
            return whole  # a chunk read into its own bytes: handed over, not copied
        return bytes(chunk[start:stop])

    def keep(self, offset: int) -> None:
        """Forget the chunks that end at or before ``offset``."""
        while len(self._pieces) > 1 and self._pieces[1][0] <= offset:
            del self._pieces[0]

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()


def _legacy_parts(path: str, entry: ShardEntry, unpacker: msgpack.Unpacker,
                  length: int) -> ShardParts:
    """The sessions of a layout-1 shard (one map per session), as parts."""
    rows: list[list[Any]] = []
    turns: list[Bytes] = []
    states: list[Bytes] = []
    for obj in unpacker:
        try:
            record = SessionRecord.from_wire(obj)
        except ValueError as exc:
            raise _undecodable(path, str(exc)) from exc
        if record.instance_id != entry.instance_id:
            raise _undecodable(path, f"session of {record.instance_id} in a shard of "
                                     f"{entry.instance_id}")
        row, turns_blob, state = record_parts(record)
        rows.append(msgpack.unpackb(row, raw=False, use_list=True))
        turns.append(turns_blob)
        states.append(state)
    if unpacker.tell() != length:
        raise _undecodable(path, f"{length - unpacker.tell()} trailing bytes do not decode")
    if len(rows) != entry.sessions:
        raise _undecodable(path, f"{len(rows)} sessions, manifest says {entry.sessions}")
    return ShardParts(entry.instance_id, rows, turns, states)


def _undecodable(path: str, why: str) -> ShardCorruptedError:
    return ShardCorruptedError(
        path, f"shard {path} matches its hash but does not decode ({why}); it was "
              f"written by a different tool: restore an earlier checkpoint")


class RolloutIndexEntry(NamedTuple):
    """One captured rollout, as a shard's index (or a format-2 manifest) lists it."""

    instance_id: str
    rollout_id: str
    attempt: int
    turns: int
    staging_keys: list[str]
    shard: str


def read_shard_index(directory: Folder | Path, entry: ShardEntry) -> list[RolloutIndexEntry]:
    """The rollouts a shard's index lists, read without its payloads and without
    verifying its hash (``inspect`` and ``diff``; a restore and ``verify`` verify)."""
    folder = as_folder(directory)
    path = folder.describe(entry.file)
    if not is_plain_file_name(entry.file):
        raise UnsafeShardNameError(
            folder.describe(), f"shard name {entry.file!r} is not a plain file name in "
                               f"{folder.describe()}")
    try:
        # The manifest's length is a claim: the buffer (and msgpack's largest array or
        # string, which it allocates as claimed) is bounded by what is there.
        limit = max(min(entry.bytes, folder.size(entry.file)), 1 << 20)
        with folder.open_read(entry.file) as f:
            unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=limit)
            header = unpacker.unpack()
            if not isinstance(header, dict) or header.get("format") != SHARD_MAGIC:
                raise _undecodable(path, "no nemo-ckpt shard header")
            if header.get("version") == 1:  # no index: every session has to be read
                rows = read_shard_parts(folder, entry).rows
            else:
                rows = unpacker.unpack()
    except FileNotFoundError:
        raise TornSnapshotError(path, f"shard {path}, named in the manifest, is missing"
                                ) from None
    except OSError as exc:
        raise CheckpointPathError(path, f"cannot read shard {path}: {exc.strerror or exc}"
                                  ) from exc
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise _undecodable(path, str(exc) or type(exc).__name__) from exc
    try:
        return [RolloutIndexEntry(entry.instance_id, row[0], row[1], row[3],
                                  sorted(set(row[2])), entry.file) for row in rows]
    except (TypeError, IndexError) as exc:
        raise _undecodable(path, f"its index has rows of the wrong shape ({exc})") from exc


def shard_problems(listed: Mapping[str, int] | None, sessions: Iterable[tuple[str, int]],
                   where: str) -> list[str]:
    """What is wrong with the sessions a shard holds, ``(rollout_id, attempt)`` each: a
    rollout held twice; and against ``listed`` (its manifest's rollouts there, from
    ``rollouts_by_shard``; None for format 3, whose manifest lists none), one the manifest
    does not list there (or lists at another attempt), one it lists but the shard lacks.
    The one check a restore and ``nemo-ckpt verify`` both make, so a crafted shard cannot
    make two sessions of a rollout live."""
    problems: list[str] = []
    seen: set[str] = set()
    for rollout_id, attempt in sessions:
        key = rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"
        if rollout_id in seen:
            problems.append(f"shard {where} holds rollout {rollout_id!r} twice; restore an "
                            f"earlier checkpoint")
        elif listed is not None and listed.get(rollout_id) != attempt:
            problems.append(f"shard {where} holds {key}, which its manifest does not list "
                            f"there; restore an earlier checkpoint")
        seen.add(rollout_id)
    if listed is not None and (missing := sorted(set(listed) - seen)):
        problems.append(f"shard {where} lacks rollouts its manifest lists there: "
                        f"{', '.join(missing)}; restore an earlier checkpoint")
    return problems
