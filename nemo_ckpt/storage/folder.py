"""The folder a snapshot is written to and read from, whatever holds it.

The format's modules own what is written, in which order, how it is verified
(``nemo_ckpt.storage.shards``, ``nemo_ckpt.storage.snapshot_files``,
``nemo_ckpt.storage.hashed_files``); a ``Folder`` owns the bytes' durability in one place: a folder
on a shared filesystem (``nemo_ckpt.storage.local_folder``), or a prefix in an object-store bucket.

The order a snapshot uses a folder, which is what makes a manifest the commit point:

1) (coordinator) ``prepare()``, then ``write_bytes(claim, sync=False)``: the folder is
   claimed for the operation (renewed the same way);
2) (every holder, in parallel) ``write_stream(shard, fill)``: each shard appears under its
   name whole, or not at all;
3) (coordinator) ``write_bytes(manifest)``, once every shard is durable: the commit point.
   A manifest replaces the previous one whole; a reader sees one or the other;
4) (coordinator) ``names()`` and ``remove(...)``: files no manifest names go.

A restore ``read``\\s the manifest, then each shard (``size`` first, then the bytes);
``inspect`` reads a shard's index through ``open_read`` without the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import BinaryIO, Protocol

from nemo_ckpt.errors import CheckpointPathError, SnapshotWriteError

__all__ = ["ABSENT", "Folder", "Sink", "remove_if_holds", "unlistable",
           "write_conditionally"]

# ``write_bytes``'s ``expect`` for a file that must not exist yet.
ABSENT = ""


class Sink(Protocol):
    """Where ``write_stream``'s ``fill`` writes a file's bytes, in order."""

    def write(self, data: bytes | bytearray | memoryview, copy: bool = False) -> None:
        """Append ``data``. Big pieces may be kept by reference until written, so they
        must not change; ``copy`` says ``data`` is a copy made for this write (the sink
        then bounds how many such copies it keeps)."""
        ...


class Folder(Protocol):
    """One snapshot folder (``<checkpoint path>/environment``). Names are plain file
    names (``nemo_ckpt.storage.manifest.is_plain_file_name``). A missing file raises
    ``FileNotFoundError``; a failed write raises ``SnapshotWriteError`` saying where and
    why, and leaves nothing under the name."""

    def describe(self, name: str = "") -> str:
        """The folder, or ``name`` in it, as a user would write it (path or URL)."""
        ...

    def problem(self) -> str | None:
        """Why this can never hold a snapshot (say, a file where the folder should be)."""
        ...

    def prepare(self) -> None:
        """Make the folder ready to be written."""
        ...

    def write_stream(self, name: str, fill: Callable[[Sink], None]) -> int:
        """Write ``name`` from what ``fill`` writes; it appears whole once durable.
        Returns its length. An exception from ``fill`` leaves nothing and propagates."""
        ...

    def write_bytes(self, name: str, data: bytes, sync: bool = True,
                    expect: str | None = None) -> None:
        """Write ``name`` whole, replacing any older one atomically; durable unless
        ``sync`` is False (a claim, renewed soon anyway). ``expect``: write only if
        ``name`` is ``ABSENT``, or still has this ``version()``; otherwise raise
        ``FileExistsError`` and write nothing. Enforced by the medium where
        ``enforces_conditions()``; elsewhere checked just before the write."""
        ...

    def version(self, name: str) -> str | None:
        """A token that changes whenever ``name`` is written; None when it is missing."""
        ...

    def enforces_conditions(self) -> bool:
        """Whether the medium itself refuses a write whose ``expect`` no longer holds
        (so that of two writers racing, one is refused)."""
        ...

    def size(self, name: str) -> int:
        ...

    def read(self, name: str, limit: int | None = None) -> bytes:
        """``name``'s bytes, or its first ``limit`` bytes."""
        ...

    def read_view(self, name: str, limit: int | None = None) -> memoryview:
        """``read`` as a read-only view: of the buffer the medium filled, where it hands
        one over (a bucket's reply), so a shard is not copied once more to be read."""
        ...

    def read_chunks(self, name: str, length: int, chunk: int) -> Iterator[memoryview]:
        """The first ``length`` bytes of ``name`` in pieces of ``chunk`` bytes (the last
        one may be shorter; fewer pieces, or a short one, only where the file is
        shorter), in order, read ahead of the consumer by a bounded amount (a reader
        thread, or parallel ranged requests on a bucket) so the consumer's work on one
        piece overlaps the read of the next. Stopping early releases the readers."""
        ...

    def open_read(self, name: str) -> AbstractContextManager[BinaryIO]:
        """``name`` as a file object read from the start (for reading only a head)."""
        ...

    def names(self) -> list[str]:
        """Every file in the folder (none when it does not exist); ``CheckpointPathError``
        when it cannot be listed."""
        ...

    def subfolders(self) -> list[str]:
        """The names of the folders directly below this one (for a bucket, the prefixes
        one level down that hold something)."""
        ...

    def remove(self, names: Iterable[str]) -> None:
        """Remove ``names``; missing ones are fine."""
        ...


def unlistable(folder: str, exc: OSError) -> CheckpointPathError:
    """The error of a listing that failed (a disk error, permissions, a store that does
    not answer), naming the folder and the cause."""
    return CheckpointPathError(folder, f"cannot list {folder}: {exc.strerror or exc}")


def write_conditionally(folder: Folder, name: str, data: bytes, expect: str,
                        sync: bool = True) -> None:
    """``folder.write_bytes(name, data, sync, expect)``, a write that may land and still
    be refused: a bucket's client retries a put whose answer was lost (a 500 after the
    server wrote it), and the retry meets the condition its own first try broke (a 412,
    ``FileExistsError``). So a refusal reads ``name`` back: holding ``data``, the write
    is this one's, and it succeeded. ``data`` must be this write's own (a claim's beat,
    a manifest's snapshot id, a token): another writer's equal bytes would pass for it.
    A back-read that fails twice raises ``SnapshotWriteError``: whether the write is this
    one's is unknown, so it neither succeeds nor blames another writer (fail closed, and
    retriable, as a write that failed)."""
    try:
        folder.write_bytes(name, data, sync=sync, expect=expect)
    except FileExistsError as conflict:
        error: OSError | None = None
        for _ in range(2):  # once more: a read error is often transient
            try:
                landed = folder.read(name) == data
            except OSError as exc:
                error = exc
                continue
            if landed:
                return
            raise
        assert error is not None
        where = folder.describe(name)
        raise SnapshotWriteError(
            where, f"could not write {where}: the write met a conflict (another writer's, "
                   f"or its own retried write) and reading it back failed: "
                   f"{error.strerror or error}; retry") from conflict


def remove_if_holds(folder: Folder, name: str, candidates: Collection[bytes]) -> bool:
    """Remove ``name`` if it holds one of ``candidates`` (what this process wrote there,
    or a claim judged abandoned as read): whether it did. Exclusive on a local folder
    (``LocalFolder.remove_if``: a writer that replaced it meanwhile keeps its own); on a
    bucket it is read, then removed. A missing file is not removed; a failed read or
    removal raises."""
    remove_if = getattr(folder, "remove_if", None)
    if remove_if is not None:
        return bool(remove_if(name, candidates))
    try:
        current = folder.read(name)
    except FileNotFoundError:
        return False
    if current not in candidates:
        return False
    folder.remove([name])
    return True
