"""The holder's room of a restore: the steps of ``HolderRestoreCalls`` that it serves,
in the order ``nemo_ckpt.protocol.holder_api.HolderControl`` states once:

    0) prefetch_restore  shards read ahead of a restore to come
    1) prepare_restore   this instance's shards read and verified (``actors.holder.shards``)
                         and their sandboxes staged (``actors.holder.sandbox_restores``);
                         nothing live yet
    3) commit_restore    the sessions made live

Step 2 (the lease renewed) and an abort are every operation's, in
``actors.holder.operations``; a restore's undo (``RestoreUndo``) lives here. The states a
restore passes through: ``actors.holder.states``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgpack

from actors.holder.operations import HolderOperations
from actors.holder.parts import HolderParts
from actors.holder.sandbox_restores import RestoredSandbox
from actors.holder.session_table import Held
from actors.holder.shards import ShardPrefetch, read_restore_shard
from actors.holder.states import (
    OperationState,
    RestoreLive,
    RestoreLoading,
    RestoreWork,
)
from nemo_ckpt import tracing
from nemo_ckpt.errors import HolderStateError, RestoreConflictError
from nemo_ckpt.phases import RestorePrepared, ShardRef
from nemo_ckpt.protocol.operations import Outcome
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.folder import Folder

__all__ = ["RestorePhases", "RestoreUndo"]

log = logging.getLogger("nemo_ckpt.holder")


@dataclass
class _Read:
    """What a restore's shards held, gathered shard by shard."""

    pending: list[Held] = field(default_factory=list)
    finished: list[list[object]] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    shard_sessions: list[tuple[str, bytes]] = field(default_factory=list)


class RestoreUndo:
    """What a restore leaves behind when it ends without committing
    (``actors.holder.operations.HolderOperations.end`` calls ``undo``): the directories it
    staged, or the sessions a commit made live here but no turn used yet."""

    def __init__(self, parts: HolderParts) -> None:
        self._parts = parts

    def undo(self, op_id: str, old: OperationState) -> None:
        if isinstance(old, RestoreLoading):
            self._discard(old.work)
        elif isinstance(old, RestoreLive):
            self._drop_live(op_id, old)

    def _discard(self, work: RestoreWork) -> None:
        """A restore that will not go live: its staged directories go (in the background:
        nothing refers to them), their blobs may leave the cache."""
        sandboxes = self._parts.sandboxes
        discard_staged(self._parts, work.sandboxes)
        if work.sandboxes or sandboxes.root is not None:
            self._parts.background(sandboxes.restores.discard_staging, work.id)

    def _drop_live(self, restore_id: str, live: RestoreLive) -> None:
        """Drop the sessions a committed restore made live (see ``RestoreLive``)."""
        parts = self._parts
        for rollout_id in live.rollouts:
            parts.table.drop(rollout_id)
            parts.sandboxes.drop(rollout_id)
        if live.directories:
            parts.sandboxes.restores.doom(live.directories)
            parts.background(parts.sandboxes.restores.remove_doomed)
        log.warning("%s: restore %s, live here but not used yet, was undone: its %d "
                    "sessions were dropped again", parts.instance_id, restore_id,
                    len(live.rollouts))


def discard_staged(parts: HolderParts, staged: list[RestoredSandbox]) -> None:
    """Sandboxes a restore made that will not go live: their blobs may leave the cache,
    and its containers are removed (in the background); directories go with the
    restore's staging folder."""
    sandboxes = parts.sandboxes
    sandboxes.restores.forget_restore(staged)
    made = [b.target for b in staged if b.staging is None]  # containers
    if made:
        sandboxes.restores.doom(made)
        parts.background(sandboxes.restores.remove_doomed)


