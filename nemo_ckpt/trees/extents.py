"""Sparse files: where a file's data lies, and the sparse blob that stores it.

A sparse blob holds a file's data extents only, never its holes: the msgpack header
``[1, apparent size, [offset, length, offset, length, ...]]`` (extents in order, none
overlapping, within the apparent size), then the extents' bytes one after the other.
Its digest, like any blob's, is the XXH3-128 of those bytes, so hashing and storing cost
the data, not the holes. A file is stored sparse when it has a hole of at least
``MIN_HOLE`` before its end (``SEEK_HOLE``); shorter holes are kept as zeros, and a file
with more than ``MAX_EXTENTS`` extents has its shortest holes kept as zeros until it
has fewer. ``materialize`` recreates the holes (``ftruncate`` to the apparent size, each
extent written at its offset). The sandbox limits (``SandboxLimits``) count what is
stored: a sparse file's blob, not its apparent size.
"""

from __future__ import annotations

import errno
import os

import msgpack

from nemo_ckpt.errors import SandboxError

MIN_HOLE = 64 << 10  # shorter holes are stored as zeros (see the module docstring)
MAX_EXTENTS = 1 << 16
SPARSE_VERSION = 1
HEADER_MAX = 32 + 2 * 9 * MAX_EXTENTS  # msgpack: at most 9 bytes per integer


def find_extents(fd: int, size: int, limit: int) -> list[tuple[int, int]] | None:
    """``fd``'s data extents as (start, end), holes shorter than ``MIN_HOLE`` kept as
    data; None when that leaves one extent over the whole file (or the filesystem does
    not say). Never more than ``MAX_EXTENTS``: past it, shorter holes are merged. Stops
    once they hold more than ``limit`` bytes (the caller refuses the file): each step
    adds data, so a hostile layout costs at most ``limit`` over a block's size steps."""
    extents: list[tuple[int, int]] = []
    min_hole = MIN_HOLE
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
                while len(extents) > MAX_EXTENTS:
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


def sparse_header(size: int, extents: list[tuple[int, int]]) -> bytes:
    """A sparse blob's header for a file of ``size`` bytes whose data is ``extents``
    (as (start, end)); its extents' bytes follow it."""
    return msgpack.packb([SPARSE_VERSION, size, [x for s, e in extents for x in (s, e - s)]])


def sparse_layout(data: bytes | memoryview, where: str) -> tuple[int, list[tuple[int, int]], int]:
    """A sparse blob's apparent size, its extents as (offset, length), and where their
    bytes start in ``data``; ``SandboxError`` (naming ``where``) unless they fit."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=HEADER_MAX,
                                max_array_len=2 * MAX_EXTENTS)
    unpacker.feed(bytes(memoryview(data)[:HEADER_MAX]))
    try:
        header = unpacker.unpack()
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData) as exc:
        raise SandboxError(f"the sparse file {where} does not decode ({exc})") from None
    start = unpacker.tell()
    bad = SandboxError(f"the sparse file {where} has a malformed layout; restore an "
                       f"earlier checkpoint")
    if not (isinstance(header, list) and len(header) == 3 and header[0] == SPARSE_VERSION
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
