"""A tree as stored: its tree objects, written and read back (a stored tree may come
from anyone).

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
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from nemo_ckpt.errors import SandboxError
from nemo_ckpt.trees.blob_store import digest_of
from nemo_ckpt.trees.limits import TreeBudget
from nemo_ckpt.trees.tree_types import DIR, KIND_NAMES, LINK, Entry, Tree

# Called by ``decode_tree`` with (where, entries expanded so far) as it reads each tree
# object: the simulation observes that no read expands past its budget.
expansion_observer: Callable[[str, int], None] | None = None
_INFLATE_RATIO = 32  # rows hold a random 16-byte digest each: they never deflate this far


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
    ``where``) for anything a restore must not create (``nemo_ckpt.trees.tree_types``), and
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
        if not (isinstance(name, str) and type(kind) is int and kind in KIND_NAMES
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
