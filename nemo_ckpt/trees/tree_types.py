"""A sandbox directory's tree, as recorded and as restored: path -> entry.

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

Where a tree comes from and goes: ``nemo_ckpt.trees.scan`` records one from a
directory, ``nemo_ckpt.trees.tree_codec`` stores and reads it, and
``nemo_ckpt.trees.materialize`` creates it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

DIR, FILE, LINK, SPARSE = 0, 1, 2, 3
KIND_NAMES = {DIR: "directory", FILE: "file", LINK: "symlink", SPARSE: "sparse file"}
CONTENT_KINDS = (FILE, SPARSE)  # kinds whose data is a blob of the file's content


# ``store(chunks)``: keep a blob's content, given as chunks, and return its digest and
# length. It may raise whatever the chunks raise (the scan reads the file as it stores).
Store = Callable[[Iterable[bytes]], tuple[bytes, int]]


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


def tree_digests(tree: Tree) -> set[bytes]:
    """The digests of every file in ``tree``."""
    return {e.data for e in tree.values() if e.kind in CONTENT_KINDS}


@dataclass(frozen=True)
class TreeStats:
    """What ``nemo-ckpt inspect`` shows of one directory."""

    files: int
    directories: int
    links: int
    bytes: int


def tree_stats(tree: Tree) -> TreeStats:
    files = [e for e in tree.values() if e.kind in CONTENT_KINDS]
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
