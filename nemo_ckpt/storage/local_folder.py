"""A snapshot folder on a filesystem that every node and the driver mount at one path.

Every file is written the same durable way: to a temp file in the same folder, fsynced,
renamed into place, then the folder fsynced. A rename replaces the previous file
atomically, which is what makes the manifest's write the commit point.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from nemo_ckpt.errors import SnapshotWriteError
from nemo_ckpt.storage.folder import ABSENT, Sink, unlistable
from nemo_ckpt.storage.manifest import is_plain_file_name
from nemo_ckpt.storage.read_ahead import read_ahead
from nemo_ckpt.storage.store_errors import not_a_regular_file

__all__ = ["LocalFolder", "TMP_MARK", "open_regular", "read_regular"]

# Temp files are ".<name>.tmp-<uuid>": hidden, and recognisably ours for clean-up.
TMP_MARK = ".tmp-"
# Pieces are written in batches of about _WRITE_BATCH bytes with one writev each: small
# pieces are gathered into a buffer first, pieces at least _DIRECT_WRITE long (big
# states) go to the kernel by reference, without a copy. Per-piece write syscalls cost
# a third of the write's time at 64 KiB states.
_WRITE_BATCH = 4 << 20
# ...but copies of small pieces are written once they reach this much: they are memory
# the snapshot adds on top of the sessions (4 MiB of them was 1.6x the state of a holder
# of 2,500 1 KiB sessions).
_COPIED_BATCH = 256 << 10
_DIRECT_WRITE = 16 << 10
_SMALL_PIECE_BUFFER = 256 << 10
# Chunks a streamed read keeps ready ahead of its consumer.
_READ_AHEAD = 3
_MAX_IOV = 512  # well under every platform's IOV_MAX (1024 on Linux)


class _BatchingWriter:
    """A ``Sink`` onto a file descriptor, in large ``writev`` batches."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._small = bytearray()
        self._batch: list[bytes | bytearray | memoryview] = []
        self._batch_bytes = 0
        self._copied_bytes = 0  # of _batch, in copies of small pieces
        self.length = 0

    def write(self, data: bytes | bytearray | memoryview, copy: bool = False) -> None:
        n = len(data)
        self.length += n
        if n >= _DIRECT_WRITE:
            self._seal_small()
            self._batch.append(data)
            self._batch_bytes += n
            if copy:
                self._copied_bytes += n
        else:
            self._small += data
            if len(self._small) >= _SMALL_PIECE_BUFFER:
                self._seal_small()
        if self._batch_bytes >= _WRITE_BATCH or len(self._batch) >= _MAX_IOV \
                or self._copied_bytes >= _COPIED_BATCH:
            self._flush()

    def _seal_small(self) -> None:
        if self._small:
            self._batch.append(self._small)
            self._batch_bytes += len(self._small)
            self._copied_bytes += len(self._small)
            self._small = bytearray()

    def _flush(self) -> None:
        self._seal_small()
        _writev_all(self._fd, self._batch)
        self._batch = []
        self._batch_bytes = 0
        self._copied_bytes = 0

    def close(self) -> None:
        """Write what is still queued."""
        self._flush()


def _writev_all(fd: int, pieces: list[bytes | bytearray | memoryview]) -> None:
    """``os.writev`` every piece, resuming after short writes."""
    views = [memoryview(p) for p in pieces]
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i:])
        while i < len(views) and written >= len(views[i]):
            written -= len(views[i])
            i += 1
        if written:
            views[i] = views[i][written:]


