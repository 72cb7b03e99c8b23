"""Recording a sandbox directory's tree at a turn's commit (``scan``).

A session may own a directory on its node (under ``CheckpointConfig.sandbox_root``).
When one of its turns commits, its holder records the directory's tree with ``scan``:
it walks the directory, re-reads only the files whose size, mtime, ctime, inode or mode
changed since the session's previous tree, puts their content into the node's
``nemo_ckpt.trees.node_cache.BlobCache`` under its digest, and encodes again only
the directories along a change (``nemo_ckpt.trees.tree_codec``). A snapshot then
stores the trees and writes only the blobs its store lacks; a restore rebuilds each
directory with ``nemo_ckpt.trees.materialize``.

Reading a sandbox, which model-generated code writes while we read it: the scan walks
directories by descriptor (each opened with ``O_NOFOLLOW | O_DIRECTORY`` below its
parent's), opens each file ``O_NOFOLLOW | O_NONBLOCK``, so a link or a FIFO swapped in
after the listing is never followed nor waited on, and ``fstat``s what it opened: a
regular file is read (a different one than listed, renamed over it, is recorded as what
it now is), anything else refuses the scan; an entry that became a link is recorded as
a link. A file whose size, mtime or ctime moved while it was read is read again, at
most ``_READS`` times, then refuses the scan naming it.

An overlay's upper directory (a container's filesystem changes against its image,
``nemo_ckpt.containers``) is scanned with ``overlay=OverlayMarks()``: its whiteouts
(character devices 0:0, a path the image has and the container deleted) and its opaque
directories (``trusted.overlay.opaque``: the image's entries below are hidden), FIFOs and
sockets are listed there instead of refusing the scan; any other device still refuses it.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nemo_ckpt.errors import SandboxError
from nemo_ckpt.trees.blob_store import digest_of
from nemo_ckpt.trees.extents import find_extents, sparse_header
from nemo_ckpt.trees.limits import MAX_DEPTH, SandboxLimits
from nemo_ckpt.trees.tree_codec import pack_tree_object
from nemo_ckpt.trees.tree_types import (
    CONTENT_KINDS,
    DIR,
    FILE,
    LINK,
    SPARSE,
    Entry,
    Store,
    Tree,
)

# A file changed within this long before its scan may change again within the same
# filesystem timestamp tick without its mtime moving; it is re-read at the next scan
# (git's "racily clean" entries).
_RACY_NS = 20_000_000
_CHUNK = 4 << 20
_READS = 3  # reads of a file that keeps changing before the scan gives up on it
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW


_OPAQUE_XATTR = "trusted.overlay.opaque"


@dataclass(slots=True)
class OverlayMarks:
    """What a scan of an overlay's upper directory found besides its tree: the paths
    deleted (whiteouts) and the directories made opaque, each relative to the top."""

    whiteouts: list[str]
    opaque: list[str]
    fifos: list[tuple[str, int]]  # (path, mode bits): a container's named pipes
    sockets: list[str]  # not recorded: a socket's file is its listener's, made again

    def __init__(self) -> None:
        self.whiteouts = []
        self.opaque = []
        self.fifos = []
        self.sockets = []

    def note(self, rel: str, st: os.stat_result) -> bool:
        """Note the entry ``rel`` (stat ``st``) if it is one of the overlay's marks
        rather than an entry of the tree: a whiteout (a character device 0/0), a FIFO,
        a socket. Whether it was."""
        mode = st.st_mode
        if stat.S_ISCHR(mode) and st.st_rdev == 0:
            self.whiteouts.append(rel)
        elif stat.S_ISFIFO(mode):
            self.fifos.append((rel, stat.S_IMODE(mode)))
        elif stat.S_ISSOCK(mode):
            self.sockets.append(rel)
        else:
            return False
        return True


@dataclass(frozen=True, slots=True)
class Seen:
    """What ``scan`` remembers of one entry between scans, to skip re-reading it: its key
    and its entry, which an unchanged entry keeps (the same object, not a copy). A
    directory's entry carries its tree object's digest and length."""

    key: tuple[int, int, int, int, int] | None  # (size, mtime_ns, ctime_ns, inode, mode)
    entry: Entry


@dataclass(frozen=True, slots=True)
class Listing:
    """What ``scan`` remembers of one directory: its entries by name, its tree object,
    and the digests, count and bytes of the files directly in it. A directory whose
    entries are all unchanged keeps its listing (the same object)."""

    entries: dict[str, Seen]
    digest: bytes
    size: int
    files: frozenset[bytes]
    file_count: int
    file_bytes: int


# A scan's memory of a tree: relative directory path ("" for the top one) -> listing.
Listings = dict[str, Listing]


@dataclass(slots=True)
class ScanResult:
    """A directory's tree as of one scan, and what the next scan may skip."""

    listings: Listings
    objects: dict[bytes, bytes]  # the tree objects this scan encoded (new or changed)
    files_read: int
    bytes_read: int

    @property
    def root(self) -> bytes:
        return self.listings[""].digest

    @property
    def root_size(self) -> int:
        return self.listings[""].size

    def blobs(self) -> frozenset[bytes]:
        """Every blob the tree references: its tree objects and its files."""
        listings = self.listings.values()
        return frozenset({x.digest for x in listings}).union(*(x.files for x in listings))

    def file_count(self) -> int:
        return sum(x.file_count for x in self.listings.values())

    def file_bytes(self) -> int:
        return sum(x.file_bytes for x in self.listings.values())

    def tree(self) -> Tree:
        """The tree as one mapping of relative paths (see ``Tree``)."""
        tree: Tree = {}
        for directory, listing in self.listings.items():
            prefix = directory + "/" if directory else ""
            for name, seen in listing.entries.items():
                e = seen.entry
                tree[prefix + name] = Entry(DIR, e.mode, 0, b"") if e.kind == DIR else e
        return tree


