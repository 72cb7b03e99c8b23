"""The coordinator's claims on snapshot folders, its clean-up after a commit, and the
per-folder lock that keeps a manifest's rename and a clean-up apart.

A snapshot claims its folder (``nemo_ckpt.storage.path_claims.claim_path``) beside the pause and
renews the claim with its lease; the claim carries this coordinator's incarnation and a
beat redrawn at each write, so a successor that took this incarnation for dead and
aborted the snapshot fences it (the manifest's write checks the beat). After a commit,
the files the new manifest no longer names go, never those of an operation in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Collection

from actors.coordinator.read_claim import ReadClaim
from actors.coordinator.states import SnapshotOperation
from nemo_ckpt.errors import NemoCkptError
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.storage.cleanup import remove_unreferenced_files
from nemo_ckpt.storage.path_claims import (
    claim_for_reading,
    claim_path,
    live_claims,
    read_claims,
    release_claim,
)
from nemo_ckpt.transport import Runtime

__all__ = ["CLAIM_SAFE", "ClaimedFolders"]

log = logging.getLogger("nemo_ckpt.coordinator")
# Of a claim's ttl, how much may pass since it was last written before the commit
# writes it again: readers' clocks may run up to 10% faster than ours.
CLAIM_SAFE = 0.8


class ClaimedFolders:
    """This coordinator's claims on snapshot folders, and the folders' locks."""

    def __init__(self, runtime: Runtime, owner: str, incarnation: str,
                 watch: ClaimWatch, ttl: Callable[[], float]) -> None:
        self._runtime = runtime
        self._clock = runtime.clock
        self._owner = owner
        self._incarnation = incarnation
        self._watch = watch
        self._ttl = ttl  # how long a claim stands without a renewal
        self._locks = _KeyedLocks()  # by folder path: manifest writes and clean-ups
        # By operation: its claim's writes one at a time. Two at once (a renewal and the
        # commit's rewrite of a stale claim) would each find the other's beat or version,
        # and take it for a successor's fence.
        self._claim_writes = _KeyedLocks()

    @property
    def locks_held(self) -> int:
        """How many folders' locks are held or awaited now."""
        return len(self._locks)

    async def claim(self, op: SnapshotOperation) -> None:
        """Claim (or renew the claim on) the snapshot's folder: refused while another
        job's snapshot is in progress there."""
        assert op.path is not None
        async with self._claim_writes.hold(op.id):
            start = self._clock.monotonic()
            beat = self._runtime.token()
            # A renewal only renews: a claim this incarnation no longer has was removed
            # by a successor's abort (fenced), and must not come back.
            renewing = frozenset(op.claim_beats) if op.claim_beats else None
            op.claim_beats.add(beat)  # before the write: it may land and still raise
            await self._runtime.run_blocking(
                claim_path, environment_folder(op.path), op.id, self._owner, self._watch,
                self._ttl(), self._incarnation, beat, renewing)
            op.claimed_at = start

    def stale(self, written_at: float | None) -> bool:
        """Whether a claim or hold written at ``written_at`` (our monotonic clock) may be
        near its end on a reader whose clock runs faster than ours."""
        return (written_at is None
                or self._clock.monotonic() - written_at > self._ttl() * CLAIM_SAFE)

    async def clean_up(self, op: SnapshotOperation, open_ids: Collection[str]) -> list[str]:
        """After ``op`` committed: remove the files the manifest there no longer names,
        and stale claims; never a file of an operation in progress (``open_ids`` of this
        job, or another's). Under the folder's lock, so no commit of this coordinator
        renames a manifest into the folder meanwhile. Returns the names removed."""
        assert op.path is not None
        directory = environment_folder(op.path)
        ours = set(open_ids)

        def clean() -> list[str]:
            try:
                protect = live_claims(directory, self._owner, self._watch, ours,
                                      self._incarnation)
            finally:
                # Even when the others' claims cannot be read: the operation committed,
                # and its claim left behind would hold the path for nothing.
                release_claim(directory, op.id)
            for claim in read_claims(directory):
                if claim.operation not in protect:
                    release_claim(directory, claim.operation)
            return remove_unreferenced_files(directory, protect)

        try:
            async with self.lock(op.path):
                removed: list[str] = await self._runtime.run_blocking(clean)
            return removed
        except (OSError, NemoCkptError) as exc:
            log.warning("clean-up after %s failed: %s", op.id, exc)
            return []

    def hold_for_reading(self, path: str, operation_id: str) -> ReadClaim:
        """Claim the folder at ``path`` for a restore, renewed until the restore ends
        (``ReadClaim.release``, from its commit or its abort): a removal
        (``nemo_ckpt.catalog.listing``) is refused meanwhile, so a restore whose commit fails can
        read the snapshot again. Never refused itself (``claim_for_reading``); a claim that
        cannot be written (a read-only copy of a snapshot) does not stop the restore:
        nothing can remove files there either. Returned as its first write starts, so an
        abort that comes meanwhile finds it (``ReadClaim.written`` waits for that write)."""
        directory = environment_folder(path)

        async def write() -> None:
            await self._runtime.run_blocking(claim_for_reading, directory, operation_id,
                                             self._owner, self._ttl(), self._incarnation)

        return ReadClaim(self._runtime, directory, operation_id, write,
                         lambda: self._ttl() * CLAIM_SAFE / 2)

    def lock(self, path: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Serializes manifest writes and clean-ups in one folder."""
        return self._locks.hold(path)


class _KeyedLocks:
    """An asyncio lock per key, forgotten once no call holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # key -> lock, users

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
