"""Sandbox directories: a session's working directory as a tree of path -> content digest.

A session may own a directory on its node (under ``CheckpointConfig.sandbox_root``).
When one of its turns commits, its holder records the directory's tree with ``scan``:
it walks the directory, re-reads only the files whose size, mtime, ctime, inode or mode
changed since the session's previous tree, puts their content into the node's
``nemo_ckpt.sandboxes.blobs.BlobCache`` under its digest, and encodes again only the directories
along a change. A snapshot then stores the trees and
writes only the blobs its store lacks; a restore rebuilds each directory with
``materialize``.

What a tree may hold, and what it never does:

- regular files (content by digest, mode bits kept), directories (mode bits kept) and
  symbolic links (the link itself, its target as text: never followed);
- no device, FIFO or socket: ``scan`` refuses them with ``SandboxError`` naming the path;
- no setuid or setgid file on a restore, unless ``materialize`` is told to allow them
  (``CheckpointConfig.sandbox_restore_setid``);
- no path that could leave its directory: a stored tree names entries one directory
  at a time, by plain names (no ``/``, ``.``, ``..``), and only a directory has entries
  below it (a link as a parent would make a write follow it), so ``materialize`` only
  ever creates entries below the directory it made.

Encoded, as git does: one *tree object* per directory, a blob of its own (so a changed
file costs new objects only along its path, not the whole listing), each the msgpack
``[[name, kind, mode, size, data], ...]`` sorted by name, deflated (zlib) when that is
shorter; ``kind`` is 0 for a directory (``data`` its tree object's digest, ``size`` that
object's length), 1 for a file (``data`` its 16-byte XXH3-128 digest), 2 for a link
(``data`` its target, UTF-8 with surrogate escapes), 3 for a sparse file (``data`` the
digest of its *sparse blob*, ``size`` that blob's length). A session's tree is named by
its top object's digest and length. Trees written before kind 3 existed read unchanged
(a dense file is kind 1 as it always was); a reader older than kind 3 refuses a tree
that holds one as malformed, never misreads it.

A sparse blob holds a file's data extents only, never its holes: the msgpack header
``[1, apparent size, [offset, length, offset, length, ...]]`` (extents in order, none
overlapping, within the apparent size), then the extents' bytes one after the other.
Its digest, like any blob's, is the XXH3-128 of those bytes, so hashing and storing cost
the data, not the holes. A file is stored sparse when it has a hole of at least
``_MIN_HOLE`` before its end (``SEEK_HOLE``); shorter holes are kept as zeros, and a file
with more than ``_MAX_EXTENTS`` extents has its shortest holes kept as zeros until it
has fewer. ``materialize`` recreates the holes (``ftruncate`` to the apparent size, each
extent written at its offset). The sandbox limits (``SandboxLimits``) count what is
stored: a sparse file's blob, not its apparent size.

Reading a sandbox, which model-generated code writes while we read it: the scan walks
directories by descriptor (each opened with ``O_NOFOLLOW | O_DIRECTORY`` below its
parent's), opens each file ``O_NOFOLLOW | O_NONBLOCK``, so a link or a FIFO swapped in
after the listing is never followed nor waited on, and ``fstat``s what it opened: a
regular file is read (a different one than listed, renamed over it, is recorded as what
it now is), anything else refuses the scan; an entry that became a link is recorded as
a link. A file whose size, mtime or ctime moved while it was read is read again, at
most ``_READS`` times, then refuses the scan naming it.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from nemo_ckpt.errors import SandboxError
from nemo_ckpt.sandboxes.blobs import digest_of

__all__ = ["DIR", "FILE", "LINK", "SPARSE", "Entry", "SandboxLimits", "Store", "sparse_layout",
           "Tree", "TreeStats", "ScanResult", "Seen", "Listing",
           "Listings", "TreeBudget",
           "EncodedTree", "scan", "encode_tree", "decode_tree", "materialize", "tree_digests",
           "tree_stats", "diff_trees", "pack_tree_object", "MAX_DEPTH"]

DIR, FILE, LINK, SPARSE = 0, 1, 2, 3
_KIND_NAMES = {DIR: "directory", FILE: "file", LINK: "symlink", SPARSE: "sparse file"}
_CONTENT = (FILE, SPARSE)  # kinds whose data is a blob of the file's content
# A file changed within this long before its scan may change again within the same
# filesystem timestamp tick without its mtime moving; it is re-read at the next scan
# (git's "racily clean" entries).
_RACY_NS = 20_000_000
_CHUNK = 4 << 20
_MIN_HOLE = 64 << 10  # shorter holes are stored as zeros (see the module docstring)
_MAX_EXTENTS = 1 << 16
_SPARSE_VERSION = 1
_HEADER_MAX = 32 + 2 * 9 * _MAX_EXTENTS  # msgpack: at most 9 bytes per integer
_READS = 3  # reads of a file that keeps changing before the scan gives up on it
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
_SETID = 0o6000

# ``store(chunks)``: keep a blob's content, given as chunks, and return its digest and
# length. It may raise whatever the chunks raise (the scan reads the file as it stores).
Store = Callable[[Iterable[bytes]], tuple[bytes, int]]


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """What one scan may record; each is a ``CheckpointConfig`` field (named in the
    error). Bytes are stored bytes: a sparse file counts its data extents."""

    file_bytes: int = 1 << 30
    sandbox_bytes: int = 8 << 30
    files: int = 200_000  # entries of any kind: files, directories and links


MAX_DEPTH = 256  # directories deeper than this are refused when a stored tree is read


@dataclass(frozen=True, slots=True)
class TreeBudget:
    """What one read of a stored tree may expand to: entries (a subtree named twice
    counts twice: a tree object may be referenced from many places, so a few crafted
    objects could name 2^30 directories), the bytes its files claim, and its depth.
    Checked as the tree is expanded, so an over-budget tree costs at most the budget.
    ``entries`` and ``bytes`` are ``CheckpointConfig`` fields (named in the error)."""

    entries: int = SandboxLimits().files
    bytes: int = SandboxLimits().sandbox_bytes
    depth: int = MAX_DEPTH


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a tree: ``data`` is a file's digest or a link's target."""

    kind: int
    mode: int
    size: int
    data: bytes


