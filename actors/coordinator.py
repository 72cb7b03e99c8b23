"""The checkpoint coordinator: one named actor that fans every phase out to the holders.

It reaches the holders only through its ``Transport`` (``nemo_ckpt.transport``), so
the same code runs as a Ray actor (``actors.ray_transport``) and in the simulation.

The coordinator routes each call to its parts:

- ``actors.operation_table.OperationTable``: one record per snapshot or restore, whose
  state is a value (``actors.operation_states``) changed only by ``set_state``, which
  alone records the outcome; a late or repeated call is answered with it or refused;
- ``actors.holder_registry.HolderRegistry``: the holders, their placement, the fan-out
  (a failure that several holders report carries each one's error:
  ``nemo_ckpt.errors.aggregate``);
- ``actors.claimed_folders.ClaimedFolders``: the claims on snapshot folders and the clean-up;
- ``actors.blob_collector.BlobCollector``: snapshots' holds on the blob store and its
  collection;
- ``nemo_ckpt.restore_plan``: a restore's shard assignment and checks, pure.

An operation whose driver stopped renewing is reaped when its lease lapses. The
coordinator's interface is ``nemo_ckpt.coordinator_api.CoordinatorApi``; the holders'
calls and their own order, ``SessionHolder``'s docstring.

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
import logging
from collections import Counter
from datetime import datetime, timezone
from typing import Any, TypeVar

from actors.blob_collector import BlobCollector
from actors.claimed_folders import ClaimedFolders
from actors.holder_registry import HolderRegistry
from actors.operation_states import (
    Aborted,
    Committed,
    FoundCommitted,
    Operation,
    RestoreCommitting,
    RestoreOperation,
    RestorePreparing,
    RestoreVerified,
    SnapshotBeginning,
    SnapshotCaptured,
    SnapshotCommitting,
    SnapshotOperation,
    SnapshotWriting,
    Unseen,
)
from actors.operation_table import OperationTable
from nemo_ckpt.blobs import BLOB_DIR
from nemo_ckpt.checkpoint_folder import environment_folder
from nemo_ckpt.claims import ClaimWatch
from nemo_ckpt.cleanup import remove_snapshot_files
from nemo_ckpt.collection import CollectionReport
from nemo_ckpt.config import (
    ADOPTED_FIELDS,
    DRIVER_FIELDS,
    CheckpointConfig,
    config_differences,
)
from nemo_ckpt.coordinator_api import RestoreBegun, SnapshotBegun, SnapshotCommitted
from nemo_ckpt.errors import (
    BackendUnavailableError,
    ConfigMismatchError,
    LeaseExpiredError,
    NemoCkptError,
    StaleSnapshotError,
)
from nemo_ckpt.holder_api import HolderCalls
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.location import join_location
from nemo_ckpt.manifest import ShardEntry, encode_manifest
from nemo_ckpt.operations import Outcome
from nemo_ckpt.phases import (
    CaptureReport,
    HolderInfo,
    PauseReport,
    RestorePrepared,
    instance_sort_key,
)
from nemo_ckpt.restore_plan import assign_shards, verify_prepared
from nemo_ckpt.sandbox_storage import blob_store_of, blob_store_ref
from nemo_ckpt.snapshot_files import read_manifest, write_manifest
from nemo_ckpt.transport import Actor, Transport

__all__ = ["CheckpointCoordinator", "SnapshotBegun", "SnapshotCommitted", "RestoreBegun"]

log = logging.getLogger("nemo_ckpt.coordinator")
OpT = TypeVar("OpT", bound=Operation)
INJECTABLE_PHASES = frozenset({"begin_snapshot", "commit_snapshot", "before_manifest",
                               "after_manifest", "commit_restore"})


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
        self.collector_name = f"{self._owner}#{self._incarnation}"
        # Other writers' claims (paths, the blob store), judged on this process's clock:
        # kept for the coordinator's life, as only a claim seen before can be found
        # abandoned (nemo_ckpt.claims).
        claim_watch = ClaimWatch(self._clock.monotonic)
        self.operations = OperationTable(config.lease_s)
        self.holders = HolderRegistry(transport, lambda: self._config.phase_timeout_s,
                                      self._holder_options)
        self.folders = ClaimedFolders(self._runtime, self._owner, self._incarnation,
                                      claim_watch, lambda: self._claim_ttl)
        self.blobs = BlobCollector(
            None if config.sandbox_root is None or config.checkpoint_root is None
            else str(config.checkpoint_root),
            self._runtime, self._owner, self.collector_name, claim_watch,
            lambda: bool(self.operations))
        self._background: set[asyncio.Future[Any]] = set()  # kept so they are not collected
        self._reaper: asyncio.Task[None] | None = None
        self._injected_delays: dict[str, float] = {}
        self._captures_done = 0

    def _calls(self, holder: Actor, timeout: float | None = None) -> HolderCalls:
        """Typed calls to one holder, with a control call's timeout unless given."""
        return HolderCalls(self._transport, holder,
                           self._config.phase_timeout_s if timeout is None else timeout)

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
            async with self.holders.lock:
                infos = await self.holders.discover()
            for info in sorted(infos, key=lambda i: instance_sort_key(i.instance_id)):
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
            self.operations.lease_s = self._config.lease_s

    def _holder_options(self) -> dict[str, Any]:
        """The ``SessionHolder`` keyword arguments this job's holders are made with."""
        cfg = self._config
        return {"max_state_bytes": cfg.max_state_bytes, "turn_timeout_s": cfg.turn_timeout_s,
                "max_retired_marks": cfg.max_retired_marks, "namespace": cfg.namespace,
                "sandbox_root": None if cfg.sandbox_root is None else str(cfg.sandbox_root),
                "blob_root": None if self.blobs.store is None
                else join_location(str(cfg.checkpoint_root), BLOB_DIR),
                "sandbox_limits": cfg.sandbox_limits,
                "sandbox_restore_setid": cfg.sandbox_restore_setid}

    # --- holders ---------------------------------------------------------------------

    async def ensure_holders(self) -> list[HolderInfo]:
        """Find every live holder, and create one on each alive node that has none."""
        return await self.holders.ensure()

    async def holder_infos(self) -> list[HolderInfo]:
        """Every live holder's info, without creating any."""
        return await self.holders.infos()

    async def probe_storage(self, root: str) -> dict[str, str]:
        """Have every holder write a probe file under ``root``; returns instance -> path
        or ``error: ...``."""
        await self.holders.ensure()
        results = await asyncio.gather(
            *(self._calls(h).probe_storage(root) for h in self.holders.handles.values()),
            return_exceptions=True)
        return {inst: (r if isinstance(r, str) else f"error: {r}")
                for inst, r in zip(self.holders.handles, results, strict=True)}

    async def probe_sandboxes(self) -> dict[str, str]:
        """Have every holder check its sandbox cache; instance -> "" or ``error: ...``."""
        await self.holders.ensure()
        results = await asyncio.gather(
            *(self._calls(h).probe_sandbox() for h in self.holders.handles.values()),
            return_exceptions=True)
        return {inst: ("" if not isinstance(r, BaseException) else f"error: {r}")
                for inst, r in zip(self.holders.handles, results, strict=True)}

    async def inject_delay(self, phase: str, seconds: float) -> None:
        """Fault-injection seam for tests and drills: make ``phase`` take ``seconds``
        longer, so a fault (a kill, a cancellation) can be aimed at it. Phases:
        begin_snapshot (before the holders are asked), commit_snapshot (before the
        shards are awaited), before_manifest (every shard durable, the manifest not yet
        written), after_manifest (the manifest renamed, holders not yet resumed),
        commit_restore (before the holders are asked). 0 removes it."""
        if phase not in INJECTABLE_PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {sorted(INJECTABLE_PHASES)}")
        self._injected_delays[phase] = seconds

    async def _injected_delay(self, phase: str) -> None:
        seconds = self._injected_delays.get(phase, 0.0)
        if seconds > 0:
            await asyncio.sleep(seconds)

    # --- operations: leases, aborts ---------------------------------------------------

    def _open(self, op: OpT) -> OpT:
        self.operations.open(op)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())
        return op

    async def _reap(self) -> None:
        """Abort every operation whose lease lapsed: its driver stopped renewing."""
        period = min(self._config.lease_s / 4, 1.0)
        while self.operations:
            await asyncio.sleep(period)
            now = self._clock.monotonic()
            for op in self.operations.open_ones():
                if not op.committing and now > op.lease_deadline:
                    log.warning("operation %s: no renewal for %.1fs; aborting it", op.id,
                                self._config.lease_s)
                    await self._abort(op, Outcome.LAPSED)

    async def renew(self, operation_id: str) -> None:
        """Renew the lease of the operation and of every holder taking part in it."""
        op = self.operations.get(operation_id)
        if op is None:
            raise self.operations.refusal(operation_id)
        op.lease_deadline = self._clock.monotonic() + self._config.lease_s
        # The holders first, and whatever the claims' writes do: a disk full for a few
        # seconds must not lapse the holders' leases (the commit checks the claims).
        await self.holders.fan(
            op.holders, "renew_lease",
            lambda inst, h: self._calls(h).renew_lease(operation_id, self._config.lease_s),
            tolerate_failures=True)
        if isinstance(op, SnapshotOperation) and op.captured is not None:
            try:
                await self.folders.claim(op)
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
        remembered, so that its late first call is refused; it is a snapshot when the
        driver names its ``checkpoint_path``. ``caller_error`` names the exception that
        ended the caller's block, for the failure metric.
        """
        op = self.operations.get(operation_id)
        if op is None:
            known = self.operations.outcome(operation_id)
            if known is not None:
                if caller_error is not None:
                    self._count_failure("snapshot" if checkpoint_path else "restore",
                                        caller_error)
                return known.value
            op = self._unseen(operation_id, checkpoint_path)
        if caller_error is not None:
            self._count_failure(op.kind, caller_error)
        if op.committing:  # commit and abort exclude each other: the commit decides
            await op.closed.wait()
        else:
            await self._abort(op, Outcome.ABORTED)
        assert op.outcome is not None
        return op.outcome.value

    def _unseen(self, operation_id: str, path: str | None) -> Operation:
        now = self._clock.monotonic()
        kind = SnapshotOperation if path is not None else RestoreOperation
        return self.operations.adopt(kind(operation_id, path, now, now, Unseen()))

    async def _abort(self, op: Operation, outcome: Outcome) -> None:
        """End ``op`` and undo it everywhere: every holder it involved, its files."""
        if op.outcome is not None:
            await op.closed.wait()
            return
        unseen = isinstance(op.state, Unseen)
        self.operations.set_state(op, Aborted(outcome))
        await self._holders_drop(op, unseen)
        if not isinstance(op, SnapshotOperation):
            return
        if op.blob_hold is not None:
            if not op.blob_hold.done():
                await asyncio.wait([op.blob_hold])  # its put must not land after the release
            self.blobs.garbage_possible()  # its holders may have written blobs
            await self.blobs.release(op.id)
        if op.path is None:
            return
        try:
            committed = await self._runtime.run_blocking(
                remove_snapshot_files, environment_folder(op.path), op.id)
        except (OSError, NemoCkptError) as exc:
            log.warning("could not remove the files of %s: %s", op.id, exc)
            return
        if committed:  # the manifest was renamed into place before a step failed (or
            # before the coordinator that wrote it died): the commit won
            self.operations.set_state(op, FoundCommitted())

    async def _holders_drop(self, op: Operation, unseen: bool) -> None:
        """Every holder ``op`` involved drops it, and every holder registered now: a
        holder made since (its predecessor died) may have been paused by a late call of
        this operation (a coordinator taken for dead that runs again); the abort it
        records refuses any later one. For an operation never seen here, every holder
        registered, answering or not: one slow to answer its info (a stalled link) may
        still be paused for it."""
        if unseen:
            await self.holders.discover()
            targets = self.holders.registered
        else:
            targets = dict(op.holders)
            for inst, handle in self._transport.holders().items():
                if inst not in targets:
                    targets[inst] = handle
                elif targets[inst].ref != handle.ref:  # another incarnation of it now
                    targets[f"{inst} (now)"] = handle
        await self.holders.fan(targets, "abort",
                               lambda inst, h: self._calls(h).abort(op.id),
                               tolerate_failures=True)

    # --- snapshot ---------------------------------------------------------------------

    async def begin_snapshot(self, snapshot_id: str, checkpoint_path: str) -> SnapshotBegun:
        """Claim the path, pause every holder and capture.

        This is the pause's hot path: the holder set is the one known since the last
        discovery, re-discovered only when the alive nodes changed, and each holder
        pauses and captures in one call (``SessionHolder.begin``). The writes start at
        ``start_writes``, which the driver sends once it has this answer (benchmarks/
        README.md says what starting them earlier cost the answer). ``finish_persist``
        starts any write whose start message has not arrived.
        """
        now = self._clock.monotonic()
        op = self._open(SnapshotOperation(snapshot_id, checkpoint_path, now,
                                          now + self._config.lease_s, SnapshotBeginning()))
        cfg = self._config
        claimed: asyncio.Future[None] | None = None
        try:
            op.holders = await self.holders.known()
            directory = environment_folder(checkpoint_path)
            if self.blobs.store is not None:
                assert cfg.checkpoint_root is not None  # the config requires it
                op.blob_ref = blob_store_ref(cfg.checkpoint_root, checkpoint_path)
            await self._injected_delay("begin_snapshot")
            if op.outcome is not None:  # aborted before any holder was asked: ask none
                raise self.operations.refusal(snapshot_id)
            # The claim runs beside the pause, not before it: no shard is written before
            # the claim holds (writes start after this returns), and on a bucket its
            # list, reads and put would otherwise add round trips to every pause. A
            # refused claim aborts the snapshot like any failure here: holders resume.
            claimed = asyncio.ensure_future(self._prepare_and_claim(op))
            if self.blobs.store is not None:
                # Not awaited here: no holder relies on the store before it holds (the
                # writes start after it, and the commit awaits it), and its file work
                # would otherwise lengthen every pause.
                op.blob_hold = asyncio.ensure_future(self._hold_blobs(op, first=True))
                op.blob_hold.add_done_callback(lambda f: f.cancelled() or f.exception())
            begun: dict[str, tuple[PauseReport, CaptureReport]] = await self.holders.fan(
                op.holders, "pause_capture",
                lambda inst, h: self._calls(
                    h, cfg.drain_timeout_s + cfg.phase_timeout_s).begin(
                        snapshot_id, cfg.drain_timeout_s, cfg.lease_s, str(directory)),
                op_id=snapshot_id)
            # Shielded: a cancelled begin must not cancel the claim under its thread,
            # whose put would then land after the abort's clean-up.
            await asyncio.shield(claimed)
            if op.outcome is not None:  # aborted meanwhile: its abort reached every holder
                raise self.operations.refusal(snapshot_id)
        except BaseException as exc:
            if claimed is not None and not claimed.done():
                # Its thread runs on; the abort's clean-up must not race its put.
                await asyncio.wait([claimed])
            if claimed is not None and claimed.done() and not claimed.cancelled():
                claimed.exception()  # retrieved: the first error is the one raised
            self._count_failure("snapshot", exc)
            await self._abort(op, Outcome.ABORTED)
            raise
        self._captures_done += 1
        captured = SnapshotCaptured(tuple(c for _, c in begun.values()), self._captures_done)
        self.operations.set_state(op, captured)
        return SnapshotBegun(
            snapshot_id=snapshot_id, instances=tuple(op.holders),
            pauses=tuple(p for p, _ in begun.values()), captures=captured.captures,
            entry_seconds=self._clock.monotonic() - op.started)

    async def _prepare_and_claim(self, op: SnapshotOperation) -> None:
        assert op.path is not None
        await self._runtime.run_blocking(environment_folder(op.path).prepare)
        await self.folders.claim(op)

    @property
    def _claim_ttl(self) -> float:
        """How long a claim or a hold stands without a renewal."""
        return self._config.lease_s * 2

    async def _claims_hold(self, op: SnapshotOperation) -> None:
        """Before the manifest: the path's claim and the store's hold must not have
        lapsed since they were last written (their renewals may have failed). A claim
        near its end is written again (refused if another job took the path meanwhile);
        a hold that may have lapsed refuses the commit, since a collection may have
        removed blobs the snapshot found present."""
        if self.folders.stale(op.claimed_at):
            await self.folders.claim(op)
        if op.blob_hold is not None and self.folders.stale(op.held_at):
            raise LeaseExpiredError(
                f"{op.id}: its hold on the blob store could not be renewed for too long "
                f"(a full or failing disk?), so a collection may have removed blobs it "
                f"relies on; it was not committed: retry the snapshot")

    async def _hold_blobs(self, op: SnapshotOperation, first: bool = False) -> None:
        """Hold the blob store for the snapshot (or renew the hold): it relies on the
        blobs there until it commits, so no collection may run meanwhile."""
        held_at = await self.blobs.hold(op.id, self._claim_ttl, first)
        if held_at is not None:
            op.held_at = held_at

    async def collection_done(self) -> CollectionReport | None:
        """Wait for the blob store's collection in progress, if any; the last one's
        report."""
        return await self.blobs.done()

    async def start_writes(self, snapshot_id: str) -> None:
        """Start every holder's write of the snapshot; waits for none. Never raises:
        whatever fails here fails the commit (``finish_persist`` starts a write that did
        not start)."""
        op = self.operations.get(snapshot_id)
        if not isinstance(op, SnapshotOperation) or type(op.state) is not SnapshotCaptured:
            return
        assert isinstance(op.state, SnapshotCaptured)
        self.operations.set_state(op, SnapshotWriting(op.state.captures, op.state.order))
        if op.blob_hold is not None and not op.blob_hold.done():
            hold = op.blob_hold

            async def after_hold() -> None:
                with contextlib.suppress(Exception):  # its error fails the commit
                    await asyncio.shield(hold)
                    if op.outcome is None:
                        for handle in op.holders.values():
                            self._calls(handle).start_persist(snapshot_id)

            task = asyncio.ensure_future(after_hold())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        for handle in op.holders.values():
            self._calls(handle).start_persist(snapshot_id)

    async def commit_snapshot(self, snapshot_id: str, checkpoint_path: str,
                              metrics: dict[str, float], restarted: int) -> SnapshotCommitted:
        """Wait for every shard, write the manifest last, then resume every holder.

        A repeated commit gets the first one's answer; a commit of an operation that
        was aborted (or lapsed) is refused with that outcome's error."""
        op = self.operations.get(snapshot_id)
        if op is None:
            result = self.operations.result(snapshot_id)
            if isinstance(result, SnapshotCommitted):
                return result
            raise self.operations.refusal(snapshot_id)
        if op.committing:
            await op.closed.wait()
            return await self.commit_snapshot(snapshot_id, checkpoint_path, metrics,
                                              restarted)
        if not isinstance(op, SnapshotOperation) or op.captured is None:
            raise StaleSnapshotError(f"commit of {snapshot_id} before its begin finished")
        captured = op.captured
        # The backend resumes as the exit begins: the capture is an immutable copy, so
        # turns may run while the shards are written; the commit still waits for every
        # shard and the manifest, and a failure still aborts the snapshot.
        for handle in op.holders.values():
            self._calls(handle).release(snapshot_id)
        # The check that no rollout was captured by two instances starts now, after the
        # release went out: a thread that decodes every capture holds this process's
        # GIL meanwhile. Its error is raised by the await below; an abort cancels it.
        unique = asyncio.ensure_future(self._runtime.run_blocking(
            _check_captured_once, captured.captures))
        unique.add_done_callback(lambda f: f.cancelled() or f.exception())
        committing = SnapshotCommitting(captured.captures, captured.order,
                                        released=self._clock.monotonic(),
                                        unique_check=unique)
        self.operations.set_state(op, committing)
        directory = environment_folder(checkpoint_path)
        try:
            await self._injected_delay("commit_snapshot")
            if op.blob_hold is not None:  # no holder relies on the store before it holds
                await asyncio.shield(op.blob_hold)
            persists = await self.holders.fan(
                op.holders, "finish_persist",
                lambda inst, h: self._calls(h, self._config.persist_timeout_s)
                .finish_persist(snapshot_id),
                op_id=snapshot_id)
            shards: list[ShardEntry] = [s for p in persists.values() for s in p.shards]
            all_metrics = dict(metrics)
            all_metrics.update(
                persist_seconds=max((p.persist_seconds for p in persists.values()),
                                    default=0.0),
                bytes_written=float(sum(p.bytes_written for p in persists.values())),
            )
            rollouts = await unique
            manifest = encode_manifest(
                snapshot_id=snapshot_id,
                created_at=datetime.fromtimestamp(self._clock.wall(), timezone.utc),
                instances=list(op.holders), shards=shards,
                restarted_rollouts=restarted, metrics=all_metrics, blob_store=op.blob_ref)
            await self._earlier_commits(op, captured.order)
            await self._injected_delay("before_manifest")
            await self._claims_hold(op)
            async with self.folders.lock(checkpoint_path):
                # Fenced: a successor that took this incarnation for dead and aborted the
                # snapshot removed its claim (``write_manifest`` checks in the same call).
                await self._runtime.run_blocking(write_manifest, directory, manifest,
                                                 (op.id, frozenset(op.claim_beats)))
            await self._injected_delay("after_manifest")
        except BaseException as exc:
            self._count_failure("snapshot", exc)
            await self._abort(op, Outcome.ABORTED)
            if not isinstance(op.state, FoundCommitted):
                raise
            # Only the manifest's write can fail after its rename (the folder's fsync):
            # the manifest names this snapshot, so it is committed, and final.
            log.warning("commit of %s raised after its manifest was renamed into place "
                        "(%s); it is committed", snapshot_id, exc)
        else:
            self.operations.set_state(op, Committed())
        self._record_commit(op, committing.released, all_metrics, rollouts, restarted)
        # Committed: resume first; the older snapshots' files are garbage from here on
        # and their removal must not lengthen the pause.
        await self.holders.fan(op.holders, "resume",
                               lambda inst, h: self._calls(h).resume(snapshot_id),
                               tolerate_failures=True)
        removed = await self.folders.clean_up(
            op, [o.id for o in self.operations.open_ones()])
        await self.blobs.release(op.id)
        if removed:  # an older snapshot's files went: its blobs may be garbage now
            self.blobs.garbage_possible()
        self.blobs.start()
        result = SnapshotCommitted(metrics=all_metrics, rollouts=rollouts,
                                   shards=len(shards), removed_files=tuple(removed))
        self.operations.keep_result(snapshot_id, result)
        return result

    async def _earlier_commits(self, op: SnapshotOperation, order: int) -> None:
        """Wait until every snapshot into the same folder captured before ``op`` has
        ended. Holders resume as a commit begins, so a second snapshot can capture and
        commit while the first still writes: its manifest must not be replaced by the
        older one's. An earlier snapshot whose driver is gone ends at its lease."""
        assert op.path is not None
        directory = environment_folder(op.path)
        while True:
            earlier = [o for o in self.operations.open_ones()
                       if isinstance(o, SnapshotOperation) and o is not op
                       and o.captured is not None and o.captured.order < order
                       and o.path is not None and environment_folder(o.path) == directory]
            if not earlier:
                return
            await earlier[0].closed.wait()

    # --- restore ----------------------------------------------------------------------

    async def prepare_restore(self, restore_id: str, checkpoint_path: str) -> RestoreBegun:
        """Verify the snapshot and have each instance's holder load it, nothing live yet."""
        now = self._clock.monotonic()
        op = self._open(RestoreOperation(restore_id, checkpoint_path, now,
                                         now + self._config.lease_s, RestorePreparing()))
        try:
            return await self._prepare_restore(op, checkpoint_path)
        except BaseException as exc:
            self._count_failure("restore", exc)
            await self._abort(op, Outcome.ABORTED)
            raise

    async def _prepare_restore(self, op: Operation, checkpoint_path: str) -> RestoreBegun:
        manifest = await self._runtime.run_blocking(read_manifest, checkpoint_path)
        placement = await self.holders.place(list(manifest.instances))
        op.holders = self.holders.handles
        if op.outcome is not None:
            raise self.operations.refusal(op.id)
        directory = str(environment_folder(checkpoint_path))
        blob_store = blob_store_of(checkpoint_path, manifest)
        shards_of = assign_shards(manifest, op.holders, checkpoint_path)
        prepared: dict[str, RestorePrepared] = await self.holders.fan(
            op.holders, "prepare_restore",
            lambda inst, h: self._calls(h, self._config.persist_timeout_s).prepare_restore(
                op.id, directory, shards_of[inst], self._config.lease_s, blob_store),
            op_id=op.id)
        if op.outcome is not None:
            raise self.operations.refusal(op.id)
        verified = verify_prepared(manifest, directory, checkpoint_path, prepared)
        self.operations.set_state(op, RestoreVerified(verified.read_seconds))
        return RestoreBegun(
            restore_id=op.id, continued_attempts=verified.continued_attempts,
            staging_keys=verified.staging_keys, placement=placement,
            bytes_read=verified.bytes_read, read_seconds=verified.read_seconds)

    async def commit_restore(self, restore_id: str) -> int:
        """Make every restored session live. Returns how many. If any holder fails, the
        ones that went live drop the restored sessions again (all or nothing)."""
        op = self.operations.get(restore_id)
        if op is None:
            if self.operations.outcome(restore_id) is Outcome.COMMITTED:
                return 0
            raise self.operations.refusal(restore_id)
        if op.committing:
            await op.closed.wait()
            return await self.commit_restore(restore_id)
        if not isinstance(op.state, RestoreVerified):
            raise StaleSnapshotError(f"commit of {restore_id} before its prepare finished")
        read_seconds = op.state.read_seconds
        self.operations.set_state(op, RestoreCommitting(read_seconds))
        try:
            await self._injected_delay("commit_restore")
            counts = await self.holders.fan(
                op.holders, "commit_restore",
                lambda inst, h: self._calls(h).commit_restore(restore_id),
                op_id=restore_id)
        except BaseException as exc:
            self._count_failure("restore", exc)
            await self._abort(op, Outcome.ABORTED)
            raise
        self.operations.set_state(op, Committed())
        self._metrics.observe("restore_duration", self._clock.monotonic() - op.started)
        self._metrics.observe("restore_read", read_seconds)
        return sum(counts.values())

    # --- ledger operations --------------------------------------------------------------

    async def retire(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Retire these attempts on every holder; returns the capture keys dropped."""
        return await self._ledger_op("retire", episodes)

    async def forget(self, episodes: list[EnvironmentEpisode]) -> list[str]:
        """Forget these attempts on every holder; returns the capture keys dropped."""
        return await self._ledger_op("forget", episodes)

    async def _ledger_op(self, what: str, episodes: list[EnvironmentEpisode]) -> list[str]:
        # RL retires an attempt per finished rollout: use the known holders, and pay for
        # a rediscovery only when there are none or one of them has gone.
        if not self.holders.handles:
            await self.holders.ensure()

        def call(inst: str, h: Actor) -> Any:
            calls = self._calls(h)
            return calls.retire(episodes) if what == "retire" else calls.forget(episodes)

        try:
            dropped = await self.holders.fan(self.holders.handles, what, call)
        except BackendUnavailableError:
            await self.holders.ensure()
            dropped = await self.holders.fan(self.holders.handles, what, call)
        return sorted(k for keys in dropped.values() for k in keys)

    # --- figures ------------------------------------------------------------------------

    def _record_commit(self, op: Operation, released: float, figures: dict[str, float],
                       captured: int, restarted: int) -> None:
        now = self._clock.monotonic()
        self._metrics.observe("snapshot_duration", now - op.started)
        # Holders pause at the start of begin_snapshot and are released as the commit
        # begins, so that span bounds their paused time.
        self._metrics.observe("paused", released - op.started)
        self._metrics.inc("bytes_written", figures.get("bytes_written", 0.0))
        self._metrics.inc("captured", float(captured))
        self._metrics.inc("restarted", float(restarted))

    def _count_failure(self, operation: str, error: BaseException | str) -> None:
        kind = error if isinstance(error, str) else type(error).__name__
        self._metrics.inc("failures", 1.0, tags={"operation": operation, "kind": kind})


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