def scan(directory: Path, previous: Listings | None, store: Store,
         now_ns: int | None = None, limits: SandboxLimits | None = None,
         overlay: OverlayMarks | None = None) -> ScanResult:
    """Record ``directory``'s tree. Entries whose (size, mtime, ctime, inode, mode) match
    ``previous`` keep their entry, and a directory whose entries all do keeps its tree
    object; every other file is read (see the module docstring) into ``store``. A file
    changed within a timestamp tick of ``now_ns`` (the scan's start) is re-read next time.

    Raises ``SandboxError`` naming the path of a device, FIFO or socket, of a directory
    deeper than ``MAX_DEPTH``, of a file that kept changing while it was read, of what
    passes one of ``limits``, or when ``directory`` is not a directory. With ``overlay``,
    whiteouts and opaque directories are listed there (see the module docstring)."""
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise SandboxError(f"sandbox directory {directory} is not a directory") from None
        raise SandboxError(f"sandbox directory {directory} cannot be read ({exc})") from None
    try:
        scanner = _Scanner(directory, previous or {}, store,
                           (time.time_ns() if now_ns is None else now_ns) - _RACY_NS,
                           limits or SandboxLimits(), overlay)
        scanner.directory(fd, os.fspath(directory), "", 0)
    finally:
        os.close(fd)
    return ScanResult(scanner.listings, scanner.objects, scanner.files_read,
                      scanner.bytes_read)


_NOT_SEEN = Seen(None, Entry(-1, 0, 0, b""))
_Key = tuple[int, int, int, int, int]


class _Changed(Exception):
    """The file being read changed under the read (it shrank)."""