# A tree: relative POSIX path -> entry. "." (the directory itself) is not listed. A
# directory's entry carries no data here (its tree object's digest is the encoding's).
Tree = dict[str, Entry]
# Called by ``decode_tree`` with (where, entries expanded so far) as it reads each tree
# object: the simulation observes that no read expands past its budget.
expansion_observer: Callable[[str, int], None] | None = None
_INFLATE_RATIO = 32  # rows hold a random 16-byte digest each: they never deflate this far


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
         now_ns: int | None = None, limits: SandboxLimits | None = None) -> ScanResult:
    """Record ``directory``'s tree. Entries whose (size, mtime, ctime, inode, mode) match
    ``previous`` keep their entry, and a directory whose entries all do keeps its tree
    object; every other file is read (see the module docstring) into ``store``. A file
    changed within a timestamp tick of ``now_ns`` (the scan's start) is re-read next time.

    Raises ``SandboxError`` naming the path of a device, FIFO or socket, of a directory
    deeper than ``MAX_DEPTH``, of a file that kept changing while it was read, of what
    passes one of ``limits``, or when ``directory`` is not a directory."""
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise SandboxError(f"sandbox directory {directory} is not a directory") from None
        raise SandboxError(f"sandbox directory {directory} cannot be read ({exc})") from None
    try:
        scanner = _Scanner(directory, previous or {}, store,
                           (time.time_ns() if now_ns is None else now_ns) - _RACY_NS,
                           limits or SandboxLimits())
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
                 limits: SandboxLimits) -> None:
        self.top = top
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
        if len(items) != len(old_entries):
            changed = True  # with every name found below, the names are the same ones
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
        extents = _extents(fd, size, limit) if st.st_blocks * 512 < size else None
        if extents is None:
            kind, chunks, length = FILE, _dense(fd, size), size
        else:
            header = msgpack.packb([_SPARSE_VERSION, size,
                                    [x for s, e in extents for x in (s, e - s)]])
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
            if e.kind in _CONTENT:
                files.append(e)
        data = pack_tree_object(rows)
        digest = digest_of(data)
        self.objects[digest] = data
        return Listing(entries, digest, len(data), frozenset(e.data for e in files),
                       len(files), sum(e.size for e in files))


