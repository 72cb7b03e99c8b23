"""Sandbox directories: a session's working directory as a tree of path -> content digest.

A session may own a directory on its node (under ``CheckpointConfig.sandbox_root``).
When one of its turns commits, its holder records the directory's tree with ``scan``:
it walks the directory, re-reads only the files whose size, mtime, ctime, inode or mode
changed since the session's previous tree, puts their content into the node's
``nemo_ckpt.blobs.BlobCache`` under its digest, and encodes again only the directories
along a change. A snapshot then stores the trees and
writes only the blobs its store lacks; a restore rebuilds each directory with
``materialize``.

What a tree may hold, and what it never does:

- regular files (content by digest, mode bits kept), directories (mode bits kept) and
  symbolic links (the link itself, its target as text: never followed);
- no device, FIFO or socket: ``scan`` refuses them with ``SandboxError`` naming the path;
- no path that could leave its directory: a stored tree names entries one directory
  at a time, by plain names (no ``/``, ``.``, ``..``), and only a directory has entries
  below it (a link as a parent would make a write follow it), so ``materialize`` only
  ever creates entries below the directory it made.

Encoded, as git does: one *tree object* per directory, a blob of its own (so a changed
file costs new objects only along its path, not the whole listing), each the msgpack
``[[name, kind, mode, size, data], ...]`` sorted by name, deflated (zlib) when that is
shorter; ``kind`` is 0 for a directory (``data`` its tree object's digest, ``size`` that
object's length), 1 for a file (``data`` its 16-byte XXH3-128 digest), 2 for a link
(``data`` its target, UTF-8 with surrogate escapes). A session's tree is named by its top
object's digest and length.
"""

from __future__ import annotations

import os
import stat
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from nemo_ckpt.blobs import digest_of
from nemo_ckpt.errors import SandboxError

__all__ = ["DIR", "FILE", "LINK", "Entry", "Tree", "TreeStats", "ScanResult", "Seen", "Listing",
           "Listings",
           "EncodedTree", "scan", "encode_tree", "decode_tree", "materialize", "tree_digests",
           "tree_stats", "diff_trees", "pack_tree_object", "MAX_DEPTH"]

DIR, FILE, LINK = 0, 1, 2
_KIND_NAMES = {DIR: "directory", FILE: "file", LINK: "symlink"}
# A file changed within this long before its scan may change again within the same
# filesystem timestamp tick without its mtime moving; it is re-read at the next scan
# (git's "racily clean" entries).
_RACY_NS = 20_000_000


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
MAX_DEPTH = 256  # directories deeper than this are refused when a stored tree is read
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


def scan(directory: Path, previous: Listings | None,
         store: Callable[[str], tuple[bytes, int]], now_ns: int | None = None
         ) -> ScanResult:
    """Record ``directory``'s tree. Entries whose (size, mtime, ctime, inode, mode) match
    ``previous`` keep their entry, and a directory whose entries all do keeps its tree
    object; every other file is handed to ``store(path)``, which reads it, keeps its
    content and returns its digest and length. A file changed within a timestamp tick
    of ``now_ns`` (the scan's start) is re-read next time.

    Raises ``SandboxError`` naming the path of a device, FIFO or socket, of a directory
    deeper than ``MAX_DEPTH``, or when ``directory`` is not a directory."""
    try:
        top = os.lstat(directory)
    except OSError as exc:
        raise SandboxError(f"sandbox directory {directory} cannot be read ({exc})") from None
    if not stat.S_ISDIR(top.st_mode):
        raise SandboxError(f"sandbox directory {directory} is not a directory")
    scanner = _Scanner(directory, previous or {}, store,
                       (time.time_ns() if now_ns is None else now_ns) - _RACY_NS)
    scanner.directory(os.fspath(directory), "", 0)
    return ScanResult(scanner.listings, scanner.objects, scanner.files_read,
                      scanner.bytes_read)


_NOT_SEEN = Seen(None, Entry(-1, 0, 0, b""))


