"""The snapshots under a checkpoint root as a collection: list them, find the newest one
that verifies, remove one, keep the last N.

A snapshot is committed once its manifest is written (``nemo_ckpt.storage.snapshot_files``), so
the collection is every checkpoint path below the root that holds a manifest
(``committed_snapshots`` there). Newest first means by the manifest's ``sequence``
(format 6): a coordinator numbers each commit one more than the highest it has seen
under its root (``nemo_ckpt.storage.commit_sequence``, read once per coordinator, then its
own commits and the snapshot it restored), because the hosts that commit a root's snapshots
over a job's restarts have clocks with any offset, and one host's clock may step back.
Two coordinators committing under one root at once may give one number twice; the time
their hosts wrote (``created_at``), then the id, break such ties, and order the
snapshots of earlier formats, which carry no sequence, after those that do. A snapshot
whose manifest does not read has no place we can trust: it is listed first, as it may be
the newest, and ``latest_snapshot`` says why it was passed over.

A removal is safe beside a running job. It claims the snapshot's folder as a snapshot
does (``nemo_ckpt.storage.path_claims``), so it is refused while a snapshot is in progress there
or a restore reads it, and a snapshot that begins during the removal is refused in turn
(``CheckpointPathBusyError``) rather than having its files taken. It removes the
manifest first, so a removal cut short leaves no committed snapshot that is missing
files, then the shards and trees files, then collects the blob store
(``nemo_ckpt.trees.collection``), which keeps every blob another committed snapshot references.
Only the environment's half of a checkpoint path is removed, and its ``environment/``
folder once empty (on a filesystem); RL's files there are RL's.

A removal's claim left by a process that died (a crash mid-removal) is judged as every
claim is (``nemo_ckpt.storage.claims``): on this process's monotonic clock, by one watch
kept for the process's life, so a later call that sees it unchanged for its ttl takes it
as abandoned and removes it. A call that sees it for the first time cannot tell, and is
refused, saying how long to wait.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from nemo_ckpt.catalog.verification import one_line, verify_snapshot
from nemo_ckpt.errors import (
    CheckpointPathBusyError,
    CheckpointPathError,
    NemoCkptError,
    SnapshotNotFoundError,
    SnapshotReadError,
)
from nemo_ckpt.progress import CatalogProgress, ProgressCallback
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.claims import STALE_FACTOR, ClaimWatch
from nemo_ckpt.storage.cleanup import manifest_snapshot_id, remove_unreferenced_files
from nemo_ckpt.storage.folder import Folder
from nemo_ckpt.storage.local_folder import LocalFolder
from nemo_ckpt.storage.location import LocalLocation, parent_location, parse_location
from nemo_ckpt.storage.manifest import MANIFEST_NAME, Manifest
from nemo_ckpt.storage.names import SHARD_PREFIX
from nemo_ckpt.storage.path_claims import (
    REMOVAL_PREFIX,
    claim_path,
    drop_abandoned,
    read_claims,
    release_claim,
)
from nemo_ckpt.storage.snapshot_files import committed_snapshots, read_manifest
from nemo_ckpt.trees.collection import CollectionReport, collect_blobs
from nemo_ckpt.trees.snapshot_trees import blob_store_of

__all__ = ["LatestSnapshot", "RemovalReport", "RetentionReport", "SkippedSnapshot",
           "SnapshotInfo", "claim_for_removal", "keep_last",
           "latest_snapshot", "list_snapshots", "remove_snapshot"]

log = logging.getLogger("nemo_ckpt.catalog")

# A removal's claim: long enough for a removal's few file operations, short enough that
# one left by a remover that died blocks snapshots into that path only briefly.
_REMOVAL_TTL_S = 30.0
_WAIT_POLL_S = 1.0


@dataclass(frozen=True)
class SnapshotInfo:
    """One committed snapshot: its path and its manifest's facts, or why the manifest
    does not read (``error``; the facts are None then)."""

    path: str
    snapshot_id: str | None = None
    created_at: datetime | None = None
    sequence: int | None = None  # format 6 (the module docstring)
    format_version: int | None = None
    instances: int = 0
    rollouts: int = 0  # captured
    restarted_rollouts: int = 0
    bytes: int = 0  # its shards'
    blob_store: str | None = None
    error: str | None = None

    @property
    def readable(self) -> bool:
        return self.error is None

    @classmethod
    def of(cls, path: str, manifest: Manifest) -> SnapshotInfo:
        created = manifest.created_at
        if created.tzinfo is None:  # formats before 3 may carry no zone: they wrote UTC
            created = created.replace(tzinfo=timezone.utc)
        return cls(path=path, snapshot_id=manifest.snapshot_id, created_at=created,
                   sequence=manifest.sequence, format_version=manifest.format_version,
                   instances=len(manifest.instances), rollouts=manifest.sessions,
                   restarted_rollouts=manifest.restarted_rollouts,
                   bytes=sum(s.bytes for s in manifest.shards),
                   blob_store=blob_store_of(path, manifest))


def list_snapshots(root: Path | str,
                   progress: ProgressCallback | None = None) -> list[SnapshotInfo]:
    """Every committed snapshot below ``root`` (a folder or a bucket's URL), newest first
    (see the module docstring), each with its manifest's facts. Reads manifests only:
    ``latest_snapshot(verify=True)`` or ``verify_snapshot`` checks the shards. A local
    ``root`` that is not a folder raises ``CheckpointPathError``. ``progress`` hears of
    each manifest read ("manifests read", from 0 of all once they are found)."""
    location = parse_location(root)
    if isinstance(location, LocalLocation) and not location.path.is_dir():
        # A mistyped root must not read as "no snapshots": a restart would start over.
        raise CheckpointPathError(
            str(root), f"checkpoint root {root} is not a folder (it does not exist, or is a "
                       f"file): pass CheckpointConfig.checkpoint_root, or a folder above "
                       f"checkpoint paths")
    found: list[SnapshotInfo] = []
    paths = committed_snapshots(root)
    if progress is not None:
        progress(CatalogProgress("manifests read", 0, len(paths)))
    for done, path in enumerate(paths, 1):
        try:
            found.append(SnapshotInfo.of(path, read_manifest(path)))
        except SnapshotReadError as exc:
            found.append(SnapshotInfo(path=path, error=one_line(exc)))
        if progress is not None:
            progress(CatalogProgress("manifests read", done, len(paths), path))
    undated = [s for s in found if s.created_at is None]
    dated = [s for s in found if s.created_at is not None]
    dated.sort(key=lambda s: (s.sequence or 0, s.created_at, s.snapshot_id or ""),
               reverse=True)
    return undated + dated


@dataclass(frozen=True)
class SkippedSnapshot:
    """A snapshot newer than the one ``latest_snapshot`` chose (or of unknown age), and
    why it was passed over."""

    path: str
    reason: str


@dataclass(frozen=True)
class LatestSnapshot:
    """What ``latest_snapshot`` found: the newest snapshot that passed (None when none
    did), and every newer one it passed over, newest first."""

    root: str
    snapshot: SnapshotInfo | None
    skipped: tuple[SkippedSnapshot, ...] = ()

    @property
    def path(self) -> str | None:
        """The checkpoint path to restore from, None when no snapshot passed."""
        return None if self.snapshot is None else self.snapshot.path


def _damage(info: SnapshotInfo, verify: bool,
            progress: ProgressCallback | None) -> str | None:
    """Why a restore would refuse the snapshot ``info`` (None when it would accept it):
    its manifest does not read, or, with ``verify``, it does not verify."""
    if info.error is not None:
        return f"its manifest does not read, so its age is unknown: {info.error}"
    if verify and not (report := verify_snapshot(info.path, progress)).ok:
        return (f"it does not verify ({len(report.problems)} problem(s)): "
                f"{report.problems[0]}")
    return None


def latest_snapshot(root: Path | str, verify: bool = True, warn: bool = True,
                    progress: ProgressCallback | None = None) -> LatestSnapshot:
    """The newest committed snapshot below ``root`` that a restore would accept.

    With ``verify`` (the default), each candidate, newest first, gets every check a
    restore makes (``verify_snapshot``: every shard and blob read and hashed) until one
    passes; without it, a candidate passes when its manifest reads. Each snapshot passed
    over is in ``skipped`` with the reason, and, with ``warn``, logged as a warning: a
    damaged newest snapshot means turns since the one chosen are lost, which the caller
    should know (``nemo-ckpt ls --latest`` prints ``skipped`` itself, so once).
    ``progress`` hears of the listing's steps (``list_snapshots``), then of each
    candidate's verification (``verify_snapshot``).
    """
    skipped: list[SkippedSnapshot] = []
    chosen: SnapshotInfo | None = None
    for info in list_snapshots(root, progress):
        reason = _damage(info, verify, progress)
        if reason is None:
            chosen = info
            break
        if warn:
            log.warning("latest_snapshot under %s skipped %s: %s", root, info.path, reason)
        skipped.append(SkippedSnapshot(info.path, reason))
    return LatestSnapshot(root=str(root), snapshot=chosen, skipped=tuple(skipped))


@dataclass
class RemovalReport:
    """What ``remove_snapshot`` removed: the snapshot (its id, None when its manifest
    did not name one), the files, and the blob collection after it (None when not
    run; ``collection_skipped`` says why, when it was refused)."""

    path: str
    snapshot_id: str | None
    files: list[str] = field(default_factory=list)
    collection: CollectionReport | None = None
    collection_skipped: str | None = None


# One watch per clock for the life of the process: a claim is found abandoned only by a
# watch that has seen it before, so a watch made per call takes the claim a dead remover
# left for live at every call, and retention is refused for ever after a crash.
_WATCHES: dict[Callable[[], float], ClaimWatch] = {}
_MAX_WATCHES = 16
_WATCHES_LOCK = threading.Lock()  # the async forms run removals in worker threads


def _process_watch(clock: Callable[[], float]) -> ClaimWatch:
    with _WATCHES_LOCK:
        watch = _WATCHES.get(clock)
        if watch is None:
            if len(_WATCHES) >= _MAX_WATCHES:  # a test's fake clocks; forget the oldest
                del _WATCHES[next(iter(_WATCHES))]
            watch = _WATCHES[clock] = ClaimWatch(clock)
        return watch


def _busy(path: Path | str, operation: str, owner: str, waited: float,
          left_s: float) -> CheckpointPathBusyError:
    what = ("another removal" if operation.startswith(REMOVAL_PREFIX) else
            "a restore reading it" if operation.startswith("restore-") else
            "a snapshot writing it, or a restore reading it")
    # Claims are judged on this process's clock only: one seen for the first time is
    # live, so only watching it tells an operation that runs from one whose process died.
    wait = math.ceil(max(left_s, 0.0)) + 1
    why = (f"gave up after watching its claim for {waited:g}s; " if waited > 0 else "")
    why += (f"run it again once that has ended; if its process is gone, its claim is taken "
            f"as abandoned (and removed) once seen unchanged for {left_s:.0f}s more: pass "
            f"wait_s={wait} (nemo-ckpt rm --wait {wait}) to watch it that long, or call "
            f"again from this process after that")
    return CheckpointPathBusyError(
        f"cannot remove the snapshot at {path}: {operation} of {owner} is in progress "
        f"there ({what}); nothing was removed; {why}")


def _claim_alone(path: Path | str, operation: str, owner: str, watch: ClaimWatch,
                 clock: Callable[[], float], sleep: Callable[[float], None],
                 wait_s: float) -> None:
    """Claim the snapshot's folder for the removal, as the only operation there.

    Two writers can each read no claim and then both write theirs; so after writing,
    the removal reads the claims again and backs off if another appeared (the snapshot
    that wrote it goes on, and the removal is refused). A claim ``watch`` has seen
    unchanged for its ttl is abandoned: it is removed, so that it holds up no later
    removal or snapshot there (a fresh process's watch would take it for live again)."""
    folder = environment_folder(path)
    give_up = clock() + wait_s
    while True:
        others = [c for c in read_claims(folder) if c.operation != operation]
        left = watch.observe(folder.describe(), others)
        live = [c for c in others if left[c.operation] > 0]
        drop_abandoned(folder, [c for c in others if left[c.operation] <= 0])
        if not live:
            try:
                try:
                    claim_path(folder, operation, owner, watch, _REMOVAL_TTL_S)
                except CheckpointPathBusyError:  # claimed since our read: retried below
                    pass
                after = [c for c in read_claims(folder) if c.operation != operation]
                live = [c for c in after if c.operation not in {o.operation for o in others}]
                if not live and any(c.operation == operation for c in read_claims(folder)):
                    return
            except BaseException:
                # Giving up: a claim of ours may be there, and would refuse this path's
                # snapshots until seen abandoned.
                with contextlib.suppress(OSError, NemoCkptError):
                    release_claim(folder, operation)
                raise
            release_claim(folder, operation)
        if clock() >= give_up or not live:
            who = live[0] if live else None
            # One that appeared after our read is new to the watch: its whole ttl is left.
            left_s = (left.get(who.operation, STALE_FACTOR * who.ttl_s) if who
                      else STALE_FACTOR * _REMOVAL_TTL_S)
            raise _busy(path, who.operation if who else "another removal",
                        who.owner if who else "another process", wait_s, left_s)
        sleep(min(_WAIT_POLL_S, max(0.0, give_up - clock())))


def claim_for_removal(path: Path | str,
                      clock: Callable[[], float] = time.monotonic) -> Callable[[], None]:
    """Claim the checkpoint path ``path``'s folder for a removal, as the only operation
    there (of what is left of a snapshot that never committed, say); returns the call
    that releases the claim. ``CheckpointPathBusyError`` at once while another
    operation's claim there is live: one this process's watch on ``clock`` has not yet
    seen unchanged for its ttl (a snapshot still writing, whoever runs it); a claim seen
    abandoned is dropped."""
    token = uuid.uuid4().hex[:12]
    operation, owner = f"{REMOVAL_PREFIX}{token}", f"nemo-ckpt-remover-{token}"
    _claim_alone(path, operation, owner, _process_watch(clock), clock, time.sleep, 0.0)
    return functools.partial(release_claim, environment_folder(path), operation)


def _remove_manifest(folder: Folder) -> None:
    """Remove the manifest; an error after the removal landed (the manifest is gone) is
    no error here: the rest of the removal goes on."""
    try:
        folder.remove([MANIFEST_NAME])
    except (NemoCkptError, OSError):
        if MANIFEST_NAME in folder.names():
            raise


def _remove_if_empty(folder: Folder) -> None:
    """Remove the environment folder the removal emptied, or RL, removing its own half
    of the checkpoint path, finds a folder it did not make and cannot remove. Only an
    empty one: another operation's claim or files keep it, and RL's files beside it are
    never touched. A bucket has no folders: a prefix ends with its last object."""
    if isinstance(folder, LocalFolder):
        # A snapshot that prepared this folder a moment ago makes it again for its claim
        # (``LocalFolder.write_bytes``).
        with contextlib.suppress(OSError):
            folder.path.rmdir()


def remove_snapshot(path: Path | str, root: Path | str | None = None, collect: bool = True,
                    wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep,
                    snapshot_id: str | None = None) -> RemovalReport:
    """Remove the committed snapshot at checkpoint path ``path`` (its environment half),
    then, with ``collect``, the blobs no other committed snapshot references.

    Refused with ``CheckpointPathBusyError`` while a snapshot or restore holds the
    folder: a claim seen for the first time is taken as live, so ``wait_s`` watches the
    claims (on ``clock``) for up to that long, enough to see one whose job died as
    abandoned. Claims are watched for the life of the process (one watch per ``clock``):
    a later call takes a claim seen unchanged for its ttl since as abandoned too, and
    removes it. ``SnapshotNotFoundError`` when there is no snapshot at ``path``. A
    damaged snapshot is removed too: nothing of it is read but the names of its files;
    so are the shards a snapshot left without a manifest (interrupted), and those of a
    removal cut short (an I/O error raised: the manifest went first, so nothing is left
    that passes for a committed snapshot; run it again).
    The blob store is the one the manifest names, else ``root``'s; a collection refused
    (a snapshot holds the store) leaves the blobs to the next commit or ``nemo-ckpt gc``,
    and says so in ``collection_skipped``.

    With ``snapshot_id``, only that snapshot is removed: if another one committed at
    ``path`` since the caller looked (a job writing into the same path again), the
    removal is refused with ``CheckpointPathBusyError`` and nothing is removed."""
    folder = environment_folder(path)
    names = folder.names()
    # Shards without a manifest: a snapshot interrupted, or a removal cut short.
    if MANIFEST_NAME not in names and not any(n.startswith(SHARD_PREFIX) for n in names):
        raise SnapshotNotFoundError(folder.describe(), "Nothing was removed.")
    try:
        store = blob_store_of(path, read_manifest(path))
    except SnapshotReadError:
        store = None  # a damaged manifest names no store we can trust
    collect_root = (parent_location(store, 1) if store is not None
                    else None if root is None else str(root))
    token = uuid.uuid4().hex[:12]
    operation, owner = f"{REMOVAL_PREFIX}{token}", f"nemo-ckpt-remover-{token}"
    _claim_alone(path, operation, owner, _process_watch(clock), clock, sleep, wait_s)
    try:
        report = RemovalReport(path=str(path), snapshot_id=manifest_snapshot_id(folder))
        if snapshot_id is not None and report.snapshot_id != snapshot_id:
            # Read under the claim: no snapshot commits here until it is released.
            raise CheckpointPathBusyError(
                f"cannot remove {snapshot_id} at {path}: the snapshot there is now "
                f"{report.snapshot_id or 'none'} (committed since it was listed); nothing "
                f"was removed. List the snapshots again before removing")
        # The manifest first: from here on nothing takes this for a committed snapshot.
        if MANIFEST_NAME in names:
            _remove_manifest(folder)
            report.files.append(MANIFEST_NAME)
        report.files += remove_unreferenced_files(folder)
    finally:
        release_claim(folder, operation)
    _remove_if_empty(folder)
    log.info("removed snapshot %s at %s (%d files)", report.snapshot_id, path,
             len(report.files))
    if collect and collect_root is not None:
        try:
            report.collection = collect_blobs(collect_root, wait_s=wait_s, clock=clock,
                                              watch=_process_watch(clock),
                                              sleep=sleep)
        except (NemoCkptError, OSError) as exc:
            report.collection_skipped = (f"{one_line(exc)}; the next commit under "
                                         f"{collect_root} collects them, or run nemo-ckpt "
                                         f"gc {collect_root}")
    return report


@dataclass
class RetentionReport:
    """What ``keep_last`` kept and removed, what it could not remove (by path, why), and
    the collection of the blob store after (None when no removed snapshot had one).

    ``damaged``: the kept snapshots that did not count towards ``n`` (a restore would
    refuse them), by path, with why; they are kept for a person to look at.
    ``dry_run``: nothing was removed; ``would_remove`` lists what would have been."""

    kept: list[SnapshotInfo] = field(default_factory=list)
    removed: list[RemovalReport] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    collection: CollectionReport | None = None
    collection_skipped: str | None = None
    damaged: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False
    would_remove: list[SnapshotInfo] = field(default_factory=list)


def keep_last(root: Path | str, n: int, verify: bool = False, wait_s: float = 0.0,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep,
              progress: ProgressCallback | None = None,
              dry_run: bool = False) -> RetentionReport:
    """Keep the ``n`` newest committed snapshots below ``root`` and remove the older ones
    (``remove_snapshot``), then collect the blob store once.

    What counts towards ``n`` is a snapshot a restore would accept: one whose manifest
    reads, and with ``verify`` one that verifies. A snapshot is removed only once ``n``
    newer ones count, so damage never makes the retention remove the last good ones
    (a damaged snapshot among the newest is kept, for the user to look at, and named in
    ``damaged`` with why). A removal refused (a snapshot or restore holds it) is
    reported in ``refused``; the others go on. With ``dry_run``, nothing is removed
    nor collected: ``would_remove`` lists what would be.

    ``progress`` hears of the listing's steps (``list_snapshots``), each kept
    snapshot's verification with ``verify``, and each snapshot kept or removed
    ("snapshots kept or removed"), in the calling thread; an exception it raises stops
    the retention between two snapshots and propagates."""
    if n < 1:
        raise ValueError(f"keep_last needs n >= 1 (got {n}): it never removes every snapshot")
    report = RetentionReport(dry_run=dry_run)
    good = 0  # newer snapshots a restore would accept
    stores: set[str] = set()  # the blob stores of the snapshots removed
    found = list_snapshots(root, progress)
    step = "snapshots kept or removed"
    if progress is not None:
        progress(CatalogProgress(step, 0, len(found)))
    for done, info in enumerate(found, 1):
        if good < n:
            report.kept.append(info)
            damage = _damage(info, verify, progress)
            if damage is None:
                good += 1
            else:
                report.damaged[info.path] = damage
        elif dry_run:
            report.would_remove.append(info)
        else:
            try:
                report.removed.append(remove_snapshot(
                    info.path, collect=False, wait_s=wait_s, clock=clock, sleep=sleep,
                    snapshot_id=info.snapshot_id))
            except (NemoCkptError, OSError) as exc:
                report.refused[info.path] = one_line(exc)
            else:
                if info.blob_store is not None:
                    stores.add(info.blob_store)
        if progress is not None:
            progress(CatalogProgress(step, done, len(found), info.path))
    for store in sorted(stores):  # one under the root, unless snapshots name others
        where = parent_location(store, 1)
        try:
            report.collection = collect_blobs(where, wait_s=wait_s, clock=clock, sleep=sleep,
                                              watch=_process_watch(clock))
        except (NemoCkptError, OSError) as exc:
            report.collection_skipped = (f"{one_line(exc)}; the next commit under {where} "
                                         f"collects them, or run nemo-ckpt gc {where}")
    return report