# Every read of stored data: a link is not followed, and a FIFO's open does not wait for
# a writer (a FIFO named manifest.json hung every command that read the root).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_regular(path: Path | str) -> int:
    """A descriptor for reading the regular file at ``path``, opened without following
    a link or blocking; ``NotARegularFileError`` (an ``OSError`` of one line) for
    anything else there, ``FileNotFoundError`` for nothing."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise not_a_regular_file(path, None) from None
        if exc.errno == errno.ENXIO:  # a socket (or a device with nothing behind it)
            raise not_a_regular_file(path, stat.S_IFSOCK) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_a_regular_file(path, mode)
        os.set_blocking(fd, True)  # a file's reads never wait anyway; no EAGAIN
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path | str, limit: int | None = None) -> bytes:
    """The bytes of the regular file at ``path`` (``open_regular``), at most ``limit``
    and one more (which shows a file longer than the limit)."""
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:
        if limit is None:
            return f.read()
        # A limit may come from a file (a manifest's length): a read of n bytes
        # allocates n first, so never ask for more than is there (and one more,
        # to show a file that grew).
        return f.read(min(limit, os.fstat(f.fileno()).st_size + 1))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_failure(target: Path | str, exc: OSError) -> str:
    """What a failed write of ``target`` means, and what to do."""
    reason = {
        errno.ENOSPC: "the filesystem is full; free space or point snapshots elsewhere",
        errno.EDQUOT: "the disk quota is exhausted; free space or raise the quota",
        errno.EROFS: "the filesystem is read-only; mount it read-write",
        errno.EACCES: "permission denied; let the Ray workers' user write there",
        errno.EPERM: "permission denied; let the Ray workers' user write there",
        errno.ENOENT: "the checkpoint folder disappeared while writing; check what removes it",
    }.get(exc.errno or 0, "check the filesystem and retry the snapshot")
    return f"could not write {target}: {exc.strerror or exc} ({reason})"


@dataclass(frozen=True)
class LocalFolder:
    """A ``Folder`` on a (shared) filesystem."""

    path: Path

    def __str__(self) -> str:
        return str(self.path)

    def _file(self, name: str) -> Path:
        if not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not a plain file name")
        return self.path / name

    def describe(self, name: str = "") -> str:
        return str(self.path / name) if name else str(self.path)

    def problem(self) -> str | None:
        for p in (self.path.parent, self.path):
            if p.exists() and not p.is_dir():
                return f"{p} is a file, not a folder"
        return None

    def prepare(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SnapshotWriteError(self.path, write_failure(self.path, exc)) from exc

    def write_stream(self, name: str, fill: Callable[[Sink], None]) -> int:
        target = self._file(name)
        tmp = self.path / f".{name}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb", buffering=0) as f:
                writer = _BatchingWriter(f.fileno())
                fill(writer)
                writer.close()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            _fsync_dir(self.path)
        except BaseException as exc:
            # Whatever failed (disk, or the caller's own iterator), no partial file stays.
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise SnapshotWriteError(target, write_failure(target, exc)) from exc
            raise
        return writer.length

    def write_bytes(self, name: str, data: bytes, sync: bool = True,
                    expect: str | None = None) -> None:
        if expect == ABSENT:
            # A link fails on an existing name: of two creators, one wins.
            if not self._link_new(name, data, sync):
                raise FileExistsError(f"{self.describe(name)} exists")
            return
        if expect is None:
            self._replace(name, data, sync)
            return
        # A rename cannot be made conditional. Writers that replace on a condition lock
        # the file they found: the one that renames first leaves the others, waiting on
        # the lock of the file it replaced, to find a new version and be refused.
        with self._locked(name):
            if self.version(name) != expect:
                raise FileExistsError(f"{self.describe(name)} changed")
            self._replace(name, data, sync)

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        target = self._file(name)
        try:
            # Read-write: a lock over NFS is a write lock, which needs a writable file.
            fd = os.open(target, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise FileExistsError(f"{self.describe(name)} changed (it is gone)") from None
        except OSError as exc:
            raise SnapshotWriteError(target, write_failure(target, exc)) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when closed, or when its process dies
            yield
        finally:
            os.close(fd)

    def _replace(self, name: str, data: bytes, sync: bool) -> None:
        if sync:
            self.write_stream(name, lambda sink: sink.write(data))
            return
        target = self._file(name)
        tmp = self.path / f".{name}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise SnapshotWriteError(target, write_failure(target, exc)) from exc

    def version(self, name: str) -> str | None:
        # Every write renames a new file into place: a new inode.
        try:
            st = self._file(name).stat()
        except FileNotFoundError:
            return None
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def enforces_conditions(self) -> bool:
        """A create is exclusive (a link); a conditional replace checks and renames under
        an exclusive ``flock`` of the file it replaces, held across hosts where the shared
        filesystem supports locks (NFSv4 does)."""
        return True

    def _link_new(self, name: str, data: bytes, sync: bool) -> bool:
        target = self._file(name)
        tmp = self.path / f".{name}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            try:
                f = open(tmp, "xb", buffering=0)
            except FileNotFoundError:
                # The folder went since it was prepared: a removal of the snapshot that
                # was there removes it once empty (nemo_ckpt.catalog.listing).
                self.prepare()
                f = open(tmp, "xb", buffering=0)
            with f:
                f.write(data)
                if sync:
                    os.fsync(f.fileno())
            os.link(tmp, target)
            if sync:
                _fsync_dir(self.path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            raise SnapshotWriteError(target, write_failure(target, exc)) from exc
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def remove_if(self, name: str, candidates: Collection[bytes]) -> bool:
        """Remove ``name`` if it holds exactly one of ``candidates``: whether it did.
        Exclusive, as a create is: the file is renamed away first, so a writer that
        replaced it meanwhile keeps its own (put back by a link)."""
        target = self._file(name)
        aside = self.path / f".{name}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            return False
        try:
            try:
                held = read_regular(aside)
            except OSError:
                held = None  # not a file of ours (a FIFO, a link): put back, as it was
            if held is not None and held in candidates:
                return True
            with contextlib.suppress(FileExistsError):
                os.link(aside, target, follow_symlinks=False)
            return False
        finally:
            aside.unlink(missing_ok=True)

    def size(self, name: str) -> int:
        return self._file(name).stat().st_size

    def read(self, name: str, limit: int | None = None) -> bytes:
        return read_regular(self._file(name), limit)

    def read_view(self, name: str, limit: int | None = None) -> memoryview:
        return memoryview(self.read(name, limit))

    def read_chunks(self, name: str, length: int, chunk: int) -> Iterator[memoryview]:
        fd = open_regular(self._file(name))
        try:
            size = os.fstat(fd).st_size
            end = min(length, size)
            # A longer file shows as one byte more (its reader refuses it).
            spans = [(at, min(chunk, end - at)) for at in range(0, end, chunk)]
            if size > length:
                spans.append((length, 1))
            reads = [lambda at=at, n=n: memoryview(os.pread(fd, n, at)) for at, n in spans]
            # One reader thread: the disk reads in order, and faults injected into this
            # call (tests/simulation) stay deterministic.
            yield from read_ahead(reads, workers=1, depth=_READ_AHEAD)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[BinaryIO]:
        with os.fdopen(open_regular(self._file(name)), "rb") as f:
            yield f

    def names(self) -> list[str]:
        try:
            return [entry.name for entry in self.path.iterdir()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise unlistable(str(self.path), exc) from exc

    def subfolders(self) -> list[str]:
        try:
            return [entry.name for entry in self.path.iterdir() if entry.is_dir()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise unlistable(str(self.path), exc) from exc

    def remove(self, names: Iterable[str]) -> None:
        # Not fsynced: a removal lost to a crash leaves a file the next clean-up removes.
        for name in names:
            target = self._file(name)
            try:
                target.unlink(missing_ok=True)
            except OSError as exc:
                raise SnapshotWriteError(target, f"could not remove {target}: "
                                                 f"{exc.strerror or exc}") from exc