def _extents(fd: int, size: int, limit: int) -> list[tuple[int, int]] | None:
    """``fd``'s data extents as (start, end), holes shorter than ``_MIN_HOLE`` kept as
    data; None when that leaves one extent over the whole file (or the filesystem does
    not say). Never more than ``_MAX_EXTENTS``: past it, shorter holes are merged. Stops
    once they hold more than ``limit`` bytes (the caller refuses the file): each step
    adds data, so a hostile layout costs at most ``limit`` over a block's size steps."""
    extents: list[tuple[int, int]] = []
    min_hole = _MIN_HOLE
    pos = total = 0
    try:
        while pos < size and total <= limit:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break  # only a hole to the end
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            if start >= end:
                break
            if extents and start - extents[-1][1] < min_hole:
                total += end - extents[-1][1]
                extents[-1] = (extents[-1][0], end)
            else:
                total += end - start
                extents.append((start, end))
                while len(extents) > _MAX_EXTENTS:
                    min_hole *= 4
                    extents = _merge(extents, min_hole)
                    total = sum(e - s for s, e in extents)
            pos = end
    except OSError:
        return None  # no SEEK_DATA here: read it whole
    if extents and size - extents[-1][1] < min_hole:
        extents[-1] = (extents[-1][0], size)
    if extents and extents[0][0] < min_hole:
        extents[0] = (0, extents[0][1])
    if extents == [(0, size)]:
        return None
    return extents


