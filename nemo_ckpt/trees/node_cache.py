"""The node's blob cache: what a holder's turn commits read, kept for its live sessions
and its next snapshots (see ``nemo_ckpt.trees.blob_store`` for the two places blobs
live).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path

import xxhash

from nemo_ckpt.storage.local_folder import read_regular
from nemo_ckpt.storage.store_errors import NotARegularFileError
from nemo_ckpt.trees.blob_store import digest_of, hex_of

__all__ = ["BlobCache"]

_WHOLE_READ = 8 << 20  # content up to this is hashed and kept in one piece


class BlobCache:
    """A holder's blobs on its node (see the module docstring).

    Small blobs (tree objects, small files) are held in memory up to ``memory_budget``
    bytes, and the rest in files: a turn commit that changed a small file then creates
    no file of its own (creating one is most of a capture's cost on a busy disk;
    ``benchmarks/sandboxes.py``). Both tiers die with the holder, as its sessions do."""

    def __init__(self, directory: Path, memory_budget: int = 128 << 20,
                 memory_blob_max: int = 1 << 20) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.memory_budget = memory_budget
        self.memory_blob_max = memory_blob_max
        self._memory: dict[bytes, bytes] = {}
        self.memory_bytes = 0

    def path(self, digest: bytes) -> Path:
        return self.directory / hex_of(digest)

    def held(self, digest: bytes) -> bytes | None:
        """``digest``'s content if it is held in memory."""
        return self._memory.get(digest)

    def store(self, chunks: Iterable[bytes]) -> tuple[bytes, int]:
        """Keep the content ``chunks`` make up, and return its digest and length. What the
        chunks raise propagates, and nothing of that content is kept."""
        head: list[bytes] = []
        length = 0
        it = iter(chunks)
        for chunk in it:
            head.append(chunk)
            length += len(chunk)
            if length > _WHOLE_READ:
                return self._store_stream(head, it)
        data = head[0] if len(head) == 1 else b"".join(head)
        digest = digest_of(data)
        self.put(digest, data)
        return digest, length

    def _store_stream(self, head: list[bytes], rest: Iterable[bytes]) -> tuple[bytes, int]:
        hasher = xxhash.xxh3_128()
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        length = 0
        try:
            with open(tmp, "xb") as out:
                for chunks in (head, rest):
                    for chunk in chunks:
                        hasher.update(chunk)
                        out.write(chunk)
                        length += len(chunk)
            digest = hasher.digest()
            if self.has(digest):
                tmp.unlink()
            else:
                os.replace(tmp, self.path(digest))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return digest, length

    def put(self, digest: bytes, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` (already verified as ``digest``)."""
        if digest in self._memory:
            return
        n = len(data)
        if n <= self.memory_blob_max and self.memory_bytes + n <= self.memory_budget:
            self._memory[digest] = bytes(data)
            self.memory_bytes += n
        elif not self.path(digest).exists():
            self._place(digest, data)

    def _place(self, digest: bytes, data: bytes | bytearray | memoryview) -> None:
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as out:
                out.write(data)
            os.replace(tmp, self.path(digest))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, digest: bytes, size: int | None = None) -> bytes | None:
        """The content of ``digest`` if cached and intact, else None."""
        data = self._memory.get(digest)
        if data is not None:
            return data if size is None or len(data) == size else None
        try:
            data = read_regular(self.path(digest))
        except (FileNotFoundError, NotARegularFileError):
            return None
        if (size is not None and len(data) != size) or digest_of(data) != digest:
            return None
        return data

    def has(self, digest: bytes) -> bool:
        return digest in self._memory or self.path(digest).exists()

    def remove(self, digests: Iterable[bytes]) -> None:
        for d in digests:
            data = self._memory.pop(d, None)
            if data is not None:
                self.memory_bytes -= len(data)
            else:
                self.path(d).unlink(missing_ok=True)
