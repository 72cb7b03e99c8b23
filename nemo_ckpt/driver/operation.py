"""The skeleton a driver's snapshot and restore share: one operation open at a time
(``OpenOperations``: refused while another is open, given an id, its lease renewed
from the start, aborted on every holder by whatever ends it early), its steps
(``Operation``: a phase, a refusal, the shielded commit whose lost answer the abort
decides), its root span, and the checkpoint path it is handed.

``RayEnvironmentCheckpoint`` (``nemo_ckpt.driver.checkpoint``) holds one
``OpenOperations``; its restore and the snapshot operation
(``nemo_ckpt.driver.snapshot_operation``) open their operations through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from nemo_ckpt import tracing
from nemo_ckpt.driver.link import CoordinatorLink, finish
from nemo_ckpt.errors import (
    BackendUnavailableError,
    CheckpointPathError,
    NemoCkptError,
    SnapshotInProgressError,
)
from nemo_ckpt.storage.location import LocalLocation, join_location, levels_below, parse_location

__all__ = ["OpenOperations", "Operation", "checkpoint_location", "operation_span"]

log = logging.getLogger("nemo_ckpt")


class OpenOperations:
    """The one snapshot or restore open on this driver (see the module docstring)."""

    def __init__(self, link: CoordinatorLink) -> None:
        self._link = link
        self._open: str | None = None
        self._closed: asyncio.Event | None = None  # set when the open operation ends

    @property
    def current(self) -> str | None:
        """The id of the snapshot or restore open now, if any."""
        return self._open

    def refuse_if_open(self, what: str) -> None:
        if self._open is not None:
            raise SnapshotInProgressError(
                f"cannot {what} while {self._open} is open; finish its `async with` block "
                f"first")

    async def wait_closed(self) -> None:
        """Return once no snapshot or restore is open here."""
        while self._closed is not None:
            await self._closed.wait()

    @contextlib.asynccontextmanager
    async def open(self, kind: str, path: str | None) -> AsyncIterator[Operation]:
        """One snapshot or restore: refused while another is open, given an id, its lease
        renewed from the start (phases and reads can be long), and aborted on every
        holder by whatever ends it early (``Operation``'s steps)."""
        self.refuse_if_open(kind)
        op = Operation(self._link.new_operation_id("snap" if kind == "snapshot"
                                                   else "restore"), path, self._link)
        self._set_open(op.id)
        try:
            async with self._link.renewing(op.id):
                try:
                    yield op
                except BaseException as exc:
                    if not op.ended:  # the caller's block, or a step before it, raised
                        await op.end(exc)
                    raise
        finally:
            self._set_open(None)

    def _set_open(self, op_id: str | None) -> None:
        self._open = op_id
        if op_id is not None:
            self._closed = asyncio.Event()
        elif self._closed is not None:
            self._closed.set()
            self._closed = None


@contextlib.asynccontextmanager
async def operation_span(name: str, op_id: str, path: str, **attributes: Any
                         ) -> AsyncIterator[Any]:
    """The operation's root span (``nemo_ckpt.tracing``), entered and left in the
    caller's task, around the caller's block too."""
    with tracing.span(name, **{"operation.id": op_id, "path": path}, **attributes) as s:
        yield s


def checkpoint_location(checkpoint_path: Path | str, root: Path | str | None) -> str:
    """``checkpoint_path`` as the actors are handed it, or ``CheckpointPathError``:
    every node resolves it alike only when it is absolute, and the blob store and
    ``check_startup``'s probes are the root's, so it must lie below the root."""
    location = parse_location(checkpoint_path)
    text = str(location)
    if isinstance(location, LocalLocation) and not location.path.is_absolute():
        raise CheckpointPathError(
            text, f"checkpoint path {text!r} is relative: the holders on other nodes "
                  f"would resolve it against their own working directories; pass an "
                  f"absolute path (os.path.abspath)")
    if root is not None and levels_below(root, text) is None:
        raise CheckpointPathError(
            text, f"checkpoint path {text} is not below CheckpointConfig.checkpoint_root "
                  f"{root}; pass a path below the root (one per checkpoint, e.g. "
                  f"{join_location(root, 'step-100')}), or set checkpoint_root to a "
                  f"folder that holds it")
    return text


class Operation:
    """The steps of one open snapshot or restore (``OpenOperations.open``): each ends
    the operation on every holder when it fails, once."""

    def __init__(self, op_id: str, path: str | None, link: CoordinatorLink) -> None:
        self.id = op_id
        self.path = path  # a snapshot's; None for a restore
        self._link = link
        self.ended = False

    async def end(self, cause: BaseException) -> str | None:
        """Abort the operation everywhere; its outcome ("committed" if its commit won)."""
        self.ended = True
        return await self._link.abort(self.id, self.path, cause)

    async def step(self, call: Awaitable[Any]) -> Any:
        """A phase before the caller's block; a failure aborts and propagates."""
        try:
            return await call
        except BaseException as exc:
            await self.end(exc)
            raise

    async def fail(self, error: BaseException) -> None:
        """Abort with ``error`` and raise it (a refusal after the caller's block)."""
        await self.end(error)
        raise error

    async def commit(self, call: Awaitable[Any], lost: Callable[[], Any],
                     beside: Callable[[], object] | None = None) -> Any:
        """The commit, shielded from this task's cancellation (raised after it), with
        ``beside`` sent once the commit has left. A commit that failed is aborted, and
        the abort's answer decides: the commit may have won after all (its reply was
        lost, or the coordinator died right after it), and then ``lost()`` stands for
        its answer. Otherwise every holder drops the operation and the error propagates."""
        commit = asyncio.ensure_future(call)
        if beside is not None:
            # After the commit's first step (queued first), which sends it.
            asyncio.get_running_loop().call_soon(beside)
        answer, cancelled = await finish(commit)  # the commit's call ends by its deadline
        if isinstance(answer, BaseException):
            outcome = await self.end(answer)
            if outcome != "committed":
                if cancelled:
                    raise asyncio.CancelledError()
                if outcome is None and getattr(answer, "timed_out", False):
                    raise outcome_unknown(self.id, self.path, answer)
                raise answer
            log.warning("%s: its commit call failed (%s), but the commit won: its "
                        "outcome is committed", self.id, answer)
            answer = lost()
        if cancelled:
            raise asyncio.CancelledError()
        return answer


def outcome_unknown(op_id: str, path: str | None, cause: BaseException) -> NemoCkptError:
    """The error of a commit that missed its deadline and whose abort could not learn
    its outcome either (a coordinator that does not answer): it may still commit."""
    if path is not None:
        what, then = (f"snapshot {op_id} into {path}", "Retry it (a snapshot into the "
                      "same path replaces it); `nemo-ckpt ls` shows what committed")
    else:
        what, then = (f"restore {op_id}", "Its sessions may go live: "
                      "`ckpt.holders()` shows them; retry once the coordinator answers")
    error = BackendUnavailableError(
        f"the commit of {what} got no answer by its deadline ({cause}), and the abort "
        f"that asks the coordinator for its outcome got none either: it may still "
        f"commit. {then}")
    error.unreachable, error.timed_out = "coordinator", True
    return error
