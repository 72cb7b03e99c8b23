"""The checkpoint coordinator: one named actor that fans every phase out to the holders.

It reaches the holders only through its ``Transport`` (``nemo_ckpt.transport``), so
the same code runs as a Ray actor (``actors.ray_transport``) and in the simulation.

Each snapshot or restore is one ``_Operation`` record: its kind, path, the holders (and
their handles) it involves, its lease, its captures, its outcome. The record is closed
in one place (``_close``), with one outcome kept in a bounded history, so a late or
repeated call is answered with that outcome or refused; an operation whose driver
stopped renewing is reaped when its lease lapses. A failure that several holders
report carries each holder's error (``nemo_ckpt.errors.aggregate``).

The call order of a snapshot (driven by ``RayEnvironmentCheckpoint.snapshot``):

    1) (driver) renew(id)                   every renewal period, from the start to the
                                            end, whatever phase is running
    2) (driver) begin_snapshot(id, path)    claim the path; every holder pauses and
                                            captures (one call each)
    3) (driver) start_writes(id)            at the yield: every holder starts writing;
                                            the manifest's rollouts are encoded meanwhile
    4) (driver) commit_snapshot(id, path, metrics, restarted)
                                            holders released (gates open) at once; every
                                            shard durable, manifest.json written last (the
                                            commit point), the snapshot ended on every
                                            holder, the files it replaced removed
    or abort(id, path) instead of 3-4, on any failure or cancellation; it answers
    with the operation's outcome, which is "committed" if the commit won.

and of a restore (driven by ``RayEnvironmentCheckpoint.restored``):

    1) (driver) renew(id)                   as above
    2) (driver) prepare_restore(id, path)   read the manifest; place every instance;
                                            holders read and verify their shards; what
                                            they read is checked against the manifest
    3) (driver) commit_restore(id)          every holder makes its sessions live
    or abort(id) instead of 3, or after a 3 that failed on some holder: the holders
    that went live drop the restored sessions again (all or nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

from nemo_ckpt.blobs import BLOB_DIR, BlobStore
from nemo_ckpt.checkpoint_folder import environment_folder, folder_at
from nemo_ckpt.claims import ClaimWatch
from nemo_ckpt.cleanup import remove_snapshot_files, remove_unreferenced_files
from nemo_ckpt.collection import (
    CollectionReport,
    RefsCache,
    collect_quietly,
    committed_snapshots,
)
from nemo_ckpt.config import (
    ADOPTED_FIELDS,
    DRIVER_FIELDS,
    CheckpointConfig,
    config_differences,
)
from nemo_ckpt.errors import (
    BackendUnavailableError,
    ConfigMismatchError,
    LeaseExpiredError,
    NemoCkptError,
    OperationAbortedError,
    RestoreConflictError,
    ShardCorruptedError,
    StaleSnapshotError,
    aggregate,
)
from nemo_ckpt.folder import Folder
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.location import join_location
from nemo_ckpt.manifest import (
    ShardEntry,
    encode_manifest,
    rollouts_by_shard,
    shard_problems,
)
from nemo_ckpt.operations import HISTORY_SIZE, OperationHistory, Outcome
from nemo_ckpt.path_claims import claim_path, live_claims, read_claims, release_claim
from nemo_ckpt.phases import (
    CaptureReport,
    HolderInfo,
    PauseReport,
    RestorePrepared,
    instance_sort_key,
)
from nemo_ckpt.sandbox_storage import blob_store_of, blob_store_ref
from nemo_ckpt.snapshot_files import read_manifest, write_manifest
from nemo_ckpt.transport import Actor, Transport

__all__ = ["CheckpointCoordinator", "SnapshotBegun", "SnapshotCommitted", "RestoreBegun"]

log = logging.getLogger("nemo_ckpt.coordinator")
T = TypeVar("T")
# Of a claim's ttl, how much may pass since it was last written before the commit
# writes it again: readers' clocks may run up to 10% faster than ours.
_CLAIM_SAFE = 0.8


@dataclass(frozen=True)
class SnapshotBegun:
    """The aggregate capture of every holder, handed to the driver at the yield."""

    snapshot_id: str
    instances: tuple[str, ...]
    pauses: tuple[PauseReport, ...]
    captures: tuple[CaptureReport, ...]
    entry_seconds: float


@dataclass(frozen=True)
class SnapshotCommitted:
    """What the commit wrote, in brief: the driver needs no per-session data back."""

    metrics: dict[str, float]
    rollouts: int
    shards: int
    removed_files: tuple[str, ...]


@dataclass(frozen=True)
class RestoreBegun:
    """What a prepared restore will continue, and where each instance landed."""

    restore_id: str
    continued_attempts: frozenset[tuple[str, str, int]]
    staging_keys: frozenset[str]
    placement: dict[str, str]  # instance id -> node id
    bytes_read: int
    read_seconds: float  # the slowest holder's shard reads (``RestorePrepared``)


@dataclass(eq=False)
class _Operation:
    """One snapshot or restore, from its first call to its outcome."""

    id: str
    kind: str  # "snapshot" or "restore"
    path: str
    started: float
    lease_deadline: float
    holders: dict[str, Actor] = field(default_factory=dict)  # instance -> handle
    captures: tuple[CaptureReport, ...] | None = None
    # The check that no rollout was captured by two instances, run while the shards are
    # written (the count of captured sessions when it passes).
    encoding: asyncio.Future[int] | None = None
    writes_started: bool = False
    # This coordinator's count of captures when this one completed: a holder pauses for
    # a snapshot only once the one before released it, so the order of captures.
    capture_order: int = 0
    committing: bool = False
    read_seconds: float = 0.0  # a restore's slowest holder reading its shards
    released: float | None = None  # when the holders were told to reopen their gates
    outcome: Outcome | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    # The manifest's blob_store ("../blobs") when sessions may own sandboxes, and the
    # snapshot's hold on that store (``nemo_ckpt.blobs``), taken beside the pause.
    blob_ref: str | None = None
    blob_hold: asyncio.Future[None] | None = None
    # When (this process's monotonic clock) the path's claim and the store's hold were
    # last written: a renewal that failed leaves them standing for their ttl only.
    claimed_at: float | None = None
    held_at: float | None = None
    # Every beat this incarnation wrote (or tried to write) the path's claim with: a claim
    # with another beat, or none, means another incarnation aborted the operation.
    claim_beats: set[str] = field(default_factory=set)


class CheckpointCoordinator:
    """Fans pause, snapshot and restore out to the session holders."""

    def __init__(self, config: CheckpointConfig, transport: Transport) -> None:
        self._config = config
        self._transport = transport
        self._runtime = transport.runtime
        self._clock = transport.runtime.clock
        self._metrics = transport.runtime.metrics
        self._owner = f"{config.namespace}@{transport.cluster_id}"
        # This incarnation: Ray may declare a coordinator dead that runs again later (a
        # stalled node), beside its successor of the same owner; their claims differ.
        self._incarnation = self._runtime.token()[:16]
        self._collector = f"{self._owner}#{self._incarnation}"
        # Other writers' claims (paths, the blob store), judged on this process's clock:
        # kept for the coordinator's life, as only a claim seen before can be found
        # abandoned (nemo_ckpt.claims).
        self._claim_watch = ClaimWatch(self._clock.monotonic)
        self._holders: dict[str, Actor] = {}  # instance id -> actor handle
        self._holder_nodes: dict[str, str] = {}  # instance id -> node id
        self._registered: dict[str, Actor] = {}  # every holder the last discovery listed
        self._ops: dict[str, _Operation] = {}  # open operations
        self._history = OperationHistory()
        self._committed: OrderedDict[str, SnapshotCommitted] = OrderedDict()
        self._background: set[asyncio.Future[Any]] = set()  # kept so they are not collected
        self._reaper: asyncio.Task[None] | None = None
        self._placement_lock = asyncio.Lock()
        self._path_locks: dict[str, tuple[asyncio.Lock, int]] = {}  # path -> lock, users
        self._injected_delays: dict[str, float] = {}
        self._captures_done = 0
        # The blob store's collection after commits: one at a time, and one more when a
        # commit lands while it runs; committed snapshots' references, cached by id.
        self._collection: asyncio.Future[Any] | None = None
        self._collect_again = False
        self._refs_cache: RefsCache = {}
        self.last_collection: CollectionReport | None = None
        # Whether blobs may have become garbage since the last collection: a commit
        # replaced an older snapshot, one aborted after writing, or snapshots went
        # (their paths, as that collection found them, tell).
        self._garbage_possible = True
        self._snapshots_seen: frozenset[str] = frozenset()

    # --- the job's config ------------------------------------------------------------

    async def attach(self, config: CheckpointConfig) -> None:
        """A driver's first call: its ``config`` against the one this coordinator and the
        holders it finds were made with (a restarted driver finds them alive, made by
        whoever created them). Deadlines are adopted from the newest driver; any other
        difference is refused with ``ConfigMismatchError`` naming each field
        (``nemo_ckpt.config.ADOPTED_FIELDS`` says which are which)."""
        fixed = config_differences(
            self._config, config,
            frozenset(CheckpointConfig.model_fields) - DRIVER_FIELDS - ADOPTED_FIELDS)
        problems = [f"{name} is {theirs!r} there, {ours!r} in yours"
                    for name, (theirs, ours) in fixed.items()]
        if not problems:
            wanted = self._holder_options()
            async with self._placement_lock:
                infos = await self._discover()
            for info in sorted(infos, key=_instance_order):
                differ = sorted(k for k, v in info.options.items()
                                if k in wanted and wanted[k] != v)
                problems += [f"{info.instance_id} was made with {k}={info.options[k]!r}, "
                             f"yours gives {wanted[k]!r}" for k in differ]
        if problems:
            raise ConfigMismatchError(
                f"namespace {self._config.namespace!r} already runs nemo-ckpt actors made "
                f"with another CheckpointConfig: {'; '.join(problems)}. Use the job's "
                f"values, end the old job's actors first "
                f"(RayEnvironmentCheckpoint(old_config).shutdown()), or give this job a "
                f"namespace of its own")
        adopted = config_differences(self._config, config, ADOPTED_FIELDS)
        if adopted:
            log.warning("a driver attached with other deadlines; adopting them: %s",
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in adopted.items()))
            self._config = CheckpointConfig.model_validate({
                **self._config.model_dump(),
                **{k: getattr(config, k) for k in ADOPTED_FIELDS | DRIVER_FIELDS}})

    # --- holders ---------------------------------------------------------------------

    async def ensure_holders(self) -> list[HolderInfo]:
        """Find every live holder, and create one on each alive node that has none."""
        async with self._placement_lock:
            infos = await self._discover()
            hosted = {i.node_id for i in infos}
            for node_id in self._transport.alive_nodes():
                if node_id not in hosted:
                    try:
                        infos.append(await self._create_holder(self._free_instance_id(),
                                                               node_id))
                    except BackendUnavailableError as exc:
                        # Typically a node that died but is not yet declared dead. A
                        # node that stays without a holder fails check_startup.
                        log.warning("no holder could start on node %s: %s", node_id, exc)
            return sorted(infos, key=_instance_order)

    async def _known_holders(self) -> dict[str, Actor]:
        """The holders to fan out to, re-discovered (and created on new nodes) only when
        none are known or the alive nodes changed: discovery costs a GCS round trip per
        holder, which the pause must not pay every time."""
        alive = set(self._transport.alive_nodes())
        if not self._holders or alive != set(self._holder_nodes.values()):
            await self.ensure_holders()
        return {i: self._holders[i] for i in sorted(self._holders, key=instance_sort_key)}

    async def holder_infos(self) -> list[HolderInfo]:
        """Every live holder's info, without creating any."""
        return sorted(await self._discover(), key=_instance_order)

    async def probe_storage(self, root: str) -> dict[str, str]:
        """Have every holder write a probe file under ``root``; returns instance -> path
        or ``error: ...``."""
        await self.ensure_holders()
        results = await asyncio.gather(
            *(self._transport.call(h, "probe_storage", root,
                                   timeout=self._config.phase_timeout_s)
              for h in self._holders.values()),
            return_exceptions=True)
        return {inst: (r if isinstance(r, str) else f"error: {r}")
                for inst, r in zip(self._holders, results, strict=True)}

    async def probe_sandboxes(self) -> dict[str, str]:
        """Have every holder check its sandbox cache; instance -> "" or ``error: ...``."""
        await self.ensure_holders()
        results = await asyncio.gather(
            *(self._transport.call(h, "probe_sandbox", timeout=self._config.phase_timeout_s)
              for h in self._holders.values()),
            return_exceptions=True)
        return {inst: ("" if not isinstance(r, BaseException) else f"error: {r}")
                for inst, r in zip(self._holders, results, strict=True)}

    async def inject_delay(self, phase: str, seconds: float) -> None:
        """Fault-injection seam for tests and drills: make ``phase`` take ``seconds``
        longer, so a fault (a kill, a cancellation) can be aimed at it. Phases:
        begin_snapshot (before the holders are asked), commit_snapshot (before the
        shards are awaited), before_manifest (every shard durable, the manifest not yet
        written), after_manifest (the manifest renamed, holders not yet resumed),
        commit_restore (before the holders are asked). 0 removes it."""
        known = {"begin_snapshot", "commit_snapshot", "before_manifest", "after_manifest",
                 "commit_restore"}
        if phase not in known:
            raise ValueError(f"unknown phase {phase!r}; one of {sorted(known)}")
        self._injected_delays[phase] = seconds

    async def _injected_delay(self, phase: str) -> None:
        seconds = self._injected_delays.get(phase, 0.0)
        if seconds > 0:
            await asyncio.sleep(seconds)

    # --- operations: open, close, refuse -----------------------------------------------

    def _open(self, op_id: str, kind: str, path: str) -> _Operation:
        """Record a new operation, or refuse an id that ended, is late, or is open."""
        if op_id in self._ops:
            raise StaleSnapshotError(f"{op_id} is already in progress; a repeated first "
                                     f"call is refused")
        if self._history.outcome(op_id) is not None or self._history.is_late(op_id):
            raise self._refusal(op_id)
        self._history.note(op_id)
        now = self._clock.monotonic()
        op = _Operation(op_id, kind, path, started=now,
                        lease_deadline=now + self._config.lease_s)
        self._ops[op_id] = op
        self._ensure_reaper()
        return op

    def _close(self, op: _Operation, outcome: Outcome) -> None:
        """End ``op`` with ``outcome``: the one place an operation closes."""
        if op.outcome is not None:
            return
        op.outcome = self._history.record(op.id, outcome)
        self._ops.pop(op.id, None)
        op.captures = None  # every holder's capture bytes: freed now
        if op.encoding is not None and not op.encoding.done():
            op.encoding.cancel()
        op.encoding = None
        op.closed.set()

    def _refusal(self, op_id: str) -> Exception:
        """Why a call for ``op_id``, which is not open here, is refused."""
        outcome = self._history.outcome(op_id)
        if outcome is Outcome.LAPSED:
            return LeaseExpiredError(
                f"the lease of {op_id} lapsed (no renewal for {self._config.lease_s:g}s: the "
                f"driver stalled or could not reach the coordinator), so it was aborted and "
                f"the holders resumed; retry")
        if outcome is Outcome.ABORTED:
            return OperationAbortedError(f"{op_id} was aborted; retry the operation")
        if outcome is Outcome.COMMITTED:
            return StaleSnapshotError(f"{op_id} already committed")
        if self._history.is_late(op_id):
            return StaleSnapshotError(
                f"{op_id} is late: its driver has started a newer operation since")
        return BackendUnavailableError(
            f"coordinator knows no operation {op_id}: it restarted since the operation "
            f"began, and the holders resume by their lease; retry the operation")

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """Abort every operation whose lease lapsed: its driver stopped renewing."""
        period = min(self._config.lease_s / 4, 1.0)
        while self._ops:
            await asyncio.sleep(period)
            now = self._clock.monotonic()
            for op in list(self._ops.values()):
                if not op.committing and now > op.lease_deadline:
                    log.warning("operation %s: no renewal for %.1fs; aborting it", op.id,
                                self._config.lease_s)
                    await self._abort(op, Outcome.LAPSED)

    async def renew(self, operation_id: str) -> None:
        """Renew the lease of the operation and of every holder taking part in it."""
        op = self._ops.get(operation_id)
        if op is None:
            raise self._refusal(operation_id)
        op.lease_deadline = self._clock.monotonic() + self._config.lease_s
        # The holders first, and whatever the claims' writes do: a disk full for a few
        # seconds must not lapse the holders' leases (the commit checks the claims).
        await self._fan(op.holders, "renew_lease",
                        lambda inst, h: self._transport.call(
                            h, "renew_lease", operation_id, self._config.lease_s,
                            timeout=self._config.phase_timeout_s),
                        tolerate_failures=True)
        if op.kind == "snapshot" and op.captures is not None:
            try:
                await self._claim(op)
                if op.blob_hold is not None and op.blob_hold.done():
                    await self._hold_blobs(op)
            except (OSError, NemoCkptError) as exc:
                log.warning("%s: could not renew its claims (%s); they stand until their "
                            "ttl, and the commit writes them again first", op.id, exc)

    async def abort(self, operation_id: str, checkpoint_path: str | None = None,
                    caller_error: str | None = None) -> str:
        """End the operation without a trace and return its outcome.

        The outcome is "committed" when its commit won (committed is final: nothing is
        removed then), else "aborted" or "lapsed". Every holder it involved drops it,
        and its files go. An operation this coordinator never saw (its predecessor
        died, or this abort overtook the first call) is aborted on every holder and
        remembered, so that its late first call is refused. ``caller_error`` names the
        exception that ended the caller's block, for the failure metric.
        """
        kind = "restore" if operation_id.startswith("restore") else "snapshot"
        if caller_error is not None:
            self._count_failure(kind, caller_error)
        op = self._ops.get(operation_id)
        if op is not None:
            if op.committing:  # commit and abort exclude each other: the commit decides
                await op.closed.wait()
            else:
                await self._abort(op, Outcome.ABORTED)
            assert op.outcome is not None
            return op.outcome.value
        known = self._history.outcome(operation_id)
        if known is not None:
            return known.value
        self._history.record(operation_id, Outcome.ABORTED)
        await self._discover()
        # Every registered holder, answering or not: one slow to answer its info (a
        # stalled link) may still be paused for this operation.
        await self._fan(self._registered, "abort",
                        lambda inst, h: self._transport.call(
                            h, "abort", operation_id, timeout=self._config.phase_timeout_s),
                        tolerate_failures=True)
        if checkpoint_path is not None and kind == "snapshot":
            committed = await self._runtime.run_blocking(
                remove_snapshot_files, environment_folder(checkpoint_path), operation_id)
            if committed:  # its coordinator died after the manifest's rename
                self._history.record(operation_id, Outcome.COMMITTED, replace=True)
                return Outcome.COMMITTED.value
        return Outcome.ABORTED.value

    async def _abort(self, op: _Operation, outcome: Outcome) -> None:
        """Close ``op`` and undo it everywhere: every holder it involved, its files."""
        if op.outcome is not None:
            await op.closed.wait()
            return
        self._close(op, outcome)
        # Every holder it involved, and every holder registered now: a holder made since
        # (its predecessor died) may have been paused by a late call of this operation
        # (a coordinator taken for dead that runs again); the abort it records refuses
        # any later one.
        targets = dict(op.holders)
        for inst, handle in self._transport.holders().items():
            if inst not in targets:
                targets[inst] = handle
            elif targets[inst].ref != handle.ref:  # another incarnation of it now
                targets[f"{inst} (now)"] = handle
        await self._fan(targets, "abort",
                        lambda inst, h: self._transport.call(
                            h, "abort", op.id, timeout=self._config.phase_timeout_s),
                        tolerate_failures=True)
        if op.kind == "snapshot":
            if op.blob_hold is not None and not op.blob_hold.done():
                await asyncio.wait([op.blob_hold])  # its put must not land after the release
            if op.blob_hold is not None:
                self._garbage_possible = True  # its holders may have written blobs
            await self._release_blobs(op)
            try:
                committed = await self._runtime.run_blocking(
                    remove_snapshot_files, environment_folder(op.path), op.id)
            except (OSError, NemoCkptError) as exc:
                log.warning("could not remove the files of %s: %s", op.id, exc)
                return
            if committed:  # the manifest's rename happened before a later step failed
                op.outcome = self._history.record(op.id, Outcome.COMMITTED, replace=True)

    # --- snapshot ---------------------------------------------------------------------

    async def begin_snapshot(self, snapshot_id: str, checkpoint_path: str) -> SnapshotBegun:
        """Claim the path, pause every holder and capture.

        This is the pause's hot path: the holder set is the one known since the last
        discovery, re-discovered only when the alive nodes changed, and each holder
        pauses and captures in one call (``SessionHolder.begin``). The writes start at
        ``start_writes``, which the driver sends once it has this answer: started
        earlier, four writers on a shared machine slowed the answer by ~5 ms.
        ``finish_persist`` starts any write whose start message has not arrived.
        """
        op = self._open(snapshot_id, "snapshot", checkpoint_path)
        cfg = self._config
        claimed: asyncio.Future[None] | None = None
        try:
            op.holders = await self._known_holders()
            directory = environment_folder(checkpoint_path)
            if self._config.sandbox_root is not None:
                assert self._config.checkpoint_root is not None  # the config requires it
                op.blob_ref = blob_store_ref(self._config.checkpoint_root, checkpoint_path)
            await self._injected_delay("begin_snapshot")
            if op.outcome is not None:  # aborted before any holder was asked: ask none
                raise self._refusal(snapshot_id)
            # The claim runs beside the pause, not before it: no shard is written before
            # the claim holds (writes start after this returns), and on a bucket its
            # list, reads and put would otherwise add round trips to every pause. A
            # refused claim aborts the snapshot like any failure here: holders resume.
            claimed = asyncio.ensure_future(self._prepare_and_claim(op, directory))
            if self._blob_store() is not None:
                # Not awaited here: no holder relies on the store before it holds (the
                # writes start after it, and the commit awaits it), and its file work
                # would otherwise lengthen every pause.
                op.blob_hold = asyncio.ensure_future(self._hold_blobs(op, first=True))
                op.blob_hold.add_done_callback(lambda f: f.cancelled() or f.exception())
            begun = await self._fan(
                op.holders, "pause_capture",
                lambda inst, h: self._transport.call(
                    h, "begin", snapshot_id, cfg.drain_timeout_s, cfg.lease_s,
                    str(directory), timeout=cfg.drain_timeout_s + cfg.phase_timeout_s),
                op_id=snapshot_id)
            # Shielded: a cancelled begin must not cancel the claim under its thread,
            # whose put would then land after the abort's clean-up.
            await asyncio.shield(claimed)
            if op.outcome is not None:  # aborted meanwhile: its abort reached every holder
                raise self._refusal(snapshot_id)
        except BaseException as exc:
            if claimed is not None and not claimed.done():
                # Its thread runs on; the abort's clean-up must not race its put.
                await asyncio.wait([claimed])
            if claimed is not None and claimed.done() and not claimed.cancelled():
                claimed.exception()  # retrieved: the first error is the one raised
            self._count_failure("snapshot", exc)
            await self._abort(op, Outcome.ABORTED)
            raise
        op.captures = tuple(c for _, c in begun.values())
        self._captures_done += 1
        op.capture_order = self._captures_done
        return SnapshotBegun(
            snapshot_id=snapshot_id, instances=tuple(op.holders),
            pauses=tuple(p for p, _ in begun.values()), captures=op.captures,
            entry_seconds=self._clock.monotonic() - op.started)

    async def _prepare_and_claim(self, op: _Operation, directory: Folder) -> None:
        await self._runtime.run_blocking(directory.prepare)
        await self._claim(op)

    async def _claim(self, op: _Operation) -> None:
        """Claim (or renew the claim on) the operation's folder: refused while another
        job's snapshot is in progress there."""
        start = self._clock.monotonic()
        beat = self._runtime.token()
        # A renewal only renews: a claim this incarnation no longer has was removed by
        # a successor's abort (fenced), and must not come back.
        renewing = frozenset(op.claim_beats) if op.claim_beats else None
        op.claim_beats.add(beat)  # before the write: it may land and still raise
        await self._runtime.run_blocking(
            claim_path, environment_folder(op.path), op.id, self._owner, self._claim_watch,
            self._claim_ttl, self._incarnation, beat, renewing)
        op.claimed_at = start

    @property
    def _claim_ttl(self) -> float:
        """How long a claim or a hold stands without a renewal."""
        return self._config.lease_s * 2

    async def _claims_hold(self, op: _Operation) -> None:
        """Before the manifest: the path's claim and the store's hold must not have
        lapsed since they were last written (their renewals may have failed). A claim
        near its end is written again (refused if another job took the path meanwhile);
        a hold that may have lapsed refuses the commit, since a collection may have
        removed blobs the snapshot found present."""
        safe = self._claim_ttl * _CLAIM_SAFE
        if op.claimed_at is None or self._clock.monotonic() - op.claimed_at > safe:
            await self._claim(op)
        if op.blob_hold is not None and (
                op.held_at is None or self._clock.monotonic() - op.held_at > safe):
            raise LeaseExpiredError(
                f"{op.id}: its hold on the blob store could not be renewed for more than "
                f"{safe:g}s (a full or failing disk?), so a collection may have removed "
                f"blobs it relies on; it was not committed: retry the snapshot")

    async def _hold_blobs(self, op: _Operation, first: bool = False) -> None:
        """Hold the blob store for the snapshot (or renew the hold): it relies on the
        blobs there until it commits, so no collection may run meanwhile."""
        store = self._blob_store()
        if store is not None:
            start = self._clock.monotonic()
            await self._runtime.run_blocking(store.hold, op.id, self._owner,
                                             self._claim_ttl)
            op.held_at = start
            if first and (self._collection is None or self._collection.done()):
                # A collection of this job that this coordinator is not running was left
                # by a predecessor that died in it: the holders need not wait it out.
                if await self._runtime.run_blocking(store.clear_dead_collection,
                                                    self._collector):
                    log.warning("dropped the blob store's collection claim that a previous "
                                "coordinator of this job left when it died")

    def _blob_store(self) -> BlobStore | None:
        """The root's store of sandbox files, when sessions may own sandboxes."""
        root = self._config.checkpoint_root
        if self._config.sandbox_root is None or root is None:
            return None
        return BlobStore(join_location(root, BLOB_DIR), folder_at)

    def _start_collection(self) -> None:
        """Collect the blob store in the background (``nemo_ckpt.collection``)."""
        root = self._config.checkpoint_root
        if self._blob_store() is None or root is None:
            return
        if self._collection is not None and not self._collection.done():
            self._collect_again = True
            return

        async def run() -> None:
            while True:
                self._collect_again = False
                snapshots = frozenset(await self._runtime.run_blocking(
                    committed_snapshots, str(root)))
                if not self._garbage_possible and snapshots >= self._snapshots_seen:
                    # Nothing replaced, aborted or removed since the last collection: no
                    # blob can have lost its last reference. (Collecting anyway costs a
                    # listing of the store and every new snapshot's trees, in this
                    # process, beside the next pause.)
                    self._snapshots_seen = snapshots
                    return
                self._garbage_possible = False
                report = await self._runtime.run_blocking(
                    collect_quietly, str(root), self._collector, self._refs_cache,
                    self._clock.monotonic, lambda: bool(self._ops), self._claim_watch)
                if report is None or report.interrupted:
                    self._garbage_possible = True  # the next commit tries again
                else:
                    self.last_collection = report
                    self._snapshots_seen = frozenset(report.snapshots)
                    if report.removed:
                        log.info("collected %d blobs (%d bytes) from %s", report.removed,
                                 report.removed_bytes, report.store)
                if not self._collect_again:
                    return

        self._collection = asyncio.ensure_future(run())
        self._collection.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def collection_done(self) -> CollectionReport | None:
        """Wait for the collection in progress, if any; the last one's report."""
        while self._collection is not None and not self._collection.done():
            await asyncio.wait([self._collection])
        return self.last_collection

    async def _release_blobs(self, op: _Operation) -> None:
        store = self._blob_store()
        if store is not None and op.kind == "snapshot":
            try:
                await self._runtime.run_blocking(store.release, op.id)
            except (OSError, NemoCkptError) as exc:  # it expires by itself
                log.warning("could not release the blob store's claim of %s: %s", op.id, exc)

    async def start_writes(self, snapshot_id: str) -> None:
        """Start every holder's write of the snapshot; waits for none. Never raises:
        whatever fails here fails the commit (``finish_persist`` starts a write that did
        not start)."""
        op = self._ops.get(snapshot_id)
        if op is None or op.captures is None or op.writes_started:
            return
        op.writes_started = True
        if op.blob_hold is not None and not op.blob_hold.done():
            hold = op.blob_hold

            async def after_hold() -> None:
                with contextlib.suppress(Exception):  # its error fails the commit
                    await asyncio.shield(hold)
                    if op.outcome is None:
                        for handle in op.holders.values():
                            self._transport.send(handle, "start_persist", snapshot_id)

            task = asyncio.ensure_future(after_hold())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        for handle in op.holders.values():
            self._transport.send(handle, "start_persist", snapshot_id)

    def _unique_check(self, op: _Operation) -> asyncio.Future[int]:
        """The check of the snapshot's rollouts (none captured by two instances), started
        on first use, by the commit once it has released the holders: a thread that
        decodes every capture would otherwise hold this process's GIL while the release
        waits to go out."""
        if op.encoding is None:
            op.encoding = asyncio.ensure_future(self._runtime.run_blocking(
                _check_captured_once, op.captures or ()))
            # Its error is raised by the commit's await; an aborted snapshot never awaits.
            op.encoding.add_done_callback(lambda f: f.cancelled() or f.exception())
        return op.encoding

    async def commit_snapshot(self, snapshot_id: str, checkpoint_path: str,
                              metrics: dict[str, float], restarted: int) -> SnapshotCommitted:
        """Wait for every shard, write the manifest last, then resume every holder.

        A repeated commit gets the first one's answer; a commit of an operation that
        was aborted (or lapsed) is refused with that outcome's error."""
        op = self._ops.get(snapshot_id)
        if op is None:
            if snapshot_id in self._committed:
                return self._committed[snapshot_id]
            raise self._refusal(snapshot_id)
        if op.committing:
            await op.closed.wait()
            return await self.commit_snapshot(snapshot_id, checkpoint_path, metrics,
                                              restarted)
        if op.captures is None:
            raise StaleSnapshotError(f"commit of {snapshot_id} before its begin finished")
        op.committing = True
        # The backend resumes as the exit begins: the capture is an immutable copy, so
        # turns may run while the shards are written; the commit still waits for every
        # shard and the manifest, and a failure still aborts the snapshot.
        for handle in op.holders.values():
            self._transport.send(handle, "release", snapshot_id)
        op.released = self._clock.monotonic()
        self._unique_check(op)
        directory = environment_folder(checkpoint_path)
        try:
            await self._injected_delay("commit_snapshot")
            if op.blob_hold is not None:  # no holder relies on the store before it holds
                await asyncio.shield(op.blob_hold)
            persists = await self._fan(
                op.holders, "finish_persist",
                lambda inst, h: self._transport.call(
                    h, "finish_persist", snapshot_id, timeout=self._config.persist_timeout_s),
                op_id=snapshot_id)
            shards: list[ShardEntry] = [s for p in persists.values() for s in p.shards]
            all_metrics = dict(metrics)
            all_metrics.update(
                persist_seconds=max((p.persist_seconds for p in persists.values()),
                                    default=0.0),
                bytes_written=float(sum(p.bytes_written for p in persists.values())),
            )
            captured = await self._unique_check(op)
            manifest = encode_manifest(
                snapshot_id=snapshot_id,
                created_at=datetime.fromtimestamp(self._clock.wall(), timezone.utc),
                instances=list(op.holders), shards=shards,
                restarted_rollouts=restarted, metrics=all_metrics, blob_store=op.blob_ref)
            await self._earlier_commits(op)
            await self._injected_delay("before_manifest")
            await self._claims_hold(op)
            async with self._path_lock(checkpoint_path):
                # Fenced: a successor that took this incarnation for dead and aborted the
                # snapshot removed its claim (``write_manifest`` checks in the same call).
                await self._runtime.run_blocking(write_manifest, directory, manifest,
                                                 (op.id, frozenset(op.claim_beats)))
            await self._injected_delay("after_manifest")
        except BaseException as exc:
            self._count_failure("snapshot", exc)
            op.committing = False
            await self._abort(op, Outcome.ABORTED)
            if op.outcome is not Outcome.COMMITTED:
                raise
            # Only the manifest's write can fail after its rename (the folder's fsync):
            # the manifest names this snapshot, so it is committed, and final.
            log.warning("commit of %s raised after its manifest was renamed into place "
                        "(%s); it is committed", snapshot_id, exc)
        self._close(op, Outcome.COMMITTED)
        self._record_commit(op, all_metrics, captured, restarted)
        # Committed: resume first; the older snapshots' files are garbage from here on
        # and their removal must not lengthen the pause.
        await self._fan(op.holders, "resume",
                        lambda inst, h: self._transport.call(
                            h, "resume", snapshot_id, timeout=self._config.phase_timeout_s),
                        tolerate_failures=True)
        removed = await self._clean_up(op)
        await self._release_blobs(op)
        if removed:  # an older snapshot's files went: its blobs may be garbage now
            self._garbage_possible = True
        self._start_collection()
        result = SnapshotCommitted(metrics=all_metrics, rollouts=captured,
                                   shards=len(shards), removed_files=tuple(removed))
        self._committed[snapshot_id] = result
        while len(self._committed) > HISTORY_SIZE:
            self._committed.popitem(last=False)
        return result

    async def _earlier_commits(self, op: _Operation) -> None:
        """Wait until every snapshot into the same folder captured before ``op`` has
        ended. Holders resume as a commit begins, so a second snapshot can capture and
        commit while the first still writes: its manifest must not be replaced by the
        older one's. An earlier snapshot whose driver is gone ends at its lease."""
        directory = environment_folder(op.path)
        while True:
            earlier = [o for o in self._ops.values()
                       if o.kind == "snapshot" and o is not op
                       and 0 < o.capture_order < op.capture_order
                       and environment_folder(o.path) == directory]
            if not earlier:
                return
            await earlier[0].closed.wait()

    async def _clean_up(self, op: _Operation) -> list[str]:
        """After a commit: remove the files the manifest there no longer names, and
        stale claims; never a file of an operation in progress (this job's or
        another's). Under the path's lock, so no commit of this coordinator renames a
        manifest into the folder meanwhile."""
        directory = environment_folder(op.path)
        ours = {o.id for o in self._ops.values()}

        def clean() -> list[str]:
            protect = live_claims(directory, self._owner, self._claim_watch, ours,
                                  self._incarnation)
            release_claim(directory, op.id)
            for claim in read_claims(directory):
                if claim.operation not in protect:
                    release_claim(directory, claim.operation)
            return remove_unreferenced_files(directory, protect)

        try:
            async with self._path_lock(op.path):
                removed: list[str] = await self._runtime.run_blocking(clean)
            return removed
        except (OSError, NemoCkptError) as exc:
            log.warning("clean-up after %s failed: %s", op.id, exc)
            return []

    @contextlib.asynccontextmanager
    async def _path_lock(self, path: str) -> AsyncIterator[None]:
        """Serializes manifest writes and clean-ups in one folder; forgotten once no
        call holds or awaits it."""
        lock, users = self._path_locks.get(path, (asyncio.Lock(), 0))
        self._path_locks[path] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._path_locks[path]
            if users == 1:
                del self._path_locks[path]
            else:
                self._path_locks[path] = (lock, users - 1)

    # --- restore ----------------------------------------------------------------------

    async def prepare_restore(self, restore_id: str, checkpoint_path: str) -> RestoreBegun:
        """Verify the snapshot and have each instance's holder load it, nothing live yet."""
        op = self._open(restore_id, "restore", checkpoint_path)
        try:
            return await self._prepare_restore(op, checkpoint_path)
        except BaseException as exc:
            self._count_failure("restore", exc)
            await self._abort(op, Outcome.ABORTED)
            raise

    async def _prepare_restore(self, op: _Operation, checkpoint_path: str) -> RestoreBegun:
        manifest = await self._runtime.run_blocking(read_manifest, checkpoint_path)
        await self._known_holders()
        async with self._placement_lock:
            for inst in sorted(manifest.instances, key=instance_sort_key):
                if inst not in self._holders:
                    await self._create_holder(inst, await self._least_loaded_node())
        op.holders = {i: self._holders[i] for i in sorted(self._holders, key=instance_sort_key)}
        placement = {i: self._holder_nodes[i] for i in op.holders}
        if op.outcome is not None:
            raise self._refusal(op.id)
        directory = str(environment_folder(checkpoint_path))
        blob_store = blob_store_of(checkpoint_path, manifest)
        shards_of: dict[str, list[ShardEntry]] = {i: [] for i in op.holders}
        for shard in manifest.shards:
            if shard.instance_id not in shards_of:
                raise BackendUnavailableError(
                    f"no holder could be placed for instance {shard.instance_id} of "
                    f"{checkpoint_path}; retry once the cluster has a node for it")
            shards_of[shard.instance_id].append(shard)
        prepared: dict[str, RestorePrepared] = await self._fan(
            op.holders, "prepare_restore",
            lambda inst, h: self._transport.call(
                h, "prepare_restore", op.id, directory, shards_of[inst],
                self._config.lease_s, blob_store, timeout=self._config.persist_timeout_s),
            op_id=op.id)
        if op.outcome is not None:
            raise self._refusal(op.id)
        # What the holders read must be what the manifest lists, shard by shard (the
        # check `nemo-ckpt verify` makes), and no rollout may go live twice.
        listed = rollouts_by_shard(manifest)
        by_shard = {p.instance_id: p.sessions_by_shard() for p in prepared.values()}
        problems = [problem for shards in by_shard.values() for file, sessions in shards
                    for problem in shard_problems(
                        None if listed is None else listed.get(file, {}), sessions,
                        f"{directory}/{file}")]
        continued = {inst: [pair for _, pairs in shards for pair in pairs]
                     for inst, shards in by_shard.items()}
        restored = [rid for pairs in continued.values() for rid, _ in pairs]
        if len(set(restored)) != len(restored):
            twice = sorted(r for r, n in Counter(restored).items() if n > 1)
            problems.append(f"rollouts held by two shards of {directory}: {twice[:10]}; "
                            f"restore an earlier checkpoint")
        if problems:
            raise ShardCorruptedError(directory, "; ".join(problems))
        # Nothing is live yet: a rollout live on any holder refuses the whole restore.
        restoring = set(restored)
        clash = sorted({(p.instance_id, rid) for p in prepared.values()
                        for rid in p.live() if rid in restoring})
        if clash:
            raise RestoreConflictError(
                f"cannot restore {checkpoint_path}: rollouts it holds are live now "
                f"({', '.join(f'{i}/{k}' for i, k in clash[:10])}"
                f"{' ...' if len(clash) > 10 else ''}); retire or close them first, or "
                f"restore into a fresh job")
        op.read_seconds = max((p.read_seconds for p in prepared.values()), default=0.0)
        return RestoreBegun(
            restore_id=op.id,
            continued_attempts=frozenset(
                (inst, rid, attempt) for inst, pairs in continued.items()
                for rid, attempt in pairs),
            staging_keys=frozenset().union(*(p.staging_keys for p in prepared.values())),
            placement=placement,
            bytes_read=sum(p.bytes_read for p in prepared.values()),
            read_seconds=op.read_seconds,
        )

    async def commit_restore(self, restore_id: str) -> int:
        """Make every restored session live. Returns how many. If any holder fails, the
        ones that went live drop the restored sessions again (all or nothing)."""
        op = self._ops.get(restore_id)
        if op is None:
            if self._history.outcome(restore_id) is Outcome.COMMITTED:
                return 0
            raise self._refusal(restore_id)
        if op.committing:
            await op.closed.wait()
            return await self.commit_restore(restore_id)
        op.committing = True
        try:
            await self._injected_delay("commit_restore")
            counts = await self._fan(
                op.holders, "commit_restore",
                lambda inst, h: self._transport.call(
                    h, "commit_restore", restore_id, timeout=self._config.phase_timeout_s),
                op_id=restore_id)
        except BaseException as exc:
            self._count_failure("restore", exc)
            op.committing = False
            await self._abort(op, Outcome.ABORTED)
            raise
        self._close(op, Outcome.COMMITTED)
        self._metrics.observe("restore_duration", self._clock.monotonic() - op.started)
        self._metrics.observe("restore_read", op.read_seconds)
        return sum(counts.values())

    # --- ledger operations --------------------------------------------------------------

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Retire these attempts on every holder; returns the capture keys dropped."""
        return await self._ledger_op("retire", episodes)

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Forget these attempts on every holder; returns the capture keys dropped."""
        return await self._ledger_op("forget", episodes)

    async def _ledger_op(self, op: str, episodes: list[EnvironmentEpisode]) -> list[str]:
        # RL retires an attempt per finished rollout: use the known holders, and pay for
        # a rediscovery only when there are none or one of them has gone.
        if not self._holders:
            await self.ensure_holders()

        async def fan() -> dict[str, list[str]]:
            return await self._fan(
                dict(self._holders), op,
                lambda inst, h: self._transport.call(
                    h, op, episodes, timeout=self._config.phase_timeout_s))

        try:
            dropped = await fan()
        except BackendUnavailableError:
            await self.ensure_holders()
            dropped = await fan()
        return sorted(k for keys in dropped.values() for k in keys)

    # --- internals ----------------------------------------------------------------------

    async def _fan(
        self,
        holders: dict[str, Actor],
        what: str,
        call: Callable[[str, Actor], Awaitable[T]],
        tolerate_failures: bool = False,
        op_id: str | None = None,
    ) -> dict[str, T]:
        """Call every holder concurrently; after all have answered, raise one error that
        carries every holder's failure (``aggregate``), unless ``tolerate_failures``.

        With ``op_id``, logs one structured line: the phase, its per-holder seconds and
        the slowest holder, so that a slow pause names its cause.
        """
        targets = dict(holders)
        seconds: dict[str, float] = {}
        start = self._clock.monotonic()

        async def one(inst: str, handle: Actor) -> T:
            try:
                return await call(inst, handle)
            finally:
                seconds[inst] = self._clock.monotonic() - start

        results = await asyncio.gather(*(one(i, h) for i, h in targets.items()),
                                       return_exceptions=True)
        errors = {i: r for i, r in zip(targets, results, strict=True)
                  if isinstance(r, BaseException)}
        if any(isinstance(e, BackendUnavailableError) for e in errors.values()):
            self._holders = {}  # a holder is gone or late: the next phase re-discovers
        if op_id is not None:
            _log_phase(op_id, what, self._clock.monotonic() - start, seconds,
                       {i: f"{type(e).__name__}: {e}" for i, e in errors.items()})
        if errors and not tolerate_failures:
            raise aggregate(what, errors)
        for inst, err in errors.items():
            log.info("%s on %s failed (tolerated): %s", what, inst, err)
        return {i: r for i, r in zip(targets, results, strict=True)
                if not isinstance(r, BaseException)}

    async def _discover(self) -> list[HolderInfo]:
        found = self._transport.holders()
        self._registered = found
        results = await asyncio.gather(
            *(self._transport.call(h, "info", timeout=self._config.phase_timeout_s)
              for h in found.values()),
            return_exceptions=True)
        infos = []
        self._holders = {}
        self._holder_nodes = {}
        for (inst, handle), res in zip(found.items(), results, strict=True):
            if isinstance(res, HolderInfo):
                self._holders[inst] = handle
                self._holder_nodes[inst] = res.node_id
                infos.append(res)
            else:
                log.warning("holder %s does not answer (%s); treating it as lost", inst, res)
        return infos

    def _record_commit(self, op: _Operation, figures: dict[str, float], captured: int,
                       restarted: int) -> None:
        now = self._clock.monotonic()
        self._metrics.observe("snapshot_duration", now - op.started)
        # Holders pause at the start of begin_snapshot and are released as the commit
        # begins, so that span bounds their paused time.
        self._metrics.observe("paused", (op.released or now) - op.started)
        self._metrics.inc("bytes_written", figures.get("bytes_written", 0.0))
        self._metrics.inc("captured", float(captured))
        self._metrics.inc("restarted", float(restarted))

    def _count_failure(self, operation: str, error: BaseException | str) -> None:
        kind = error if isinstance(error, str) else type(error).__name__
        self._metrics.inc("failures", 1.0, tags={"operation": operation, "kind": kind})

    def _free_instance_id(self) -> str:
        k = 0
        while f"holder-{k}" in self._holders:
            k += 1
        return f"holder-{k}"

    async def _least_loaded_node(self) -> str:
        infos = await self._discover()
        load = {n: 0 for n in self._transport.alive_nodes()}
        for info in infos:
            if info.node_id in load:
                load[info.node_id] += 1
        if not load:
            raise BackendUnavailableError("no alive Ray node to place a holder on")
        return min(load, key=lambda n: (load[n], n))

    def _holder_options(self) -> dict[str, Any]:
        """The ``SessionHolder`` keyword arguments this job's holders are made with."""
        cfg = self._config
        return {"max_state_bytes": cfg.max_state_bytes, "turn_timeout_s": cfg.turn_timeout_s,
                "max_retired_marks": cfg.max_retired_marks, "namespace": cfg.namespace,
                "sandbox_root": None if cfg.sandbox_root is None else str(cfg.sandbox_root),
                "blob_root": None if self._blob_store() is None
                else join_location(str(cfg.checkpoint_root), BLOB_DIR),
                "sandbox_limits": cfg.sandbox_limits,
                "sandbox_restore_setid": cfg.sandbox_restore_setid}

    async def _create_holder(self, instance_id: str, node_id: str) -> HolderInfo:
        cfg = self._config
        handle = self._transport.create_holder(instance_id, node_id, self._holder_options())
        info: HolderInfo = await self._transport.call(handle, "info",
                                                      timeout=cfg.phase_timeout_s)
        self._holders[instance_id] = handle
        self._holder_nodes[instance_id] = info.node_id
        log.info("created holder %s on node %s", instance_id, node_id)
        return info


