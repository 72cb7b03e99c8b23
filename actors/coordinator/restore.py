"""The coordinator's room of a restore: the steps of ``CoordinatorRestoreCalls`` that it
serves, in the order ``nemo_ckpt.protocol.coordinator_api.CoordinatorApi`` states once,
and the one room that calls the holders' restore steps
(``nemo_ckpt.protocol.holder_api.HolderRestoreCalls``):

    0) prefetch_restore  place every instance; every holder's ``prefetch_restore``
    2) prepare_restore   read the manifest, place every instance (the plan, pure:
                         ``actors.coordinator.restore_plan``); every holder's
                         ``prepare_restore``; what they read checked against the manifest
    3) commit_restore    every holder's ``commit_restore``, all or nothing

Step 1 (renewals) and an abort are every operation's, in ``actors.coordinator.lifecycle``.
"""

from __future__ import annotations

import asyncio

from actors.coordinator.lifecycle import OperationLifecycle
from actors.coordinator.parts import CoordinatorParts
from actors.coordinator.restore_plan import (
    assign_shards,
    conflict_error,
    holder_said,
    verify_prepared,
)
from actors.coordinator.states import (
    Committed,
    Operation,
    RestoreCommitting,
    RestoreOperation,
    RestorePreparing,
    RestoreVerified,
)
from nemo_ckpt import tracing
from nemo_ckpt.errors import CheckpointPathError, RestoreConflictError, StaleSnapshotError
from nemo_ckpt.phases import RestorePrepared, ShardRef
from nemo_ckpt.protocol.calls import call
from nemo_ckpt.protocol.coordinator_api import RestoreBegun
from nemo_ckpt.protocol.holder_api import HolderControl
from nemo_ckpt.protocol.operations import Outcome
from nemo_ckpt.shard_refs import shard_ref
from nemo_ckpt.storage.checkpoint_folder import environment_folder
from nemo_ckpt.storage.manifest import Manifest, rollouts_by_shard
from nemo_ckpt.storage.snapshot_files import read_manifest
from nemo_ckpt.trees.snapshot_trees import blob_store_of, moved_blob_store

__all__ = ["RestoreHolds", "Restores"]


class RestoreHolds:
    """What a restore holds beyond its holders: its read claim on the snapshot's folder,
    which renews itself (``actors.coordinator.read_claim.ReadClaim``). Released when it ends
    without committing (``actors.coordinator.lifecycle`` calls ``release``); its commit
    releases it too."""

    async def renew(self, op: Operation) -> None:
        del op  # the read claim renews itself while it stands

    async def release(self, op: Operation) -> None:
        assert isinstance(op, RestoreOperation)
        if op.read_claim is not None:
            await op.read_claim.release()


