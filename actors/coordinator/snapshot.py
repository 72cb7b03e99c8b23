"""The coordinator's room of a snapshot: the steps of ``CoordinatorSnapshotCalls`` that it
serves, in the order ``nemo_ckpt.protocol.coordinator_api.CoordinatorApi`` states once,
and the one room that calls the holders' snapshot steps
(``nemo_ckpt.protocol.holder_api.HolderSnapshotCalls``):

    2) begin_snapshot   claim the path; every holder's ``begin_snapshot``
    3) start_writes     every holder's ``start_writes``
    4) commit_snapshot  every holder's ``release`` (unless stopping) and ``finish_writes``;
                        the manifest written last (its number from
                        ``nemo_ckpt.storage.commit_sequence``); every holder's
                        ``commit_snapshot``; the replaced files removed

Step 1 (renewals) and an abort are every operation's, in ``actors.coordinator.lifecycle``;
a snapshot's undo (``SnapshotHolds``) lives here. The states a snapshot passes through:
``actors.coordinator.states``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from datetime import datetime, timezone
from typing import Any

from actors.coordinator.lifecycle import OperationLifecycle
from actors.coordinator.parts import CoordinatorParts
from actors.coordinator.states import (
    Committed,
    FoundCommitted,
    Operation,
    SnapshotBeginning,
    SnapshotCaptured,
    SnapshotCommitting,
    SnapshotOperation,
    SnapshotWriting,
)
from nemo_ckpt import tracing
from nemo_ckpt.errors import LeaseExpiredError, NemoCkptError, StaleSnapshotError
from nemo_ckpt.phases import CaptureReport, PauseReport, PersistReport, ShardRef
from nemo_ckpt.protocol.calls import call
from nemo_ckpt.protocol.coordinator_api import SnapshotBegun, SnapshotCommitted
from nemo_ckpt.protocol.holder_api import HolderControl
from nemo_ckpt.protocol.operations import Outcome
from nemo_ckpt.shard_refs import shard_entry
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.cleanup import remove_snapshot_files
from nemo_ckpt.storage.commit_sequence import sequence_root, take_sequence
from nemo_ckpt.storage.manifest import encode_manifest
from nemo_ckpt.storage.snapshot_files import write_manifest
from nemo_ckpt.transport import Actor
from nemo_ckpt.trees.snapshot_trees import blob_store_ref

__all__ = ["SnapshotHolds", "Snapshots"]

log = logging.getLogger("nemo_ckpt.coordinator")



class SnapshotHolds:
    """What a snapshot holds beyond its holders: its path's claim, its hold on the blob
    store, its files. Renewed with its lease (``renew``), released when it ends without
    committing (``release``; ``actors.coordinator.lifecycle`` calls both)."""

    def __init__(self, parts: CoordinatorParts) -> None:
        self._parts = parts
        self._runtime = parts.transport.runtime

    async def renew(self, op: Operation) -> None:
        """With the lease: the path's claim and the blob store's hold, once captured.
        A failed write is left to the commit, which writes them again first."""
        assert isinstance(op, SnapshotOperation)
        if op.captured is None or op.outcome is not None:
            return
        renewing_hold = op.blob_hold is not None and op.blob_hold.done()
        try:
            await self._parts.folders.claim(op)
            if renewing_hold:
                await self.hold_blobs(op)
        except (OSError, NemoCkptError) as exc:
            log.warning("%s: could not renew its claims (%s); they stand until their "
                        "ttl, and the commit writes them again first", op.id, exc)
        if renewing_hold and op.outcome is not None:
            # It ended while the hold was written (which may have landed and raised): the
            # end's release may have come first (simulation seed 2999); no hold may
            # outlive its snapshot.
            await self._parts.blobs.release(op.id)

    async def hold_blobs(self, op: SnapshotOperation, first: bool = False) -> None:
        """Hold the blob store for the snapshot (or renew the hold): it relies on the
        blobs there until it commits, so no collection may run meanwhile."""
        held_at = await self._parts.blobs.hold(op.id, self._parts.claim_ttl, first)
        if held_at is not None:
            op.held_at = held_at

    async def release(self, op: Operation) -> None:
        """The snapshot was aborted or lapsed: its hold and its files go. Its files may
        show that its commit won after all (the manifest was renamed into place before a
        step failed, or before the coordinator that wrote it died): then it is
        committed."""
        assert isinstance(op, SnapshotOperation)
        if op.blob_hold is not None:
            if not op.blob_hold.done():
                await asyncio.wait([op.blob_hold])  # its put must not land after the release
            self._parts.blobs.garbage_possible()  # its holders may have written blobs
            await self._parts.blobs.release(op.id)
        if op.path is None:
            return
        if op.claiming is not None and not op.claiming.done():
            # An abort that overtook the begin (a coordinator that hung, then ran both):
            # the claim's put must land before the files are removed, not after.
            await asyncio.wait([op.claiming])
        try:
            committed = await self._runtime.run_blocking(
                remove_snapshot_files, environment_folder(op.path), op.id)
        except (OSError, NemoCkptError) as exc:
            log.warning("could not remove the files of %s: %s", op.id, exc)
            return
        if committed:
            self._parts.operations.set_state(op, FoundCommitted())

class Snapshots:
    """The snapshot phases of one coordinator."""

    def __init__(self, parts: CoordinatorParts, lifecycle: OperationLifecycle,
                 holds: SnapshotHolds, incarnation: str) -> None:
        self._parts = parts
        self._lifecycle = lifecycle
        self._holds = holds
        self._incarnation = incarnation  # the coordinator's: names its holder sets
        self._runtime = parts.transport.runtime
        self._clock = self._runtime.clock
        self._metrics = self._runtime.metrics
        self._captures_done = 0
        self._background: set[asyncio.Future[Any]] = set()  # kept so they are not collected
        # The holders the last snapshot paused, and the name of that set (``holder_set``).
        self._paused_set: list[tuple[str, Any]] = []
        self._sets = 0

    async def begin_snapshot(self, snapshot_id: str, checkpoint_path: str,
                             drain_timeout_s: float | None = None, trace: str = "",
                             stop: bool = False) -> SnapshotBegun:
        """Claim the path, pause every holder and capture; a repeat of this first call
        is answered as the first was (``OperationTable.first_call``)."""
        return await self._parts.operations.first_call(
            snapshot_id, lambda: self._begin_in_span(snapshot_id, checkpoint_path,
                                                     drain_timeout_s, trace, stop))

    async def _begin_in_span(self, snapshot_id: str, checkpoint_path: str,
                             drain_timeout_s: float | None, trace: str, stop: bool
                             ) -> SnapshotBegun:
        """``_begin`` in its span, the child of the driver's ``trace``."""
        with tracing.span("nemo_ckpt.snapshot.begin", parent=trace, phase="begin",
                          **{"operation.id": snapshot_id, "path": checkpoint_path}) as span:
            begun = await self._begin(snapshot_id, checkpoint_path, drain_timeout_s, trace,
                                      stop)
            tracing.set_attributes(span, sessions=sum(c.captured_count
                                                      for c in begun.captures))
            return begun

    async def _begin(self, snapshot_id: str, checkpoint_path: str,
                     drain_timeout_s: float | None, trace: str, stop: bool) -> SnapshotBegun:
        """Claim the path, pause every holder and capture, waiting up to
        ``drain_timeout_s`` (default: the config's) for turns in flight; a ``stop``
        snapshot captures the sessions still mid-turn too (``SnapshotPhases.capture``).

        This is the pause's hot path: the holder set is the one known since the last
        discovery, re-discovered only when the alive nodes changed, and each holder
        pauses and captures in one call (``SessionHolder.begin``). The writes start at
        ``start_writes``, which the driver sends once it has this answer (benchmarks/
        README.md says what starting them earlier cost the answer). ``finish_writes``
        starts any write whose start message has not arrived.
        """
        now = self._clock.monotonic()
        op = self._lifecycle.open(SnapshotOperation(snapshot_id, checkpoint_path, now,
                                          now + self._parts.config.lease_s, SnapshotBeginning()))
        op.trace = trace
        cfg = self._parts.config
        drain = cfg.drain_timeout_s if drain_timeout_s is None \
            else max(0.0, min(float(drain_timeout_s), cfg.drain_timeout_s))
        claimed: asyncio.Future[None] | None = None
        try:
            op.holders = await self._parts.holders.known()
            directory = environment_folder(checkpoint_path)
            if self._parts.blobs.store is not None:
                assert cfg.checkpoint_root is not None  # the config requires it
                op.blob_ref = blob_store_ref(cfg.checkpoint_root, checkpoint_path)
            await self._runtime.reached("begin_snapshot")
            if op.outcome is not None:  # aborted before any holder was asked: ask none
                raise self._parts.operations.refusal(snapshot_id)
            # The claim runs beside the pause, not before it: no shard is written before
            # the claim holds (writes start after this returns), and on a bucket its
            # list, reads and put would otherwise add round trips to every pause. A
            # refused claim aborts the snapshot like any failure here: holders resume.
            claimed = op.claiming = asyncio.ensure_future(self._prepare_and_claim(op))
            claimed.add_done_callback(lambda f: f.cancelled() or f.exception())
            if self._parts.blobs.store is not None:
                # Not awaited here: no holder relies on the store before it holds (the
                # writes start after it, and the commit awaits it), and its file work
                # would otherwise lengthen every pause.
                op.blob_hold = asyncio.ensure_future(self._holds.hold_blobs(op, first=True))
                op.blob_hold.add_done_callback(lambda f: f.cancelled() or f.exception())
            begun: dict[str, tuple[PauseReport, CaptureReport]] = await self._parts.holders.fan(
                op.holders,
                call(HolderControl.begin_snapshot, snapshot_id, drain, cfg.lease_s,
                     str(directory), tracing.traceparent(), stop
                     ).within(drain + cfg.phase_timeout_s),
                op_id=snapshot_id)
            # Shielded: a cancelled begin must not cancel the claim under its thread,
            # whose put would then land after the abort's clean-up.
            await asyncio.shield(claimed)
            if op.outcome is not None:  # aborted meanwhile: its abort reached every holder
                raise self._parts.operations.refusal(snapshot_id)
        except BaseException as exc:
            if claimed is not None and not claimed.done():
                # Its thread runs on; the abort's clean-up must not race its put.
                await asyncio.wait([claimed])
            if claimed is not None and claimed.done() and not claimed.cancelled():
                claimed.exception()  # retrieved: the first error is the one raised
            self._parts.count_failure("snapshot", exc)
            await self._lifecycle.end(op, Outcome.ABORTED)
            raise
        self._captures_done += 1
        captured = SnapshotCaptured(tuple(c for _, c in begun.values()), self._captures_done)
        self._parts.operations.set_state(op, captured)
        return SnapshotBegun(
            snapshot_id=snapshot_id, instances=tuple(op.holders),
            pauses=tuple(p for p, _ in begun.values()), captures=captured.captures,
            entry_seconds=self._clock.monotonic() - op.started,
            holder_set=self._holder_set(op.holders))

    def _holder_set(self, holders: dict[str, Actor]) -> str:
        """A new name whenever the holders differ from the last snapshot's, by instance
        or by incarnation (a handle's ``ref`` compares equal only for the same actor);
        it carries this coordinator's incarnation, so a successor's names are new too."""
        refs = [(inst, handle.ref) for inst, handle in holders.items()]
        if not self._sets or refs != self._paused_set:
            self._paused_set = refs
            self._sets += 1
        return f"{self._incarnation}.{self._sets}"

    async def _prepare_and_claim(self, op: SnapshotOperation) -> None:
        assert op.path is not None
        await self._runtime.run_blocking(environment_folder(op.path).prepare)
        await self._parts.folders.claim(op)

    async def _claims_hold(self, op: SnapshotOperation) -> None:
        """Before the manifest: the path's claim and the store's hold must not have
        lapsed since they were last written (their renewals may have failed). A claim
        near its end is written again (refused if another job took the path meanwhile);
        a hold that may have lapsed refuses the commit, since a collection may have
        removed blobs the snapshot found present."""
        if self._parts.folders.stale(op.claimed_at):
            await self._parts.folders.claim(op)
        if op.blob_hold is not None and self._parts.folders.stale(op.held_at):
            raise LeaseExpiredError(
                f"{op.id}: its hold on the blob store could not be renewed for too long "
                f"(a full or failing disk?), so a collection may have removed blobs it "
                f"relies on; it was not committed: retry the snapshot")

    async def start_writes(self, snapshot_id: str) -> None:
        """Start every holder's write of the snapshot; waits for none. Never raises:
        whatever fails here fails the commit (``finish_writes`` starts a write that did
        not start)."""
        op = self._parts.operations.get(snapshot_id)
        if not isinstance(op, SnapshotOperation) or type(op.state) is not SnapshotCaptured:
            return
        assert isinstance(op.state, SnapshotCaptured)
        self._parts.operations.set_state(op, SnapshotWriting(op.state.captures, op.state.order))
        if op.blob_hold is not None and not op.blob_hold.done():
            hold = op.blob_hold

            async def after_hold() -> None:
                with contextlib.suppress(Exception):  # its error fails the commit
                    await asyncio.shield(hold)
                    if op.outcome is None:
                        self._parts.holders.send(
                            op.holders, call(HolderControl.start_writes, snapshot_id))

            task = asyncio.ensure_future(after_hold())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return
        self._parts.holders.send(op.holders, call(HolderControl.start_writes, snapshot_id))

    async def commit_snapshot(self, snapshot_id: str, checkpoint_path: str,
                              metrics: dict[str, float | int], restarted: int,
                              stop: bool = False) -> SnapshotCommitted:
        """Wait for every shard, write the manifest last, then resume every holder.

        With ``stop`` (a job told to stop), the holders are not released before the
        manifest is durable, and then park the sessions instead of resuming: they drop
        them, free their sandboxes and refuse new turns (``SnapshotPhases.commit_snapshot``).

        A repeated commit gets the first one's answer; a commit of an operation that
        was aborted (or lapsed) is refused with that outcome's error."""
        op = self._parts.operations.get(snapshot_id)
        with tracing.span("nemo_ckpt.commit", parent="" if op is None else op.trace,
                          phase="commit", stop=stop, **{"operation.id": snapshot_id}) as span:
            committed = await self._commit(snapshot_id, checkpoint_path, metrics, restarted,
                                           stop)
            tracing.set_attributes(span, bytes=int(committed.metrics.get("bytes_written", 0)),
                                   sessions=committed.rollouts)
            return committed

    async def _commit(self, snapshot_id: str, checkpoint_path: str,
                      metrics: dict[str, float | int], restarted: int,
                      stop: bool) -> SnapshotCommitted:
        op = self._parts.operations.get(snapshot_id)
        if op is None:
            result = self._parts.operations.result(snapshot_id)
            if isinstance(result, SnapshotCommitted):
                return result
            raise self._parts.operations.refusal(snapshot_id)
        if op.committing:
            await op.closed.wait()
            return await self.commit_snapshot(snapshot_id, checkpoint_path, metrics,
                                              restarted, stop)
        if not isinstance(op, SnapshotOperation) or op.captured is None:
            raise StaleSnapshotError(f"commit of {snapshot_id} before its begin finished")
        captured = op.captured
        committing, unique = self._release(op, captured, snapshot_id, stop)
        directory = environment_folder(checkpoint_path)
        try:
            await self._runtime.reached("commit_snapshot")
            if op.blob_hold is not None:  # no holder relies on the store before it holds
                await asyncio.shield(op.blob_hold)
            persists: dict[str, PersistReport] = await self._parts.holders.fan(
                op.holders, call(HolderControl.finish_writes, snapshot_id
                                 ).within(self._parts.config.persist_timeout_s),
                op_id=snapshot_id)
            shards: list[ShardRef] = [s for p in persists.values() for s in p.shards]
            all_metrics = _commit_metrics(metrics, persists)
            rollouts = await unique
            await self._earlier_commits(op, captured.order)
            root = self._parts.config.checkpoint_root
            sequence = await self._runtime.run_blocking(take_sequence, sequence_root(
                None if root is None else str(root), checkpoint_path))
            manifest = self._manifest(snapshot_id, op, shards, restarted, all_metrics,
                                      sequence)
            await self._runtime.reached("before_manifest")
            await self._claims_hold(op)
            async with self._parts.folders.lock(checkpoint_path):
                # Fenced: a successor that took this incarnation for dead and aborted the
                # snapshot removed its claim (``write_manifest`` checks in the same call).
                # The beats as they are when it checks, not a copy taken now: a renewal
                # that runs meanwhile adds its beat before its write (simulation seed
                # 1691 with holders created at once: its claim was refused as another's).
                await self._runtime.run_blocking(write_manifest, directory, manifest,
                                                 (op.id, op.claim_beats))
            await self._runtime.reached("after_manifest")
        except BaseException as exc:
            self._parts.count_failure("snapshot", exc)
            await self._lifecycle.end(op, Outcome.ABORTED)
            if not isinstance(op.state, FoundCommitted):
                raise
            # Only the manifest's write can fail after its rename (the folder's fsync):
            # the manifest names this snapshot, so it is committed, and final.
            log.warning("commit of %s raised after its manifest was renamed into place "
                        "(%s); it is committed", snapshot_id, exc)
        else:
            self._parts.operations.set_state(op, Committed())
        self._record_commit(op, committing.released, all_metrics, rollouts, restarted)
        # Committed: resume first; the older snapshots' files are garbage from here on
        # and their removal must not lengthen the pause.
        await self._parts.holders.fan(
            op.holders, call(HolderControl.commit_snapshot, snapshot_id, stop),
            tolerate_failures=True)
        removed = await self._parts.folders.clean_up(
            op, [o.id for o in self._parts.operations.open_ones()])
        await self._parts.blobs.release(op.id)
        if removed:  # an older snapshot's files went: its blobs may be garbage now
            self._parts.blobs.garbage_possible()
        # A bounded round before the answer, while no snapshot of this driver holds the
        # store (issue 56); the rest in the background.
        await self._parts.blobs.collect_round(checkpoint_path,
                                              self._parts.config.phase_timeout_s / 2)
        self._parts.blobs.start()
        result = SnapshotCommitted(metrics=all_metrics, rollouts=rollouts,
                                   shards=len(shards), removed_files=tuple(removed))
        self._parts.operations.keep_result(snapshot_id, result)
        return result

    def _release(self, op: SnapshotOperation, captured: SnapshotCaptured, snapshot_id: str,
                 stop: bool) -> tuple[SnapshotCommitting, asyncio.Future[int]]:
        """Resume the holders' backends (not for a stop) and start the check that no
        rollout was captured twice: ``op`` is committing from here. Its state, and the
        check to await."""
        # The backend resumes as the exit begins: the capture is an immutable copy, so
        # turns may run while the shards are written; the commit still waits for every
        # shard and the manifest, and a failure still aborts the snapshot. A stop keeps
        # the gate closed: no turn may run that the parked sessions would not hold.
        if not stop:
            self._parts.holders.send(op.holders, call(HolderControl.release, snapshot_id))
        # The check that no rollout was captured by two instances starts now, after the
        # release went out: a thread that decodes every capture holds this process's
        # GIL meanwhile. Its error is raised by commit's await on it; an abort cancels it.
        unique = asyncio.ensure_future(self._runtime.run_blocking(
            _check_captured_once, captured.captures))
        unique.add_done_callback(lambda f: f.cancelled() or f.exception())
        committing = SnapshotCommitting(captured.captures, captured.order,
                                        released=self._clock.monotonic(),
                                        unique_check=unique)
        self._parts.operations.set_state(op, committing)
        return committing, unique

    def _manifest(self, snapshot_id: str, op: SnapshotOperation, shards: list[ShardRef],
                  restarted: int, metrics: dict[str, float | int], sequence: int) -> bytes:
        """The manifest of snapshot ``op``, stamped with the wall clock now."""
        return encode_manifest(
            snapshot_id=snapshot_id,
            created_at=datetime.fromtimestamp(self._clock.wall(), timezone.utc),
            instances=list(op.holders), shards=[shard_entry(s) for s in shards],
            restarted_rollouts=restarted, metrics=metrics, blob_store=op.blob_ref,
            sequence=sequence)

    async def _earlier_commits(self, op: SnapshotOperation, order: int) -> None:
        """Wait until every snapshot into the same folder captured before ``op`` has
        ended. Holders resume as a commit begins, so a second snapshot can capture and
        commit while the first still writes: its manifest must not be replaced by the
        older one's. An earlier snapshot whose driver is gone ends at its lease."""
        assert op.path is not None
        directory = environment_folder(op.path)
        while True:
            earlier = [o for o in self._parts.operations.open_ones()
                       if isinstance(o, SnapshotOperation) and o is not op
                       and o.captured is not None and o.captured.order < order
                       and o.path is not None and environment_folder(o.path) == directory]
            if not earlier:
                return
            await earlier[0].closed.wait()


    def _record_commit(self, op: Operation, released: float, figures: dict[str, float | int],
                       captured: int, restarted: int) -> None:
        now = self._clock.monotonic()
        self._metrics.observe("snapshot_duration", now - op.started)
        # Holders pause at the start of begin_snapshot and are released as the commit
        # begins, so that span bounds their paused time.
        self._metrics.observe("paused", released - op.started)
        self._metrics.inc("bytes_written", figures.get("bytes_written", 0))
        self._metrics.inc("captured", float(captured))
        self._metrics.inc("restarted", float(restarted))


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


def _commit_metrics(metrics: dict[str, float | int], persists: dict[str, PersistReport]
                    ) -> dict[str, float | int]:
    """The driver's ``metrics`` with the slowest shard write and the bytes written."""
    all_metrics = dict(metrics)
    all_metrics.update(
        persist_seconds=max((p.persist_seconds for p in persists.values()), default=0.0),
        bytes_written=sum(p.bytes_written for p in persists.values()),
    )
    return all_metrics
