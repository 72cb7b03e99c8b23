"""The coordinator's side of the blob store: snapshots' holds on it, and its collection.

A snapshot whose sessions may own sandboxes holds the root's blob store
(``nemo_ckpt.trees.blob_claims``) from its pause to its end, since it relies on the
blobs it found present; no collection runs while any hold stands. After a commit that may have made
blobs garbage (an older snapshot replaced or removed, one aborted after writing), the
store is collected (``nemo_ckpt.trees.collection``): one bounded round before the
commit answers, then the rest in the background; one collection at a time, and one more
when a commit lands while it runs.

Under frequent snapshots (issue 56: one a second grew a store from 92 to 11,528 files),
the next snapshot interrupted every background collection before it removed anything,
and its hold refused the next one. Now the round before the commit answers runs while no
snapshot of this driver can hold the store (its next one begins after this answer), and
is not interrupted by one; it removes at least as many blobs as the committed snapshot
references (each snapshot adds at most that many), or ``MIN_ROUND_REMOVALS``, within
``round_s``; and an interrupted collection resumes with the garbage it had found
(``collect_blobs``'s ``pending``). So the store stays within what the retained snapshots
reference plus a margin of about a snapshot's blobs, at any cadence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.storage.snapshot_files import committed_snapshots
from nemo_ckpt.transport import Runtime
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore
from nemo_ckpt.trees.collection import (
    CollectionReport,
    RefsCache,
    collect_quietly,
    snapshot_refs,
)
from nemo_ckpt.trees.limits import TreeBudget

__all__ = ["BlobCollector", "MIN_ROUND_REMOVALS"]

# The least a commit's round removes (when there is that much garbage) before it answers.
MIN_ROUND_REMOVALS = 256

log = logging.getLogger("nemo_ckpt.coordinator")


class BlobCollector:
    """Holds and collects the blob store of one checkpoint root."""

    def __init__(self, root: str | None, runtime: Runtime, owner: str, collector: str,
                 claim_watch: ClaimWatch, busy: Callable[[], bool],
                 budget: TreeBudget | None = None) -> None:
        """``root`` is the checkpoint root when sessions may own sandboxes (else None:
        no store); ``collector`` names this incarnation in the store's collection claim;
        ``busy`` tells whether an operation is open (a collection yields to it)."""
        self._root = root
        self._runtime = runtime
        self._clock = runtime.clock
        self._owner = owner
        self._collector = collector
        self._claim_watch = claim_watch
        self._busy = busy
        self._budget = budget  # what one read of a snapshot's tree may expand to
        self._collection: asyncio.Future[Any] | None = None
        self._collect_again = False
        self._refs_cache: RefsCache = {}  # committed snapshots' references, by id
        self.last: CollectionReport | None = None
        # Whether blobs may have become garbage since the last collection: a commit
        # replaced an older snapshot, one aborted after writing, or snapshots went
        # (their paths, as that collection found them, tell).
        self._garbage_possible = True
        self._snapshots_seen: frozenset[str] = frozenset()
        # Garbage an interrupted collection found and did not remove: the next resumes.
        self._pending: set[bytes] = set()

    @property
    def store(self) -> BlobStore | None:
        """The root's store of sandbox files, when sessions may own sandboxes."""
        if self._root is None:
            return None
        return BlobStore(join_location(self._root, BLOB_DIR), folder_at)

    def garbage_possible(self) -> None:
        """Blobs may have lost their last reference: the next collection looks."""
        self._garbage_possible = True

    async def hold(self, op_id: str, ttl: float, first: bool) -> float | None:
        """Hold the store for the snapshot ``op_id`` (or renew its hold); returns when
        (this process's monotonic clock) the hold was written, or None without a store.
        The first hold of a snapshot also drops a collection claim a predecessor of this
        job left when it died: the holders need not wait it out."""
        store = self.store
        if store is None:
            return None
        start = self._clock.monotonic()
        await self._runtime.run_blocking(store.claims.hold, op_id, self._owner, ttl)
        if first and (self._collection is None or self._collection.done()):
            if await self._runtime.run_blocking(store.claims.clear_dead_collection,
                                                self._collector):
                log.warning("dropped the blob store's collection claim that a previous "
                            "coordinator of this job left when it died")
        return start

    async def release(self, op_id: str) -> None:
        """Drop the snapshot's hold; one that cannot be removed expires by itself."""
        store = self.store
        if store is None:
            return
        try:
            await self._runtime.run_blocking(store.claims.release, op_id)
        except (OSError, NemoCkptError) as exc:
            log.warning("could not release the blob store's claim of %s: %s", op_id, exc)

    def start(self) -> None:
        """Collect the store in the background, if it may hold garbage."""
        root = self._root
        if root is None:
            return
        if self._collection is not None and not self._collection.done():
            self._collect_again = True
            return

        async def run() -> None:
            while True:
                self._collect_again = False
                if not await self._needed(root):
                    return
                self._garbage_possible = False
                await self._collect(self._busy)
                if not self._collect_again:
                    return

        self._collection = asyncio.ensure_future(run())
        self._collection.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _needed(self, root: str) -> bool:
        """Whether blobs may have lost their last reference since the last collection."""
        snapshots = frozenset(await self._runtime.run_blocking(committed_snapshots, root))
        if not self._garbage_possible and snapshots >= self._snapshots_seen:
            # Nothing replaced, aborted or removed since the last collection: no blob can
            # have lost its last reference. (Collecting anyway costs a listing of the
            # store and every new snapshot's trees, in this process, beside the next
            # pause.)
            self._snapshots_seen = snapshots
            return False
        return True

    async def _collect(self, should_stop: Callable[[], bool],
                       max_removals: int | None = None) -> CollectionReport | None:
        """One collection, resuming the garbage an interrupted one left; its report."""
        assert self._root is not None
        resumed = bool(self._pending)
        report = await self._runtime.run_blocking(
            collect_quietly, self._root, self._collector, self._refs_cache,
            self._clock.monotonic, should_stop, self._claim_watch, self._budget,
            self._pending, max_removals)
        if report is None or report.interrupted or resumed:
            # The next commit tries again; after a resumed one, the store is listed.
            self._garbage_possible = True
        if report is not None and not report.interrupted:
            self.last = report
            self._snapshots_seen = frozenset(report.snapshots)
        if report is not None and report.removed:
            log.info("collected %d blobs (%d bytes) from %s%s", report.removed,
                     report.removed_bytes, report.store,
                     " (interrupted: the next collection resumes)" if report.interrupted
                     else "")
        return report

    async def collect_round(self, committed: str, round_s: float) -> None:
        """The commit of the snapshot at ``committed`` collects before it answers: one
        round that no snapshot interrupts, ended once it removed as many blobs as that
        snapshot references (at least ``MIN_ROUND_REMOVALS``) or after ``round_s``
        seconds; a background collection still running yields to it first (this
        commit's operation is open, so it stops at its next step)."""
        if self._root is None:
            return
        while self._collection is not None and not self._collection.done():
            await asyncio.wait([self._collection])
        try:
            if not await self._needed(self._root):
                return
        except (NemoCkptError, OSError) as exc:
            log.info("blob collection under %s skipped: %s", self._root, exc)
            return
        store = self.store
        assert store is not None
        try:
            refs = await self._runtime.run_blocking(
                snapshot_refs, committed, store, self._refs_cache, self._budget)
        except (NemoCkptError, OSError):
            refs = frozenset()  # the round still runs; the collection says what failed
        ends = self._clock.monotonic() + round_s
        self._garbage_possible = False
        await self._collect(lambda: self._clock.monotonic() > ends,
                            max(MIN_ROUND_REMOVALS, len(refs)))

    async def done(self) -> CollectionReport | None:
        """Wait for the collection in progress, if any; the last one's report."""
        while self._collection is not None and not self._collection.done():
            await asyncio.wait([self._collection])
        return self.last
