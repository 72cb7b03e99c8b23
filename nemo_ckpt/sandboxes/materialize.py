"""Creating a sandbox directory again from its stored tree (``materialize``), below a
directory it makes, never following a link; setuid and setgid bits dropped unless
allowed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_ckpt.sandboxes.extents import sparse_layout
from nemo_ckpt.sandboxes.tree_types import DIR, LINK, SPARSE, Tree

_SETID = 0o6000


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