class Restores:
    """The restore phases of one coordinator."""

    def __init__(self, parts: CoordinatorParts, lifecycle: OperationLifecycle) -> None:
        self._parts = parts
        self._lifecycle = lifecycle
        self._runtime = parts.transport.runtime
        self._clock = self._runtime.clock
        self._metrics = self._runtime.metrics

    async def prepare_restore(self, restore_id: str, checkpoint_path: str, trace: str = ""
                              ) -> RestoreBegun:
        """Verify the snapshot and have each instance's holder load it, nothing live yet;
        a repeat of this first call is answered as the first was
        (``OperationTable.first_call``)."""
        return await self._parts.operations.first_call(
            restore_id, lambda: self._prepare_in_span(restore_id, checkpoint_path, trace))

    async def _prepare_in_span(self, restore_id: str, checkpoint_path: str, trace: str
                               ) -> RestoreBegun:
        with tracing.span("nemo_ckpt.restore.prepare", parent=trace, phase="prepare",
                          **{"operation.id": restore_id, "path": checkpoint_path}) as span:
            begun = await self._prepare(restore_id, checkpoint_path, trace)
            tracing.set_attributes(span, bytes=int(begun.bytes_read),
                                   sessions=len(begun.continued_attempts))
            return begun

    async def _prepare(self, restore_id: str, checkpoint_path: str, trace: str
                       ) -> RestoreBegun:
        now = self._clock.monotonic()
        op = self._lifecycle.open(RestoreOperation(restore_id, checkpoint_path, now,
                                         now + self._parts.config.lease_s, RestorePreparing()))
        op.trace = trace
        try:
            return await self._prepare_restore(op, checkpoint_path)
        except BaseException as exc:
            self._parts.count_failure("restore", exc)
            await self._lifecycle.end(op, Outcome.ABORTED)
            # An abort that ended the operation before its claim was made released
            # nothing: the claim this call made goes with it (simulation seed 9291).
            await RestoreHolds().release(op)
            raise

    async def _prepare_restore(self, op: RestoreOperation, checkpoint_path: str
                               ) -> RestoreBegun:
        manifest = await self._runtime.run_blocking(read_manifest, checkpoint_path)
        if op.outcome is not None:  # aborted while the manifest was read: claim nothing
            raise self._parts.operations.refusal(op.id)
        # Claimed until the restore ends (its commit or abort releases the claim), so
        # that no removal takes the files meanwhile, and a restore whose commit failed
        # can read them again. One that came between the read above and the claim leaves
        # shards missing: the holders' reads refuse them.
        op.read_claim = self._parts.folders.hold_for_reading(checkpoint_path, op.id)
        await op.read_claim.written()
        return await self._read_and_verify(op, checkpoint_path, manifest)

    async def _read_and_verify(self, op: Operation, checkpoint_path: str,
                               manifest: Manifest) -> RestoreBegun:
        cfg = self._parts.config
        if moved := await self._runtime.run_blocking(moved_blob_store, checkpoint_path,
                                                     manifest):
            raise CheckpointPathError(checkpoint_path, moved)
        placement = await self._parts.holders.place(list(manifest.instances))
        op.holders = self._parts.holders.handles
        if op.outcome is not None:
            raise self._parts.operations.refusal(op.id)
        directory = str(environment_folder(checkpoint_path))
        blob_store = blob_store_of(checkpoint_path, manifest)
        shards_of = assign_shards([shard_ref(s) for s in manifest.shards], op.holders,
                                  checkpoint_path)
        trace = tracing.traceparent()  # the holders' spans go under the prepare's

        def conflicts(errors: dict[str, BaseException]) -> BaseException | None:
            """One error naming every holder where sessions are live, and the fix."""
            live = {inst: [holder_said(inst, e)] for inst, e in errors.items()
                    if isinstance(e, RestoreConflictError)}
            return conflict_error(checkpoint_path, live) if live else None

        prepared: dict[str, RestorePrepared] = await self._parts.holders.fan(
            op.holders,
            lambda inst: call(HolderControl.prepare_restore, op.id, directory,
                              shards_of[inst], cfg.lease_s, blob_store, trace
                              ).within(cfg.persist_timeout_s),
            op_id=op.id, explain=conflicts)
        if op.outcome is not None:
            raise self._parts.operations.refusal(op.id)
        with tracing.span("nemo_ckpt.verify", phase="verify", **{"operation.id": op.id}):
            verified = verify_prepared(rollouts_by_shard(manifest), directory,
                                       checkpoint_path, prepared)
        self._parts.operations.set_state(op, RestoreVerified(verified.read_seconds))
        return RestoreBegun(
            restore_id=op.id, continued_attempts=verified.continued_attempts,
            staging_keys=verified.staging_keys, placement=placement,
            bytes_read=verified.bytes_read, read_seconds=verified.read_seconds,
            finished=verified.finished)

    async def prefetch_restore(self, checkpoint_path: str) -> int:
        """Place every instance of the snapshot at ``checkpoint_path`` and have each
        holder start reading and verifying its shards, so that a restore of it finds them
        read. Not an operation: nothing is claimed or installed, a holder that fails or
        dies only reads nothing ahead, and the restore reads (and checks) for itself
        whatever was not read ahead. Returns how many shard reads started."""
        manifest = await self._runtime.run_blocking(read_manifest, checkpoint_path)
        await self._parts.holders.place(list(manifest.instances))
        directory = str(environment_folder(checkpoint_path))
        holders = self._parts.holders.handles
        shards_of: dict[str, list[ShardRef]] = {}
        for shard in manifest.shards:
            if shard.instance_id in holders:
                shards_of.setdefault(shard.instance_id, []).append(shard_ref(shard))
        started = await asyncio.gather(*(
            self._parts.calls(holders[inst]).prefetch_restore(directory, shards)
            for inst, shards in shards_of.items()), return_exceptions=True)
        return sum(n for n in started if isinstance(n, int))

    async def commit_restore(self, restore_id: str) -> int:
        """Make every restored session live. Returns how many. If any holder fails, the
        ones that went live drop the restored sessions again (all or nothing)."""
        op = self._parts.operations.get(restore_id)
        if op is None:
            if self._parts.operations.outcome(restore_id) is Outcome.COMMITTED:
                return 0
            raise self._parts.operations.refusal(restore_id)
        if op.committing:
            await op.closed.wait()
            return await self.commit_restore(restore_id)
        if not isinstance(op.state, RestoreVerified):
            raise StaleSnapshotError(f"commit of {restore_id} before its prepare finished")
        with tracing.span("nemo_ckpt.restore.commit", parent=op.trace, phase="commit",
                          **{"operation.id": restore_id}):
            return await self._commit(op, restore_id)

    async def _commit(self, op: Operation, restore_id: str) -> int:
        assert isinstance(op.state, RestoreVerified)
        read_seconds = op.state.read_seconds
        self._parts.operations.set_state(op, RestoreCommitting(read_seconds))
        try:
            await self._runtime.reached("commit_restore")
            counts: dict[str, int] = await self._parts.holders.fan(
                op.holders, call(HolderControl.commit_restore, restore_id), op_id=restore_id)
        except BaseException as exc:
            self._parts.count_failure("restore", exc)
            await self._lifecycle.end(op, Outcome.ABORTED)
            raise
        self._parts.operations.set_state(op, Committed())
        if isinstance(op, RestoreOperation) and op.read_claim is not None:
            await op.read_claim.release()
        self._metrics.observe("restore_duration", self._clock.monotonic() - op.started)
        self._metrics.observe("restore_read", read_seconds)
        return sum(counts.values())