class _Scanner:
    """One scan (see ``scan``): directories depth first, each encoded after its
    subdirectories, and only when one of its entries changed."""

    def __init__(self, top: Path, previous: Listings, store: Store, racy_after: int,
                 limits: SandboxLimits, overlay: OverlayMarks | None = None) -> None:
        self.top = top
        self.overlay = overlay
        self.previous = previous
        self.store = store
        self.racy_after = racy_after
        self.limits = limits
        self.listings: Listings = {}
        self.objects: dict[bytes, bytes] = {}
        self.files_read = self.bytes_read = 0
        self.entries = self.stored = 0  # what the limits count, over the whole tree

    def directory(self, fd: int, path: str, rel: str, depth: int) -> Listing:
        if depth > MAX_DEPTH:
            raise SandboxError(f"sandbox {self.top} holds {path}, deeper than {MAX_DEPTH} "
                               f"directories; a restore would refuse it")
        old = self.previous.get(rel)
        old_entries = old.entries if old is not None else {}
        old_get = old_entries.get
        entries: dict[str, Seen] = {}
        # ``changed``: the tree object differs; ``renewed``: only what the next scan may
        # skip does (a racy file, re-read with the same content).
        changed = old is None
        renewed = False
        prefix = rel + "/" if rel else ""
        items = self._list(fd, path)
        whiteouts = 0  # listed, but not entries of the tree
        # This loop runs once per entry at every turn commit (benchmarks/sandboxes.py):
        # an unchanged file costs its stat, one lookup, one comparison and one store.
        regular, fmt_bits = stat.S_IFREG, 0o170000
        max_bytes = self.limits.sandbox_bytes
        for item in items:
            name = item.name
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                changed = True  # removed since the listing
                continue
            mode = st.st_mode
            seen = old_get(name, _NOT_SEEN)
            key: _Key | None
            if mode & fmt_bits == regular:
                key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, mode)
                if seen.key == key:
                    self.stored += seen.entry.size
                    if self.stored > max_bytes:
                        self._count(0, path + "/" + name)
                    entries[name] = seen  # not racy when recorded, and unchanged since
                    continue
                full = path + "/" + name
                found = self._file(fd, name, full, st)
            elif stat.S_ISDIR(mode):
                full = path + "/" + name
                try:
                    sub_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    found = self._reexamine(fd, name, full, exc)
                else:
                    entry = self._subdirectory(sub_fd, full, prefix + name, depth + 1)
                    if seen.entry == entry:
                        entries[name] = seen
                        continue
                    found = (None, entry)
            elif stat.S_ISLNK(mode):
                key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, mode)
                if seen.key == key:
                    entries[name] = seen
                    continue
                found = self._link(fd, name, path + "/" + name, key)
            elif self.overlay is not None and self.overlay.note(prefix + name, st):
                whiteouts += 1  # an overlay's mark, not an entry
                continue
            else:
                raise self._special(path + "/" + name, mode)
            if found is None:
                changed = True  # removed since the listing
                continue
            key, entry = found
            if seen.entry == entry:
                renewed = True
                entries[name] = Seen(key, seen.entry)
            else:
                changed = True
                entries[name] = Seen(key, entry)
        if len(items) - whiteouts != len(old_entries):
            changed = True  # with every name found above, the names are the same ones
        return self._settle(rel, old, entries, changed, renewed)

    def _list(self, fd: int, path: str) -> list[os.DirEntry[str]]:
        """The entries of the directory ``fd`` (at ``path``), each counted against
        ``sandbox_max_files`` as it is listed, so an oversized tree stops the scan early."""
        items = []
        max_entries = self.limits.files
        try:
            with os.scandir(fd) as listed:
                for item in listed:
                    items.append(item)
                    self.entries += 1
                    if self.entries > max_entries:
                        raise SandboxError(
                            f"sandbox {self.top} holds more than sandbox_max_files "
                            f"({max_entries}) entries (files, directories and links; "
                            f"{path}/{item.name} is one too many): remove some, or raise "
                            f"CheckpointConfig.sandbox_max_files")
        except OSError as exc:
            raise SandboxError(f"sandbox directory {path} cannot be listed ({exc})") from None
        return items

    def _subdirectory(self, sub_fd: int, path: str, rel: str, depth: int) -> Entry:
        """Scan the opened subdirectory ``sub_fd`` (at ``path``, ``rel`` in the tree), close
        it, and return its entry."""
        try:
            # The mode of the directory scanned (one renamed over the listed one is
            # recorded as what it now is).
            mode = os.fstat(sub_fd).st_mode
            if self.overlay is not None and _opaque(sub_fd):
                self.overlay.opaque.append(rel)
            sub = self.directory(sub_fd, path, rel, depth)
        finally:
            os.close(sub_fd)
        return Entry(DIR, stat.S_IMODE(mode), sub.size, sub.digest)

    def _special(self, path: str, mode: int) -> SandboxError:
        """The refusal of a device, FIFO or socket at ``path``."""
        return SandboxError(
            f"sandbox {self.top} holds {path}, a {_special_kind(mode)}: a "
            f"sandbox may hold files, directories and symlinks only; remove it "
            f"before the turn commits")

    def _settle(self, rel: str, old: Listing | None, entries: dict[str, Seen],
                changed: bool, renewed: bool) -> Listing:
        """Record the directory ``rel``'s listing: the previous one when no entry changed
        (a copy carrying the renewed keys when only those did), else a new tree object."""
        if old is not None and not changed:
            listing = old if not renewed else Listing(
                entries, old.digest, old.size, old.files, old.file_count, old.file_bytes)
        else:
            listing = self._encode(entries)
        self.listings[rel] = listing
        return listing

    def _count(self, size: int, path: str) -> None:
        """Count a file's stored bytes against the sandbox's limit."""
        self.stored += size
        if self.stored > self.limits.sandbox_bytes:
            raise SandboxError(
                f"sandbox {self.top} holds more than sandbox_max_bytes "
                f"({self.limits.sandbox_bytes}) bytes of files ({path} passes it): remove "
                f"some, or raise CheckpointConfig.sandbox_max_bytes")

    def _file(self, fd: int, name: str, path: str, listed: os.stat_result
              ) -> tuple[_Key | None, Entry] | None:
        """Read the regular file ``name`` (listed as ``listed``) of the directory ``fd``:
        its key and entry, a link's if it became one, or None if it is gone."""
        try:
            file_fd = os.open(name, _FILE_FLAGS, dir_fd=fd)
        except OSError as exc:
            return self._reexamine(fd, name, path, exc)
        try:
            for _ in range(_READS):
                st = os.fstat(file_fd)
                if not stat.S_ISREG(st.st_mode):
                    raise SandboxError(
                        f"sandbox {self.top} holds {path}, a {_special_kind(st.st_mode)} "
                        f"that replaced a file while the scan read it: a sandbox may hold "
                        f"files, directories and symlinks only; remove it before the "
                        f"turn commits")
                # (st is the file read: one renamed over the listed one is recorded as
                # what it now is, with its own inode in its key.)
                kind, chunks, size = self._content(file_fd, st, path)
                try:
                    digest, length = self.store(chunks)
                except _Changed:
                    continue
                after = os.fstat(file_fd)
                if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) \
                        == (st.st_size, st.st_mtime_ns, st.st_ctime_ns) and length == size:
                    break
            else:
                raise SandboxError(
                    f"sandbox {self.top}: {path} changed each of the {_READS} times the "
                    f"scan read it; stop what writes it before the turn commits")
        finally:
            os.close(file_fd)
        self.files_read += 1
        self.bytes_read += length
        self._count(length, path)
        mode = st.st_mode
        key: _Key | None = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, mode)
        if max(st.st_mtime_ns, st.st_ctime_ns) >= self.racy_after or st.st_ino != listed.st_ino:
            key = None  # maybe changed again within the same tick, or swapped meanwhile
        return key, Entry(kind, mode & 0o7777, length, digest)

    def _content(self, fd: int, st: os.stat_result, path: str
                 ) -> tuple[int, Iterator[bytes], int]:
        """The kind of ``fd``'s blob, its chunks (read as they are taken) and length,
        once it is within the per-file limit."""
        size = st.st_size
        limit = self.limits.file_bytes
        extents = find_extents(fd, size, limit) if st.st_blocks * 512 < size else None
        if extents is None:
            kind, chunks, length = FILE, _range(fd, 0, size), size
        else:
            header = sparse_header(size, extents)
            length = len(header) + sum(e - s for s, e in extents)
            kind, chunks = SPARSE, _sparse(fd, header, extents)
        if length > limit:
            raise SandboxError(
                f"sandbox {self.top} holds {path}, {length} bytes to store, more than "
                f"sandbox_max_file_bytes ({limit}): remove it, or raise "
                f"CheckpointConfig.sandbox_max_file_bytes")
        if self.stored + length > self.limits.sandbox_bytes:
            self._count(length, path)
        return kind, chunks, length

    def _link(self, fd: int, name: str, path: str, key: _Key | None
              ) -> tuple[_Key | None, Entry] | None:
        try:
            target = os.fsencode(os.readlink(name, dir_fd=fd))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SandboxError(f"sandbox {self.top}: {path} changed while the scan read "
                               f"it ({exc}); commit the turn again") from None
        return key, Entry(LINK, 0o777, len(target), target)

    def _reexamine(self, fd: int, name: str, path: str, exc: OSError
                   ) -> tuple[_Key | None, Entry] | None:
        """``name`` did not open as what it was listed as: a link swapped in is recorded
        as a link (never followed), one gone as gone; anything else refuses the scan."""
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            return self._link(fd, name, path, None)
        raise SandboxError(f"sandbox {self.top}: {path} cannot be opened ({exc}); it may "
                           f"have changed while the scan read it") from None

    def _encode(self, entries: dict[str, Seen]) -> Listing:
        rows = []
        files = []
        for name in sorted(entries):
            e = entries[name].entry
            rows.append([name, e.kind, e.mode, e.size, e.data])
            if e.kind in CONTENT_KINDS:
                files.append(e)
        data = pack_tree_object(rows)
        digest = digest_of(data)
        self.objects[digest] = data
        return Listing(entries, digest, len(data), frozenset(e.data for e in files),
                       len(files), sum(e.size for e in files))


def _range(fd: int, start: int, end: int) -> Iterator[bytes]:
    """Bytes ``start`` to ``end`` of ``fd``; ``_Changed`` if it has fewer (it shrank: the
    caller's ``fstat`` sees it)."""
    off = start
    while off < end:
        chunk = os.pread(fd, min(_CHUNK, end - off), off)
        if not chunk:
            raise _Changed()
        off += len(chunk)
        yield chunk


def _sparse(fd: int, header: bytes, extents: list[tuple[int, int]]) -> Iterator[bytes]:
    """A sparse blob (``nemo_ckpt.trees.extents``): ``header``, then each extent's bytes."""
    yield header
    for start, end in extents:
        yield from _range(fd, start, end)


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, _OPAQUE_XATTR) == b"y"
    except OSError:  # ENODATA: not opaque; ENOTSUP: no overlay marks here
        return False


def _special_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "special file"
