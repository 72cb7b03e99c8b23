"""``RlFiles``: RL's own files in a checkpoint path, a folder or a bucket's prefix
(``s3://``, ``az://``, ...), for RL's half of a snapshot (``RlHalf``) to write in
``save`` and read in ``restore``, with no internal name.

Each file is written whole, replacing any older one atomically (the ``Folder``'s
write). A stored file is hostile input: a read is bounded by the caller's
``max_bytes`` (a size a store announces is a claim; nothing past the bound is read),
JSON is decoded by the one bounded decoder of stored JSON (size and depth), and a name
that is not a regular file (a FIFO, a link) is refused before a byte is read. Every
failure is one line naming the file: ``RlFileNotFoundError``, ``RlFileInvalidError``,
``CheckpointPathError`` (cannot be read), ``SnapshotWriteError`` (cannot be written).
The ``_async`` forms run the same work off the event loop: in a thread, or through the
job's runtime (``run_blocking=ckpt.run_blocking``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from nemo_ckpt.errors import CheckpointPathError, RlFileInvalidError, RlFileNotFoundError
from nemo_ckpt.manager.record import RECORD_FILE
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.manifest import ENVIRONMENT_DIR, is_plain_file_name
from nemo_ckpt.storage.stored_json import StoredJsonError, load_stored_json

__all__ = ["RESERVED_NAMES", "RlFiles"]

# The names in a checkpoint path that are nemo-ckpt's, never RL's.
RESERVED_NAMES = frozenset({ENVIRONMENT_DIR, RECORD_FILE})

RunBlocking = Callable[..., Awaitable[Any]]


class RlFiles:
    """RL's files directly in ``checkpoint_path`` (a folder, or a URL).

    Args:
        checkpoint_path: The snapshot's path, as ``RlHalf.save``/``restore`` get it.
        run_blocking: Runs the ``_async`` forms' work off the loop (the job's
            ``RayEnvironmentCheckpoint.run_blocking``); default ``asyncio.to_thread``.
    """

    def __init__(self, checkpoint_path: str | Path, *,
                 run_blocking: RunBlocking | None = None) -> None:
        self.checkpoint_path = str(checkpoint_path)
        self._folder: Folder = folder_at(checkpoint_path)
        self._run: RunBlocking = run_blocking or asyncio.to_thread

    def describe(self, name: str = "") -> str:
        """The checkpoint path, or ``name`` in it, as a user would write it."""
        return self._folder.describe(name)

    # --- blocking ---------------------------------------------------------------------

    def write(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (durable when this returns), replacing an older one."""
        _check_name(name)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"RL's file {self.describe(name)} takes bytes, not "
                            f"{type(data).__name__}; use write_json for a JSON value")
        self._folder.prepare()
        self._folder.write_bytes(name, bytes(data))

    def read(self, name: str, *, max_bytes: int) -> bytes:
        """``name``'s bytes, refused past ``max_bytes`` (``RlFileInvalidError``)."""
        _check_name(name)
        _check_bound(max_bytes)
        where = self.describe(name)
        try:
            data = self._folder.read(name, limit=max_bytes + 1)
        except FileNotFoundError:
            raise RlFileNotFoundError(
                self.checkpoint_path, f"RL's file {where} does not exist: the snapshot's "
                                      f"RL half did not write it (or it was removed); "
                                      f"restore a snapshot that has it") from None
        except OSError as exc:
            raise CheckpointPathError(
                self.checkpoint_path, f"cannot read RL's file {where}: "
                                      f"{exc.strerror or exc}") from None
        if len(data) > max_bytes:
            raise RlFileInvalidError(
                self.checkpoint_path, f"RL's file {where} is larger than the {max_bytes} "
                                      f"bytes its reader allows: damaged or not RL's; "
                                      f"raise max_bytes if RL writes that much")
        return data

    def write_json(self, name: str, value: Any) -> None:
        """Write ``value`` as JSON (bytes are not JSON: encode them first)."""
        try:
            text = json.dumps(value, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"RL's file {self.describe(name)} cannot be written as JSON: "
                            f"{exc}; encode such values first (bytes as hex or base64)"
                            ) from None
        self.write(name, text.encode())

    def read_json(self, name: str, *, max_bytes: int) -> Any:
        """``name`` decoded as JSON, bounded in size (``max_bytes``) and depth."""
        data = self.read(name, max_bytes=max_bytes)
        try:
            return load_stored_json(data, self.describe(name), max_bytes)
        except StoredJsonError as exc:
            raise RlFileInvalidError(self.checkpoint_path, str(exc)) from None

    def names(self) -> list[str]:
        """RL's files in the checkpoint path, sorted (not nemo-ckpt's own)."""
        return sorted(n for n in self._folder.names() if n not in RESERVED_NAMES)

    def remove(self, names: Iterable[str]) -> None:
        """Remove ``names``; a missing one is no error."""
        names = list(names)
        for name in names:
            _check_name(name)
        self._folder.remove(names)

    # --- on an event loop ---------------------------------------------------------------

    async def write_async(self, name: str, data: bytes) -> None:
        await self._run(self.write, name, data)

    async def read_async(self, name: str, *, max_bytes: int) -> bytes:
        return bytes(await self._run(_call(self.read, name, max_bytes=max_bytes)))

    async def write_json_async(self, name: str, value: Any) -> None:
        await self._run(self.write_json, name, value)

    async def read_json_async(self, name: str, *, max_bytes: int) -> Any:
        return await self._run(_call(self.read_json, name, max_bytes=max_bytes))

    async def names_async(self) -> list[str]:
        return list(await self._run(self.names))

    async def remove_async(self, names: Iterable[str]) -> None:
        await self._run(self.remove, list(names))


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """``fn`` with its arguments, for a runner that passes positional ones only."""
    return lambda: fn(*args, **kwargs)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not is_plain_file_name(name):
        raise ValueError(f"RL's file name {name!r} is not a plain file name (no folders, "
                         f"no '..'): RL's files lie directly in the checkpoint path")
    if name in RESERVED_NAMES:
        raise ValueError(f"{name!r} is nemo-ckpt's own in a checkpoint path; give RL's "
                         f"file another name")


def _check_bound(max_bytes: int) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an int >= 0, not {max_bytes!r}")