def _check_captured_once(captures: tuple[CaptureReport, ...]) -> int:
    """How many sessions the captures hold, or ValueError naming the rollouts that two
    instances captured (the same rollout running on two holders), which a snapshot
    must not commit even when nobody checked it against a cut. At set speed: the
    rollout ids are compared as a whole, named only when some repeat."""
    ids = [row[0] for c in captures for row in c.rows()]
    if len(set(ids)) == len(ids):
        return len(ids)
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    raise ValueError(
        f"rollouts captured twice: {twice[:10]}{' ...' if len(twice) > 10 else ''}: "
        f"each was captured by more than one instance, so the same rollout runs on two "
        f"holders; retire the extra attempt, and check snapshots against the "
        f"data-plane cut, which names them")


def _log_phase(op_id: str, phase: str, seconds: float, per_holder: dict[str, float],
               errors: dict[str, str]) -> None:
    slowest = max(per_holder, key=lambda i: per_holder[i], default=None)
    line = {
        "event": "phase", "operation": op_id, "phase": phase, "seconds": round(seconds, 6),
        "holders": {i: round(t, 6) for i, t in sorted(per_holder.items())},
        "slowest": slowest,
    }
    if errors:
        line["errors"] = errors
    log.log(logging.WARNING if errors else logging.INFO, "nemo_ckpt %s", json.dumps(line))


def _instance_order(info: HolderInfo) -> tuple[int, str]:
    return instance_sort_key(info.instance_id)