def _merge(extents: list[tuple[int, int]], min_hole: int) -> list[tuple[int, int]]:
    merged = [extents[0]]
    for start, end in extents[1:]:
        if start - merged[-1][1] < min_hole:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _dense(fd: int, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``fd`` from its start; ``_Changed`` if it has fewer (it grew: the
    caller's ``fstat`` sees it)."""
    off = 0
    while off < size:
        chunk = os.pread(fd, min(_CHUNK, size - off), off)
        if not chunk:
            raise _Changed()
        off += len(chunk)
        yield chunk


def _sparse(fd: int, header: bytes, extents: list[tuple[int, int]]) -> Iterator[bytes]:
    """A sparse blob (see the module docstring): ``header``, then each extent's bytes."""
    yield header
    for start, end in extents:
        off = start
        while off < end:
            chunk = os.pread(fd, min(_CHUNK, end - off), off)
            if not chunk:
                raise _Changed()
            off += len(chunk)
            yield chunk


def sparse_layout(data: bytes | memoryview, where: str) -> tuple[int, list[tuple[int, int]], int]:
    """A sparse blob's apparent size, its extents as (offset, length), and where their
    bytes start in ``data``; ``SandboxError`` (naming ``where``) unless they fit."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_HEADER_MAX,
                                max_array_len=2 * _MAX_EXTENTS)
    unpacker.feed(bytes(memoryview(data)[:_HEADER_MAX]))
    try:
        header = unpacker.unpack()
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise SandboxError(f"the sparse file {where} does not decode ({exc})") from None
    start = unpacker.tell()
    bad = SandboxError(f"the sparse file {where} has a malformed layout; restore an "
                       f"earlier checkpoint")
    if not (isinstance(header, list) and len(header) == 3 and header[0] == _SPARSE_VERSION
            and type(header[1]) is int and header[1] >= 0 and isinstance(header[2], list)
            and len(header[2]) % 2 == 0 and all(type(x) is int for x in header[2])):
        raise bad
    size, flat = header[1], header[2]
    extents = list(zip(flat[0::2], flat[1::2], strict=True))
    end = total = 0
    for off, length in extents:
        if off < end or length <= 0 or off + length > size:
            raise bad
        end = off + length
        total += length
    if start + total != len(data):
        raise bad
    return size, extents, start


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


@dataclass(frozen=True)
class EncodedTree:
    """A tree as stored: its top object's digest and length, and every tree object."""

    root: bytes
    root_size: int
    objects: dict[bytes, bytes]  # digest -> tree object, the top one included


def pack_tree_object(rows: list[list[Any]]) -> bytes:
    """A tree object as stored: its rows in msgpack, deflated (zlib) when that is
    shorter. A changed file costs a new object for every directory along its path, a
    listing each; deflating shrinks their names, modes and sizes, not the digests
    (``benchmarks/sandboxes.py``: the store)."""
    packed = msgpack.packb(rows, use_bin_type=True)
    deflated = zlib.compress(packed, 6)
    return deflated if len(deflated) < len(packed) else packed


def _inflate(data: bytes, where: str) -> bytes:
    """A stored tree object's msgpack: deflated (it starts with zlib's 0x78), or as
    written before tree objects were deflated (a msgpack array). Bounded: a tree
    object never inflates past ``_INFLATE_RATIO`` times its length (plus 1 MiB)."""
    if data[:1] != b"\x78":
        return data
    inflater = zlib.decompressobj()
    limit = _INFLATE_RATIO * len(data) + (1 << 20)
    try:
        out = inflater.decompress(data, limit)
    except zlib.error as exc:
        raise SandboxError(f"a tree object of {where} does not inflate ({exc})") from None
    if inflater.unconsumed_tail or not inflater.eof or inflater.unused_data:
        raise SandboxError(f"a tree object of {where} is not one whole deflated object "
                           f"of at most {limit} bytes")
    return out


def encode_tree(tree: Tree) -> EncodedTree:
    """``tree``'s tree objects (see the module docstring), deepest directories first."""
    children: dict[str, list[tuple[str, str]]] = {"": []}
    for path in tree:
        parent, _, name = path.rpartition("/")
        children.setdefault(parent, []).append((name, path))
        if tree[path].kind == DIR:
            children.setdefault(path, [])
    objects: dict[bytes, bytes] = {}
    encoded: dict[str, tuple[bytes, int]] = {}
    for directory in sorted(children, key=lambda d: d.count("/") + (d != ""), reverse=True):
        rows = []
        for name, path in sorted(children[directory]):
            e = tree[path]
            if e.kind == DIR:
                digest, size = encoded[path]
                rows.append([name, DIR, e.mode, size, digest])
            else:
                rows.append([name, e.kind, e.mode, e.size, e.data])
        data = pack_tree_object(rows)
        digest = digest_of(data)
        objects[digest] = data
        encoded[directory] = (digest, len(data))
    root, size = encoded[""]
    return EncodedTree(root, size, objects)


def decode_tree(root: bytes, size: int, fetch: Callable[[bytes, int], bytes], where: str,
                budget: TreeBudget | None = None) -> tuple[Tree, dict[bytes, int]]:
    """The tree whose top object is ``root`` (``fetch(digest, size)`` returns a tree
    object's verified bytes), and every tree object it took; ``SandboxError`` (naming
    ``where``) for anything a restore must not create (see the module docstring), and
    for a tree that expands past ``budget`` (by default ``TreeBudget()``), refused as
    soon as it does: a tree object is read and checked once, then expanded at every
    place that names it, each entry counted."""
    budget = budget or TreeBudget()
    max_entries, max_bytes, max_depth = budget.entries, budget.bytes, budget.depth
    tree: Tree = {}
    objects: dict[bytes, int] = {}
    pending: list[tuple[str, bytes, int, int]] = [("", root, size, 0)]
    expanded = claimed = 0
    checked: dict[tuple[bytes, int], list[_Row]] = {}
    while pending:
        prefix, digest, length, depth = pending.pop()
        if expansion_observer is not None:
            expansion_observer(where, expanded)
        if depth > max_depth:
            raise SandboxError(f"the sandbox tree of {where} is deeper than {max_depth} "
                               f"directories")
        rows = checked.get((digest, length))
        if rows is None:
            objects[digest] = length
            rows = checked[digest, length] = _checked_rows(fetch(digest, length), prefix,
                                                           where)
        expanded += len(rows)
        if expanded > max_entries:
            raise SandboxError(
                f"the sandbox tree of {where} expands to more than {max_entries} entries "
                f"(a subtree counts at each place that names it), past "
                f"sandbox_read_max_entries: a scan within that limit never wrote it, so it "
                f"may be crafted; restore an earlier checkpoint, or raise "
                f"CheckpointConfig.sandbox_read_max_entries if the tree is genuine")
        for name, entry, child, child_size in rows:
            path = prefix + name
            tree[path] = entry
            if child is not None:
                pending.append((path + "/", child, child_size, depth + 1))
            elif entry.kind != LINK:
                claimed += entry.size
        if claimed > max_bytes:
            raise SandboxError(
                f"the sandbox tree of {where} claims more than {max_bytes} bytes of files, "
                f"past sandbox_read_max_bytes; restore an earlier checkpoint, or raise "
                f"CheckpointConfig.sandbox_read_max_bytes if the tree is genuine")
    return tree, objects


# One checked row of a tree object: its name, its entry, and for a directory the digest
# and length of the directory's own tree object.
_Row = tuple[str, Entry, bytes | None, int]


def _checked_rows(data: bytes, prefix: str, where: str) -> list[_Row]:
    """A tree object's rows, each checked safe (``prefix``: where it was first met, for
    the errors)."""
    try:
        rows = msgpack.unpackb(_inflate(data, where), raw=False, use_list=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise SandboxError(f"a tree object of {where} does not decode ({exc})") from None
    if not isinstance(rows, list):
        raise SandboxError(f"a tree object of {where} is not a list of entries")
    out: list[_Row] = []
    names: set[str] = set()
    for row in rows:
        if not (isinstance(row, list) and len(row) == 5):
            raise SandboxError(f"the sandbox tree of {where} has a malformed entry "
                               f"{row!r:.100}")
        name, kind, mode, entry_size, blob = row
        if not (isinstance(name, str) and type(kind) is int and kind in _KIND_NAMES
                and type(mode) is int and 0 <= mode <= 0o7777
                and type(entry_size) is int and entry_size >= 0
                and isinstance(blob, bytes)):
            raise SandboxError(f"the sandbox tree of {where} has a malformed entry "
                               f"{row!r:.100}")
        path = prefix + name
        if not _plain_name(name):
            raise SandboxError(f"the sandbox tree of {where} holds the path {path!r}, "
                               f"which would leave its directory; restore an earlier "
                               f"checkpoint")
        if name in names:
            raise SandboxError(f"the sandbox tree of {where} lists {path!r} twice")
        names.add(name)
        if kind != LINK and len(blob) != 16:
            raise SandboxError(f"the sandbox tree of {where} gives {path!r} a digest "
                               f"of {len(blob)} bytes, not 16")
        if kind == DIR:
            out.append((name, Entry(DIR, mode, 0, b""), blob, entry_size))
        else:
            out.append((name, Entry(kind, mode, entry_size, blob), None, 0))
    return out


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name \
        and "\\" not in name and "\x00" not in name


def tree_digests(tree: Tree) -> set[bytes]:
    """The digests of every file in ``tree``."""
    return {e.data for e in tree.values() if e.kind in _CONTENT}


@dataclass(frozen=True)
class TreeStats:
    """What ``nemo-ckpt inspect`` shows of one directory."""

    files: int
    directories: int
    links: int
    bytes: int


def tree_stats(tree: Tree) -> TreeStats:
    files = [e for e in tree.values() if e.kind in _CONTENT]
    return TreeStats(files=len(files),
                     directories=sum(1 for e in tree.values() if e.kind == DIR),
                     links=sum(1 for e in tree.values() if e.kind == LINK),
                     bytes=sum(e.size for e in files))


def diff_trees(old: Tree, new: Tree) -> dict[str, list[str]]:
    """The paths ``new`` adds, removes and changes (content, mode, kind or target)
    relative to ``old``, each sorted."""
    return {"added": sorted(new.keys() - old.keys()),
            "removed": sorted(old.keys() - new.keys()),
            "changed": sorted(p for p in old.keys() & new.keys() if old[p] != new[p])}


def materialize(tree: Tree, target: Path, fetch: Callable[[bytes, int], Any],
                allow_setid: bool = False) -> int:
    """Create ``target`` (it must not exist; its parent must) holding ``tree``.
    ``fetch(digest, size)`` returns a file's verified content (bytes or a buffer).
    Returns the bytes written. Every entry is created new below ``target``: files with
    ``O_EXCL | O_NOFOLLOW``, links as links, sparse files with their holes; a file's
    setuid and setgid bits are dropped unless ``allow_setid``; directories' modes are
    set last, so a read-only directory is filled first. On an error, what was created
    stays for the caller to remove (it made ``target`` for this)."""
    os.mkdir(target, 0o700)
    written = 0
    dir_modes: list[tuple[str, int]] = []
    base = os.fspath(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    for path in sorted(tree):  # a parent sorts before its children
        entry = tree[path]
        full = os.path.join(base, path)
        if entry.kind == DIR:
            os.mkdir(full, 0o700)
            dir_modes.append((full, entry.mode))
        elif entry.kind == LINK:
            os.symlink(os.fsdecode(entry.data), full)
        else:
            content = fetch(entry.data, entry.size)
            view = memoryview(content)
            if entry.kind == SPARSE:
                size, extents, start = sparse_layout(view, full)
            fd = os.open(full, flags, 0o600)
            try:
                if entry.kind == SPARSE:
                    os.ftruncate(fd, size)  # all hole, then the data where it was
                    for offset, length in extents:
                        _write_at(fd, view[start:start + length], offset)
                        start += length
                        written += length
                else:
                    _write_at(fd, view, 0)
                    written += entry.size
                os.fchmod(fd, entry.mode if allow_setid else entry.mode & ~_SETID)
            finally:
                os.close(fd)
    for full, mode in reversed(dir_modes):
        os.chmod(full, mode)
    os.chmod(target, 0o755)
    return written


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
