"""Creating a sandbox directory again from its stored tree (``materialize``), below a
directory it makes, never following a link; setuid and setgid bits dropped unless
allowed.

Every entry is made relative to its parent directory's descriptor (``dir_fd``), walked
depth first, so the kernel resolves one name per entry, never a path; a file is created
with its final mode where the process's umask leaves it as it is, saving a ``fchmod``
(benchmarks/sandboxes_vs_restic.py)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_ckpt.trees.extents import sparse_layout
from nemo_ckpt.trees.tree_types import DIR, LINK, SPARSE, Tree

_SETID = 0o6000
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC


def materialize(tree: Tree, target: Path, fetch: Callable[[bytes, int], Any],
                allow_setid: bool = False) -> int:
    """Create ``target`` (it must not exist; its parent must) holding ``tree``.
    ``fetch(digest, size)`` returns a file's verified content (bytes or a buffer).
    Returns the bytes written. Every entry is created new below ``target``: files with
    ``O_EXCL | O_NOFOLLOW``, links as links, sparse files with their holes; a file's
    setuid and setgid bits are dropped unless ``allow_setid``; directories' modes are
    set last, so a read-only directory is filled first. On an error, what was created
    stays for the caller to remove (it made ``target`` for this). Safe to run for
    several targets at once, in threads."""
    os.mkdir(target, 0o700)
    umask = _umask()
    written = 0
    dir_modes: list[tuple[str, int]] = []
    base = os.fspath(target)
    # The open directories from ``target`` down to the last one entered: (path, fd).
    stack: list[tuple[str, int]] = [("", os.open(base, _OPEN_DIR))]
    try:
        # Depth first (by path components), so a directory's entries follow it.
        for path in sorted(tree, key=lambda p: p.split("/")):
            entry = tree[path]
            parent, _, name = path.rpartition("/")
            while len(stack) > 1 and stack[-1][0] != parent:
                os.close(stack.pop()[1])
            if stack[-1][0] != parent:
                raise FileNotFoundError(errno.ENOENT, "its directory is not in the tree",
                                        os.path.join(base, path))
            at = stack[-1][1]
            if entry.kind == DIR:
                os.mkdir(name, 0o700, dir_fd=at)
                dir_modes.append((os.path.join(base, path), entry.mode))
                stack.append((path, os.open(name, _OPEN_DIR, dir_fd=at)))
            elif entry.kind == LINK:
                os.symlink(os.fsdecode(entry.data), name, dir_fd=at)
            else:
                written += _file(at, name, entry, fetch(entry.data, entry.size),
                                 entry.mode if allow_setid else entry.mode & ~_SETID,
                                 umask, os.path.join(base, path))
    finally:
        for _, fd in stack:
            os.close(fd)
    for full, mode in reversed(dir_modes):
        os.chmod(full, mode)
    os.chmod(target, 0o755)
    return written


def _file(at: int, name: str, entry: Any, content: Any, mode: int, umask: int,
          full: str) -> int:
    """Create file ``name`` in directory ``at`` with ``content``; the bytes written."""
    view = memoryview(content)
    if entry.kind == SPARSE:
        size, extents, start = sparse_layout(view, full)
    # Created with its mode where the umask keeps it whole (no special bits): no fchmod.
    direct = not mode & 0o7000 and not mode & umask
    fd = os.open(name, _CREATE, mode if direct else 0o600, dir_fd=at)
    try:
        if entry.kind == SPARSE:
            os.ftruncate(fd, size)  # all hole, then the data where it was
            written = 0
            for offset, length in extents:
                _write_at(fd, view[start:start + length], offset)
                start += length
                written += length
        else:
            _write_at(fd, view, 0)
            written = int(entry.size)
        if not direct:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return written


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, which
    would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o777  # unknown: every file gets its fchmod


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
