"""The blob store's claims: collection and the snapshots that rely on blobs already
stored exclude each other.

Collection and the snapshots that rely on blobs already stored must exclude each other
(a snapshot that found a blob present must not see it removed before its manifest
commits). Both sides write a claim in the store's root folder first and read the
others' after, so of two that overlap at least one sees the other:

1) (coordinator, each snapshot) ``hold(op)`` beside its path claim; renewed with it;
2) (each holder, in its persist) ``wait_for_collection()``, then the store's
   ``missing(...)`` and ``put`` for those; the shard names what it references;
3) (coordinator) the manifest commits, then ``release(op)``;
4) (collector: after a commit, or ``nemo-ckpt gc``) ``begin_collection()``: refused while
   any snapshot holds the store; then removes blobs no committed manifest references,
   each removal within its claim's life; ``end_collection()``.

Claims carry no time to compare: each reader judges them on its own monotonic clock
(``nemo_ckpt.storage.claims``), so a host whose clock is ahead cannot take a live hold as over.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from nemo_ckpt.errors import CheckpointPathBusyError, CheckpointPathError, NemoCkptError
from nemo_ckpt.storage.claims import (
    MAX_CLAIM_BYTES,
    STALE_FACTOR,
    Claim,
    ClaimWatch,
    decode_claim,
    encode_claim,
    write_claim,
)
from nemo_ckpt.storage.folder import Folder, remove_if_holds

__all__ = ["BlobClaims", "COLLECTOR"]

COLLECTOR = "collector"  # the operation name of a collection's claim
_CLAIM_PREFIX = ".claim-"


class BlobClaims:
    """The claims in one blob store's root folder (see the module docstring)."""

    def __init__(self, where: str, root: Folder) -> None:
        self.where = where
        self._root = root
        # This collection's claim, every write of it (the last one may have failed and
        # landed all the same); empty when none runs.
        self._collecting: list[bytes] = []

    def _claims(self) -> dict[str, tuple[Claim, bytes]]:
        """Every claim, by operation, with the bytes it was read from (one gone since the
        listing, or not a claim at all, is skipped). A claim that cannot be read raises
        ``CheckpointPathError``: skipped, a hold could let a collection remove what its
        snapshot relies on."""
        claims: dict[str, tuple[Claim, bytes]] = {}
        for name in self._root.names():
            if not (name.startswith(_CLAIM_PREFIX) and name.endswith(".json")):
                continue
            try:
                data = self._root.read(name, MAX_CLAIM_BYTES + 1)
            except FileNotFoundError:
                continue
            except OSError as exc:
                where = self._root.describe(name)
                raise CheckpointPathError(where, f"cannot read the claim {where}: "
                                                 f"{exc.strerror or exc}") from exc
            try:
                claim = decode_claim(data)
            except (ValueError, KeyError, TypeError):
                continue
            claims[claim.operation] = (claim, data)
        return claims

    def _observe(self, watch: ClaimWatch) -> tuple[dict[str, tuple[Claim, bytes]],
                                                    dict[str, float]]:
        claims = self._claims()
        return claims, watch.observe(self.where, [c for c, _ in claims.values()])

    def hold(self, operation: str, owner: str, ttl_s: float) -> None:
        """A snapshot relies on the store for ``ttl_s`` seconds (repeat to renew)."""
        self._root.prepare()
        data, _ = encode_claim(operation, owner, ttl_s)
        self._root.write_bytes(_claim_name(operation), data, sync=False)

    def release(self, operation: str) -> None:
        self._root.remove([_claim_name(operation)])

    def live_collection(self, watch: ClaimWatch) -> Claim | None:
        """The collection's claim, unless none is there or ``watch`` has seen it
        unchanged for its ttl (its collector died)."""
        claims, left = self._observe(watch)
        found = claims.get(COLLECTOR)
        return found[0] if found is not None and left[COLLECTOR] > 0 else None

    def wait_for_collection(self, clock: Callable[[], float] = time.monotonic,
                            sleep: Callable[[float], None] = time.sleep,
                            deadline: float | None = None,
                            watch: ClaimWatch | None = None) -> None:
        """Return once no collection runs (call it after ``hold``): a collection that
        began before the hold may still remove blobs, so none may be relied on yet. A
        collection's claim ends when its collector drops it, or once seen unchanged for
        its ttl on ``clock`` (this process's monotonic clock; ``deadline`` is on it).
        ``watch``, on ``clock``, kept by the caller across waits: a claim it saw before
        is taken as abandoned sooner than by a new one."""
        watch = watch or ClaimWatch(clock)
        while True:
            claims, left = self._observe(watch)
            if COLLECTOR not in claims or left[COLLECTOR] <= 0:
                return
            if deadline is not None and clock() >= deadline:
                raise CheckpointPathBusyError(
                    f"the blob store {self.where} is being collected by "
                    f"{claims[COLLECTOR][0].owner}; the snapshot cannot rely on it "
                    f"before that ends (or its claim is seen unchanged for "
                    f"{left[COLLECTOR]:.0f}s more)")
            sleep(min(0.05, left[COLLECTOR]))

    def begin_collection(self, owner: str, ttl_s: float, watch: ClaimWatch) -> None:
        """Claim the store for a collection of ``ttl_s`` seconds (renew it within that,
        on the collector's own clock), or ``CheckpointPathBusyError`` while a snapshot
        holds it or another collection runs, as ``watch`` judges them: a claim it sees
        for the first time is live. On a local folder, and on a bucket whose store
        enforces conditional writes, two collectors cannot both begin (an exclusive
        create); on other buckets the claim is advisory (docs/DESIGN.md)."""
        name = _claim_name(COLLECTOR)
        self._root.prepare()
        claims, left = self._observe(watch)
        if COLLECTOR in claims:
            claim, data = claims[COLLECTOR]
            if left[COLLECTOR] > 0:
                raise self._busy_collecting(claim.owner, left[COLLECTOR])
            # Abandoned: its collector died. Drop exactly the write judged so.
            if not remove_if_holds(self._root, name, (data,)) and \
                    self._root.version(name) is not None:
                raise self._busy_collecting(claim.owner, claim.ttl_s * STALE_FACTOR)
        data, _ = encode_claim(COLLECTOR, owner, ttl_s)
        try:
            # Our own claim met by a retry is ours; one that failed otherwise is gone.
            write_claim(self._root, name, data)
        except FileExistsError:
            raise self._busy_collecting("another collector", ttl_s * STALE_FACTOR) from None
        self._collecting = [data]
        try:
            claims, left = self._observe(watch)
        except BaseException:
            # Ours must not linger with no collection behind it: every snapshot's
            # persist would wait on it until it is taken as abandoned.
            self._drop_own(name)
            raise
        mine = claims.get(COLLECTOR)
        if mine is None or mine[1] != data:  # a bucket: another collector wrote since
            self._drop_own(name)
            raise self._busy_collecting(mine[0].owner if mine else "another collector",
                                        ttl_s * STALE_FACTOR)
        holding = {op: left[op] for op in claims if op != COLLECTOR and left[op] > 0}
        if holding:
            self.end_collection()
            raise CheckpointPathBusyError(
                f"the blob store {self.where} is in use by snapshot(s) "
                f"{sorted(holding)[:5]}; collect once they have committed (a hold whose "
                f"snapshot died is taken as abandoned once seen unchanged for "
                f"{max(holding.values()):.0f}s more)")

    def _drop_own(self, name: str) -> None:
        """Remove the claim ``name`` if it is still one this collection wrote (best
        effort: it expires by itself otherwise), and forget them."""
        ours, self._collecting = self._collecting, []
        with contextlib.suppress(OSError, NemoCkptError):
            remove_if_holds(self._root, name, ours)

    def _busy_collecting(self, owner: str, left_s: float) -> CheckpointPathBusyError:
        return CheckpointPathBusyError(
            f"the blob store {self.where} is already being collected by {owner} (a "
            f"collection whose collector died is taken as abandoned once its claim is "
            f"seen unchanged for {left_s:.0f}s more)")

    def renew_collection(self, owner: str, ttl_s: float) -> None:
        """Extend this collection's claim by ``ttl_s`` seconds from now (a snapshot that
        held the store meanwhile waits for it to end); ``CheckpointPathBusyError`` if
        the claim is no longer this collection's (it overran, and another took it)."""
        name = _claim_name(COLLECTOR)
        try:
            current: bytes | None = self._root.read(name, MAX_CLAIM_BYTES + 1)
        except FileNotFoundError:
            current = None
        if current is None or current not in self._collecting:
            self._collecting = []
            raise CheckpointPathBusyError(
                f"the collection of {self.where} lost its claim (it was renewed too late "
                f"and dropped); run it again")
        data, _ = encode_claim(COLLECTOR, owner, ttl_s)
        # Kept before the write: it may land and still raise, and the collection's end
        # must remove it then too.
        self._collecting.append(data)
        self._root.write_bytes(name, data, sync=False)

    def end_collection(self) -> None:
        """Drop this collection's claim (not another collector's that replaced it)."""
        ours, self._collecting = self._collecting, []
        if ours:
            remove_if_holds(self._root, _claim_name(COLLECTOR), ours)

    def clear_dead_collection(self, owner: str) -> bool:
        """Drop a collection claim of ``owner`` that its owner knows it is not running
        (a collection of this coordinator incarnation that ended without its release):
        snapshots need not wait for it to be seen abandoned. Returns whether there was
        one. A predecessor incarnation's claim is another owner's: it may run again."""
        claim = self._claims().get(COLLECTOR)
        if claim is None or claim[0].owner != owner:
            return False
        self.release(COLLECTOR)
        return True


def _claim_name(operation: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in operation)
    return f"{_CLAIM_PREFIX}{safe}.json"
