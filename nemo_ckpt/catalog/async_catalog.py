"""The catalog's calls for a caller on an event loop (a driver's, a rollout checkpoint
manager's): each ``<call>_async`` does what ``<call>`` does, in a worker thread, so the
loop keeps running while manifests, shards and blobs are read or removed.

``progress`` is called on the event loop's thread (as a callback scheduled from the
worker), so it may touch what the loop's other tasks use; each call is delivered before
the awaited result. Cancelling the await stops the work at its next reported step (a
manifest read, a shard or directory verified, a snapshot kept or removed) and never in
the middle of one: a removal under way finishes, and releases its claim, first. The
``remove_snapshot_async`` of a single snapshot, which reports no steps, runs to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from nemo_ckpt.catalog.listing import (
    LatestSnapshot,
    RemovalReport,
    RetentionReport,
    SnapshotInfo,
    keep_last,
    latest_snapshot,
    list_snapshots,
    remove_snapshot,
)
from nemo_ckpt.catalog.verification import VerifyReport, verify_snapshot
from nemo_ckpt.progress import CatalogProgress, ProgressCallback

__all__ = ["keep_last_async", "latest_snapshot_async", "list_snapshots_async",
           "remove_snapshot_async", "verify_snapshot_async"]

T = TypeVar("T")


class _Cancelled(Exception):
    """Raised in the worker at its next step once its caller was cancelled."""


async def _in_thread(work: Callable[[ProgressCallback], T],
                     progress: ProgressCallback | None) -> T:
    """``work(report)`` in a worker thread; ``report`` hands each step to ``progress`` on
    this loop, and stops the work once the caller was cancelled."""
    loop = asyncio.get_running_loop()
    cancelled = threading.Event()

    def report(step: CatalogProgress) -> None:
        if cancelled.is_set():
            raise _Cancelled
        if progress is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                loop.call_soon_threadsafe(progress, step)

    try:
        return await asyncio.to_thread(work, report)
    except asyncio.CancelledError:
        cancelled.set()
        raise


async def list_snapshots_async(root: Path | str,
                               progress: ProgressCallback | None = None
                               ) -> list[SnapshotInfo]:
    """``list_snapshots`` without blocking the event loop (see the module docstring)."""
    return await _in_thread(lambda report: list_snapshots(root, report), progress)


async def latest_snapshot_async(root: Path | str, verify: bool = True, warn: bool = True,
                                progress: ProgressCallback | None = None) -> LatestSnapshot:
    """``latest_snapshot`` without blocking the event loop (see the module docstring)."""
    return await _in_thread(lambda report: latest_snapshot(root, verify, warn, report),
                            progress)


async def verify_snapshot_async(checkpoint_path: Path | str,
                                progress: ProgressCallback | None = None) -> VerifyReport:
    """``verify_snapshot`` without blocking the event loop (see the module docstring)."""
    return await _in_thread(lambda report: verify_snapshot(checkpoint_path, report),
                            progress)


async def keep_last_async(root: Path | str, n: int, verify: bool = False,
                          wait_s: float = 0.0,
                          clock: Callable[[], float] = time.monotonic,
                          sleep: Callable[[float], None] = time.sleep,
                          progress: ProgressCallback | None = None,
                          dry_run: bool = False) -> RetentionReport:
    """``keep_last`` without blocking the event loop (see the module docstring); its
    waits for claims (``wait_s``) sleep in the worker thread."""
    return await _in_thread(
        lambda report: keep_last(root, n, verify, wait_s, clock, sleep, report, dry_run),
        progress)


async def remove_snapshot_async(path: Path | str, root: Path | str | None = None,
                                collect: bool = True, wait_s: float = 0.0,
                                clock: Callable[[], float] = time.monotonic,
                                sleep: Callable[[float], None] = time.sleep,
                                snapshot_id: str | None = None) -> RemovalReport:
    """``remove_snapshot`` without blocking the event loop (see the module docstring)."""
    return await asyncio.to_thread(remove_snapshot, path, root, collect, wait_s, clock,
                                   sleep, snapshot_id)
