"""Collecting the blob store: removing the sandbox files no committed snapshot references.

A blob stays while any committed manifest under the checkpoint root references it
(through its trees), and while any snapshot in progress holds the store (it may rely on
a blob it found there). Live sessions reference their node's cache, never only the
store, so collecting the store cannot take a file a live session needs
(``actors.holder.sandboxes``). A collection:

1) claims the store (``BlobStore.begin_collection``), refused while a snapshot holds it;
2) lists every committed snapshot under the root and the blobs their trees reference; a
   snapshot whose trees cannot be read refuses the collection (what it references is
   unknown, so nothing is provably garbage);
3) removes every other blob, and temp files of writes that died, each removal inside
   the claim's life; then drops the claim.

It runs after each commit (the coordinator: a bounded round before the commit answers,
then the rest in the background, which the next snapshot interrupts and the next
collection resumes; ``actors.coordinator.blobs``) and as ``nemo-ckpt gc ROOT``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nemo_ckpt.errors import (
    CheckpointPathBusyError,
    CheckpointPathError,
    NemoCkptError,
    SandboxError,
    SnapshotReadError,
)
from nemo_ckpt.storage.checkpoint_folder import environment_folder, folder_at
from nemo_ckpt.storage.claims import ClaimWatch
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.location import join_location
from nemo_ckpt.storage.snapshot_files import committed_snapshots, holds_manifest, read_manifest
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore
from nemo_ckpt.trees.container_record import decode_record
from nemo_ckpt.trees.limits import TreeBudget
from nemo_ckpt.trees.snapshot_trees import blob_store_of, fetch_tree, read_trees_file
from nemo_ckpt.trees.tree_types import tree_digests

__all__ = ["CollectionReport", "collect_blobs", "collect_quietly", "snapshot_refs",
           "RefsCache"]

log = logging.getLogger("nemo_ckpt.collection")

# A removal is started only while this much of the claim is left (a renewal that
# failed to land, or a stall, must not let a removal run past the claim).
_MARGIN_S = 5.0
_WAIT_POLL_S = 1.0  # how often a collection told to wait tries the store again


@dataclass
class CollectionReport:
    """What one collection found and did."""

    store: str
    snapshots: list[str] = field(default_factory=list)
    referenced: int = 0
    removed: int = 0
    removed_bytes: int = 0
    kept: int = 0
    dry_run: bool = False
    interrupted: bool = False  # stopped early for a snapshot (``should_stop``)


RefsCache = dict[tuple[str, str], frozenset[bytes]]


def check_collection_root(root: str | Path) -> None:
    """Refuse, with ``CheckpointPathError``, a ``root`` a user typed that is no checkpoint
    root: one with nothing there (a mistyped path, which a collection's claim would
    create) or a snapshot's own path (its blobs lie in the store of the root above it).
    The coordinator's own collections need no check: they run under its configured
    root, after a commit there."""
    folder = folder_at(str(root))
    where = folder.describe()
    problem = folder.problem()
    if problem is not None:
        raise CheckpointPathError(where, f"{problem}: pass the checkpoint root "
                                         f"(CheckpointConfig.checkpoint_root)")
    subfolders = folder.subfolders()
    if not subfolders and not folder.names():
        raise CheckpointPathError(
            where, f"there is nothing at {where}, so it is no checkpoint root (mistyped?): "
                   f"pass CheckpointConfig.checkpoint_root; nothing was created")
    if holds_manifest(str(root), subfolders):
        raise CheckpointPathError(
            where, f"{where} is a snapshot, not a checkpoint root: pass the root it lies "
                   f"under (CheckpointConfig.checkpoint_root), whose blobs/ it uses; to "
                   f"remove this snapshot, use `nemo-ckpt rm`")


def snapshot_refs(path: str, store: BlobStore, cache: RefsCache | None = None,
                  budget: TreeBudget | None = None) -> frozenset[bytes]:
    """Every blob (trees and files) the snapshot at ``path`` references; a
    ``SnapshotReadError`` when its manifest, a trees file or a tree cannot be read.
    ``cache`` keeps the answer per (path, snapshot id): a committed snapshot's
    references never change."""
    manifest = read_manifest(path)
    key = (path, manifest.snapshot_id)
    if cache is not None and key in cache:
        return cache[key]
    refs: set[bytes] = set()
    if blob_store_of(path, manifest) is not None:
        directory: Folder = environment_folder(path)
        for shard in manifest.shards:
            if shard.trees is None:
                continue
            containers: dict[str, bytes] = {}
            rows = read_trees_file(directory, shard.trees, shard.instance_id, containers)
            for rollout_id, raw in containers.items():  # a container's memory blob
                try:
                    record = decode_record(raw, f"{rollout_id} in {path}")
                except SandboxError as exc:  # what it references is unknown
                    raise SnapshotReadError(path, str(exc)) from exc
                if record.memory is not None:
                    refs.add(record.memory)
            for rollout_id, _, tree_digest, tree_size, _ in rows:
                if tree_digest in refs:
                    continue
                try:
                    tree, objects = fetch_tree(store, None, tree_digest, tree_size,
                                               f"{rollout_id} in {path}", budget)
                except SandboxError as exc:  # what it references is unknown
                    raise SnapshotReadError(path, str(exc)) from exc
                refs.update(objects)
                refs |= tree_digests(tree)
    out = frozenset(refs)
    if cache is not None:
        for old in [k for k in cache if k[0] == path]:  # a replaced snapshot's
            del cache[old]
        cache[key] = out
    return out


def collect_blobs(root: str | Path, owner: str | None = None, ttl_s: float = 30.0,
                  dry_run: bool = False, clock: Callable[[], float] = time.monotonic,
                  cache: RefsCache | None = None,
                  should_stop: Callable[[], bool] = lambda: False,
                  watch: ClaimWatch | None = None, wait_s: float = 0.0,
                  sleep: Callable[[float], None] = time.sleep,
                  budget: TreeBudget | None = None,
                  pending: set[bytes] | None = None,
                  max_removals: int | None = None) -> CollectionReport:
    """Collect the blob store under ``root`` (see the module docstring). Raises
    ``CheckpointPathBusyError`` while a snapshot holds the store or another collection
    runs, and a ``SnapshotReadError`` naming the snapshot whose references could not be
    read (nothing is removed then). ``should_stop`` is asked between steps: true (a
    snapshot of this job began) ends the collection early, ``interrupted``.

    Time is this process's own: ``clock`` is a monotonic clock (a fake one in tests),
    on which the collection renews its claim and ``watch`` (by default a new one on
    ``clock``) judges the others' claims. A claim seen for the first time is live, so a
    busy store is retried, watching, for up to ``wait_s`` seconds (``sleep`` between
    tries) before the refusal: long enough, a hold whose snapshot died is seen
    abandoned. Each tree is read within ``budget`` (by default ``TreeBudget()``): one past
    it refuses the collection.

    ``pending``, the caller's, kept across collections, makes one that ``should_stop``
    interrupted resume where it stopped (issue 56): the garbage it had found and not yet
    removed is left in it, and the next collection removes what of it no committed
    snapshot references now (a snapshot committed since may reference a blob again),
    without listing the store; once it is empty, the store is listed again. A snapshot
    still in progress cannot rely on one of them: it holds the store, and no collection
    begins while it does. ``max_removals`` ends it, interrupted, after that many."""
    where = join_location(root, BLOB_DIR)
    store = BlobStore(where, folder_at)
    report = CollectionReport(store=where, dry_run=dry_run)
    owner = owner or f"collector-{uuid.uuid4().hex[:8]}"
    watch = watch or ClaimWatch(clock)
    claim = _KeptClaim(store, owner, ttl_s, clock,
                       _claim(store, owner, ttl_s, watch, clock, wait_s, sleep))
    try:
        referenced = _referenced(root, store, cache, budget, report, claim.keep,
                                 should_stop)
        if referenced is None:
            report.interrupted = True
            return report
        if cache is not None:  # snapshots removed since: forget them
            for old in [k for k in cache if k[0] not in report.snapshots]:
                del cache[old]
        report.referenced = len(referenced)
        if pending and not dry_run:  # an interrupted collection's garbage, still garbage
            garbage = sorted(pending - referenced)
            pending.clear()
        else:
            present = store.digests()
            garbage = sorted(present - referenced)
            report.kept = len(present) - len(garbage)
        if dry_run:
            report.removed = len(garbage)
            return report
        for k, digest in enumerate(garbage):
            claim.keep()
            if should_stop() or (max_removals is not None and report.removed >= max_removals):
                report.interrupted = True
                if pending is not None:
                    pending.update(garbage[k:])
                return report
            claim.refuse_if_short(where, report.removed)
            try:
                report.removed_bytes += store.size(digest)
            except FileNotFoundError:
                continue
            store.remove([digest])
            report.removed += 1
        store.remove_temp_files()
    finally:
        store.claims.end_collection()
    return report


class _KeptClaim:
    """A collection's claim on ``store``, taken by ``_claim`` (which says by when on
    ``clock``, ``until``, it runs out): renewed as the work goes, and refused when too
    little of it is left to remove another blob."""

    def __init__(self, store: BlobStore, owner: str, ttl_s: float,
                 clock: Callable[[], float], until: float) -> None:
        self._store, self._owner, self._ttl_s, self._clock = store, owner, ttl_s, clock
        self.until = until

    def keep(self) -> None:
        """Renew the claim once half of it has run out."""
        if self._clock() > self.until - self._ttl_s / 2:
            renewed = self._clock() + self._ttl_s
            self._store.claims.renew_collection(self._owner, self._ttl_s)
            self.until = renewed

    def refuse_if_short(self, where: str, removed: int) -> None:
        """``CheckpointPathBusyError`` when the claim may run out before the next
        removal ends."""
        if self._clock() > self.until - _MARGIN_S:
            raise CheckpointPathBusyError(
                f"collection of {where} ran out of its claim ({self._ttl_s:g}s) after "
                f"removing {removed} blobs; run it again")


def _claim(store: BlobStore, owner: str, ttl_s: float, watch: ClaimWatch,
           clock: Callable[[], float], wait_s: float, sleep: Callable[[float], None]
           ) -> float:
    """Claim ``store`` for a collection, retrying a busy one for up to ``wait_s``
    seconds; the time on ``clock`` by which the claim must be renewed."""
    give_up = clock() + wait_s
    while True:
        # A short claim, renewed as the work goes: one left by a collector that died
        # blocks snapshots' writes for about ttl_s. It runs out ttl_s after the write, on
        # this clock: read before the write, ``until`` errs early.
        until = clock() + ttl_s
        try:
            store.claims.begin_collection(owner, ttl_s, watch)
            return until
        except CheckpointPathBusyError as exc:
            left = give_up - clock()
            if left <= 0:
                if wait_s > 0:
                    raise CheckpointPathBusyError(f"{exc}; gave up after waiting "
                                                  f"{wait_s:g}s") from exc
                raise
            sleep(min(_WAIT_POLL_S, left))


def _referenced(root: str | Path, store: BlobStore, cache: RefsCache | None,
                budget: TreeBudget | None, report: CollectionReport,
                keep_claim: Callable[[], None], should_stop: Callable[[], bool]
                ) -> set[bytes] | None:
    """The digests the committed snapshots under ``root`` reference, each snapshot read
    added to ``report``; None when ``should_stop`` ends the collection first."""
    referenced: set[bytes] = set()
    for path in committed_snapshots(root):
        keep_claim()
        if should_stop():
            return None
        try:
            referenced |= snapshot_refs(path, store, cache, budget)
        except SnapshotReadError as exc:
            raise type(exc)(exc.path, f"collection of {report.store} stopped, nothing "
                                      f"was removed: {exc}") from exc
        report.snapshots.append(path)
    return referenced


def collect_quietly(root: str | Path, owner: str, cache: RefsCache,
                    clock: Callable[[], float] = time.monotonic,
                    should_stop: Callable[[], bool] = lambda: False,
                    watch: ClaimWatch | None = None,
                    budget: TreeBudget | None = None,
                    pending: set[bytes] | None = None,
                    max_removals: int | None = None) -> CollectionReport | None:
    """``collect_blobs`` after a commit, at once: a busy store or an unreadable snapshot
    skips it (the next commit, or ``nemo-ckpt gc``, tries again), with a log line.
    ``watch`` and ``pending``: the caller's, kept across collections (see
    ``collect_blobs``)."""
    try:
        return collect_blobs(root, owner, cache=cache, clock=clock, should_stop=should_stop,
                             watch=watch, budget=budget, pending=pending,
                             max_removals=max_removals)
    except (NemoCkptError, OSError) as exc:
        log.info("blob collection under %s skipped: %s", root, exc)
        return None