class _Scanner:
    """One scan (see ``scan``): directories depth first, each encoded after its
    subdirectories, and only when one of its entries changed."""

    def __init__(self, top: Path, previous: Listings,
                 store: Callable[[str], tuple[bytes, int]], racy_after: int) -> None:
        self.top = top
        self.previous = previous
        self.store = store
        self.racy_after = racy_after
        self.listings: Listings = {}
        self.objects: dict[bytes, bytes] = {}
        self.files_read = self.bytes_read = 0

    def directory(self, path: str, rel: str, depth: int) -> Listing:
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
        try:
            items = list(os.scandir(path))
        except OSError as exc:
            raise SandboxError(f"sandbox directory {path} cannot be listed ({exc})") from None
        if len(items) != len(old_entries):
            changed = True  # with every name found below, the names are the same ones
        # This loop runs once per entry at every turn commit (benchmarks/sandboxes.py):
        # an unchanged file costs its stat, one lookup, one comparison and one store.
        regular, fmt_bits = stat.S_IFREG, 0o170000
        for item in items:
            name = item.name
            st = item.stat(follow_symlinks=False)
            mode = st.st_mode
            seen = old_get(name, _NOT_SEEN)
            if mode & fmt_bits == regular:
                key: tuple[int, int, int, int, int] | None = (
                    st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, mode)
                if seen.key == key:
                    entries[name] = seen  # not racy when recorded, and unchanged since
                    continue
                digest, size = self.store(item.path)
                self.files_read += 1
                self.bytes_read += size
                if size != st.st_size or max(st.st_mtime_ns, st.st_ctime_ns) \
                        >= self.racy_after:
                    key = None  # written while read, or maybe again within the same tick
                entry = Entry(FILE, mode & 0o7777, size, digest)
            elif stat.S_ISDIR(mode):
                sub = self.directory(item.path, prefix + name, depth + 1)
                key = None
                entry = Entry(DIR, stat.S_IMODE(mode), sub.size, sub.digest)
                if seen.entry == entry:
                    entries[name] = seen
                    continue
            elif stat.S_ISLNK(mode):
                key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, mode)
                if seen.key == key:
                    entries[name] = seen
                    continue
                target = os.fsencode(os.readlink(item.path))
                entry = Entry(LINK, 0o777, len(target), target)
            else:
                raise SandboxError(
                    f"sandbox {self.top} holds {item.path}, a {_special_kind(mode)}: a "
                    f"sandbox may hold files, directories and symlinks only; remove it "
                    f"before the turn commits")
            if seen.entry == entry:
                renewed = True
                entries[name] = Seen(key, seen.entry)
            else:
                changed = True
                entries[name] = Seen(key, entry)
        if old is not None and not changed:
            listing = old if not renewed else Listing(
                entries, old.digest, old.size, old.files, old.file_count, old.file_bytes)
        else:
            listing = self._encode(entries)
        self.listings[rel] = listing
        return listing

    def _encode(self, entries: dict[str, Seen]) -> Listing:
        rows = []
        files = []
        for name in sorted(entries):
            e = entries[name].entry
            rows.append([name, e.kind, e.mode, e.size, e.data])
            if e.kind == FILE:
                files.append(e)
        data = pack_tree_object(rows)
        digest = digest_of(data)
        self.objects[digest] = data
        return Listing(entries, digest, len(data), frozenset(e.data for e in files),
                       len(files), sum(e.size for e in files))


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


def decode_tree(root: bytes, size: int, fetch: Callable[[bytes, int], bytes], where: str
                ) -> tuple[Tree, dict[bytes, int]]:
    """The tree whose top object is ``root`` (``fetch(digest, size)`` returns a tree
    object's verified bytes), and every tree object it took; ``SandboxError`` (naming
    ``where``) for anything a restore must not create (see the module docstring)."""
    tree: Tree = {}
    objects: dict[bytes, int] = {}
    pending: list[tuple[str, bytes, int, int]] = [("", root, size, 0)]
    while pending:
        prefix, digest, length, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise SandboxError(f"the sandbox tree of {where} is deeper than {MAX_DEPTH} "
                               f"directories")
        objects[digest] = length
        data = fetch(digest, length)
        try:
            rows = msgpack.unpackb(_inflate(data, where), raw=False, use_list=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise SandboxError(f"a tree object of {where} does not decode ({exc})") from None
        if not isinstance(rows, list):
            raise SandboxError(f"a tree object of {where} is not a list of entries")
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
            if kind in (DIR, FILE) and len(blob) != 16:
                raise SandboxError(f"the sandbox tree of {where} gives {path!r} a digest "
                                   f"of {len(blob)} bytes, not 16")
            if kind == DIR:
                tree[path] = Entry(DIR, mode, 0, b"")
                pending.append((path + "/", blob, entry_size, depth + 1))
            else:
                tree[path] = Entry(kind, mode, entry_size, blob)
    return tree, objects


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name \
        and "\\" not in name and "\x00" not in name


def tree_digests(tree: Tree) -> set[bytes]:
    """The digests of every file in ``tree``."""
    return {e.data for e in tree.values() if e.kind == FILE}


@dataclass(frozen=True)
class TreeStats:
    """What ``nemo-ckpt inspect`` shows of one directory."""

    files: int
    directories: int
    links: int
    bytes: int


def tree_stats(tree: Tree) -> TreeStats:
    files = [e for e in tree.values() if e.kind == FILE]
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


def materialize(tree: Tree, target: Path, fetch: Callable[[bytes, int], Any]) -> int:
    """Create ``target`` (it must not exist; its parent must) holding ``tree``.
    ``fetch(digest, size)`` returns a file's verified content (bytes or a buffer).
    Returns the bytes written. Every entry is created new below ``target``: files with
    ``O_EXCL | O_NOFOLLOW``, links as links; directories' modes are set last, so a
    read-only directory is filled first. On an error, what was created stays for the
    caller to remove (it made ``target`` for this)."""
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
            fd = os.open(full, flags, 0o600)
            try:
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, entry.mode)
            finally:
                os.close(fd)
            written += entry.size
    for full, mode in reversed(dir_modes):
        os.chmod(full, mode)
    os.chmod(target, 0o755)
    return written