class RestorePhases:
    """The restore phases of one holder."""

    def __init__(self, parts: HolderParts, operations: HolderOperations) -> None:
        self._parts = parts
        self._operations = operations
        self.instance_id = parts.instance_id
        self._runtime = parts.runtime
        self._clock = parts.clock
        # Shards read ahead of a restore the driver announced (``prefetch_restore``).
        self._prefetch = ShardPrefetch(parts.runtime)

    async def prefetch_restore(self, where: str, shards: list[ShardRef]) -> int:
        """Start reading and verifying ``shards`` of snapshot folder ``where`` for a restore
        to come, replacing any earlier prefetch; returns how many reads started. Nothing
        is installed: a restore of exactly these shard entries takes the reads, and a
        restore of anything else drops them."""
        if any(entry.instance_id != self.instance_id for entry in shards):
            raise HolderStateError(f"{self.instance_id}: asked to prefetch shards of "
                                   f"another instance")
        return self._prefetch.start(folder_at(where), where, shards)

    async def prepare_restore(
        self, restore_id: str, where: str, shards: list[ShardRef], lease_s: float,
        blob_store: str | None = None, trace: str = "",
    ) -> RestorePrepared:
        """``_prepare_restore`` in its span, under the coordinator's ``trace``."""
        with tracing.span("nemo_ckpt.prepare", parent=trace, phase="prepare",
                          instance=self.instance_id, **{"operation.id": restore_id}) as span:
            prepared = await self._prepare_restore(restore_id, where, shards, lease_s,
                                                   blob_store, trace)
            tracing.set_attributes(span, bytes=prepared.bytes_read)
            return prepared

    async def _prepare_restore(
        self, restore_id: str, where: str, shards: list[ShardRef], lease_s: float,
        blob_store: str | None, trace: str,
    ) -> RestorePrepared:
        """Read and verify this instance's shards, and materialize their sessions'
        directories (from ``blob_store``) in a staging folder; nothing goes live until
        commit. Repeating it waits for and returns the first call's result."""
        parts = self._parts
        state = parts.ops.get(restore_id)
        if isinstance(state, RestoreLoading):
            return await asyncio.shield(state.work.prepared)
        self._operations.admit(restore_id, f"restore {restore_id}", restore=True)
        op = RestoreWork(restore_id, trace=trace)
        parts.set_state(restore_id, RestoreLoading(op, self._clock.monotonic() + lease_s))
        try:
            await parts.runtime.reached("prepare_restore")
            directory = folder_at(where)
            started = self._clock.monotonic()
            read = await self._read(op, directory, where, shards, blob_store)
            loaded = self._clock.monotonic()
            conflicts = sorted(h.rollout_id for h in read.pending
                               if parts.table.of_rollout(h.rollout_id) is not None)
            if conflicts:
                raise RestoreConflictError(
                    f"{self.instance_id}: cannot restore rollouts {conflicts[:10]}"
                    f"{' ...' if len(conflicts) > 10 else ''}: sessions of them are live "
                    f"here; retire or close them first, or restore into a fresh job")
            op = parts.current_restore(restore_id)
            op.pending = read.pending
            prepared = RestorePrepared(
                instance_id=self.instance_id,
                staging_keys=frozenset(read.keys),
                bytes_read=sum(entry.bytes for entry in shards),
                read_seconds=loaded - started,
                shard_sessions=tuple(read.shard_sessions),
                live_rollouts=msgpack.packb(parts.table.rollouts(), use_bin_type=True),
                finished=msgpack.packb(read.finished, use_bin_type=True),
            )
            op.prepared.set_result(prepared)
            return prepared
        except BaseException as exc:
            if not op.prepared.done():
                op.prepared.set_exception(exc)
                op.prepared.exception()  # retrieved here; a repeat call re-raises it
            if parts.restore_open(op):
                self._operations.end(restore_id, Outcome.ABORTED)
            raise

    async def _read(self, op: RestoreWork, directory: Folder, where: str,
                    shards: list[ShardRef], blob_store: str | None) -> _Read:
        """Read and verify each shard, taking a prefetched read when there is one, and
        stage its sandboxes (recorded on ``op`` as they are, for a discard)."""
        parts = self._parts
        read = _Read()
        ahead = [self._prefetch.take(where, entry) for entry in shards]
        self._prefetch.discard()  # read ahead for another snapshot: never used
        for entry, early in zip(shards, ahead, strict=True):
            shard = await read_restore_shard(
                self._runtime, parts.sandboxes, self.instance_id, op.id,
                directory, entry, blob_store,
                lambda: parts.current_restore(op.id), early)
            op.sandboxes += shard.sandboxes
            if not parts.restore_open(op):  # ended while they were made: its undo ran
                discard_staged(parts, shard.sandboxes)  # before they were on ``op``
            parts.current_restore(op.id)  # ended while materializing?
            read.pending += shard.held
            read.finished += shard.finished
            read.keys |= shard.staging_keys
            read.shard_sessions.append((entry.file, shard.sessions_msgpack))
        return read

    async def commit_restore(self, restore_id: str) -> int:
        """Make the restored sessions live and resume. Returns how many went live."""
        state = self._parts.ops.get(restore_id)
        with tracing.span("nemo_ckpt.install", phase="install", instance=self.instance_id,
                          parent=state.work.trace if isinstance(state, RestoreLoading) else "",
                          **{"operation.id": restore_id}) as span:
            live = await self._commit_restore(restore_id)
            tracing.set_attributes(span, sessions=live)
            return live

    async def _commit_restore(self, restore_id: str) -> int:
        parts = self._parts
        state = parts.ops.get(restore_id)
        if not isinstance(state, RestoreLoading):
            if parts.ops.outcome(restore_id) is Outcome.COMMITTED:
                return 0
            raise parts.refusal(restore_id)
        op = state.work
        if not op.prepared.done() or op.prepared.exception() is not None:
            raise HolderStateError(
                f"{self.instance_id}: commit of restore {restore_id} before it was prepared")
        await parts.runtime.reached("commit_restore")
        op = parts.current_restore(restore_id)
        for held in op.pending:
            if parts.table.of_rollout(held.rollout_id) is not None:
                raise RestoreConflictError(
                    f"{self.instance_id}: rollout {held.rollout_id!r} went live during the "
                    f"restore")
        if op.sandboxes:
            await self._runtime.run_blocking(parts.sandboxes.restores.commit_restore, op.sandboxes)
            if not parts.restore_open(op):  # aborted or lapsed while they moved
                parts.sandboxes.restores.doom(b.target for b in op.sandboxes)
                parts.background(parts.sandboxes.restores.remove_doomed)
                raise parts.refusal(restore_id)
        for held in op.pending:
            parts.table.put(held)
        parts.parked_by = None  # a stopped job's sessions are back: turns run again
        for box in op.sandboxes:
            parts.sandboxes.install(box.rollout_id, box.target, box.recorded)
        parts.set_state(restore_id, RestoreLive(tuple(h.rollout_id for h in op.pending),
                                                tuple(b.target for b in op.sandboxes)))
        parts.heap.request()
        if parts.sandboxes.provided_rollouts and op.sandboxes:  # a provider's, before
            keys = {h.rollout_id: h.capture_key for h in op.pending}
            await self._runtime.run_blocking(parts.sandboxes.mark_restored, [
                (b.rollout_id, keys[b.rollout_id], b.target) for b in op.sandboxes
                if b.rollout_id in keys])
        return len(op.pending)
