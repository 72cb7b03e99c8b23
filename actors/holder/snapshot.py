"""The holder's room of a snapshot: the steps of ``HolderSnapshotCalls`` that it serves,
in the order ``nemo_ckpt.protocol.holder_api.HolderControl`` states once:

    1) begin_snapshot   pause (close the gate, drain, take a lease) and capture, one call
    2) start_writes     the shard written in the background (``actors.holder.shards``)
    4) release          the gate opened while the shard is written
    5) finish_writes    the shard durable: its manifest entry
    6) commit_snapshot  the manifest written: the snapshot ends (or, stopping, parks)

Step 3 (the lease renewed) and an abort are every operation's, in
``actors.holder.operations``. A shard whose snapshot ended while it was written removes
itself (``_persist``). The states a snapshot passes through: ``actors.holder.states``.
"""

from __future__ import annotations

import asyncio
import logging

from actors.holder.operations import HolderOperations
from actors.holder.parts import HolderParts
from actors.holder.shards import write_capture
from actors.holder.states import (
    Capture,
    Ended,
    SnapshotPaused,
    SnapshotReleased,
    SnapshotWork,
)
from nemo_ckpt import tracing
from nemo_ckpt.errors import HolderStateError
from nemo_ckpt.phases import CaptureReport, PauseReport, PersistReport, ShardRef, join_captured
from nemo_ckpt.protocol.operations import Outcome
from nemo_ckpt.sandbox_backend import ContainerRef
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.cleanup import remove_files
from nemo_ckpt.storage.folder import Folder

__all__ = ["SnapshotPhases"]

log = logging.getLogger("nemo_ckpt.holder")


class SnapshotPhases:
    """The snapshot phases of one holder, and the end of any of its operations."""

    def __init__(self, parts: HolderParts, operations: HolderOperations) -> None:
        self._parts = parts
        self._operations = operations
        self.instance_id = parts.instance_id
        self._runtime = parts.runtime
        self._clock = parts.clock
        self._metrics = parts.runtime.metrics

    async def pause(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                    directory: str | None = None) -> PauseReport:
        """Close the turn gate, drain turns in flight up to the deadline, take a lease.
        Repeating it returns the first report."""
        parts = self._parts
        state = parts.ops.get(snapshot_id)
        if isinstance(state, SnapshotPaused):
            op = state.work
        else:
            self._operations.admit(snapshot_id, f"pause for snapshot {snapshot_id}")
            op = SnapshotWork(snapshot_id, folder_at(directory or "."))
            parts.set_state(snapshot_id,
                            SnapshotPaused(op, self._clock.monotonic() + lease_s))
        if op.pause is not None:
            return op.pause
        start = self._clock.monotonic()
        await parts.runtime.reached("pause")
        with tracing.span("nemo_ckpt.drain", phase="drain", instance=self.instance_id,
                          **{"operation.id": snapshot_id}):
            await parts.gate.drain(drain_timeout_s)
        op = parts.current_snapshot(snapshot_id)  # aborted or lapsed while draining?
        if op.pause is None:
            op.pause = PauseReport(self.instance_id, self._clock.monotonic() - start,
                                   len(parts.gate))
            tags = {"instance": self.instance_id}
            self._metrics.observe("drain", op.pause.drain_seconds, tags)
        return op.pause

    async def begin_snapshot(self, snapshot_id: str, drain_timeout_s: float, lease_s: float,
                             directory: str, trace: str = "", stop: bool = False
                             ) -> tuple[PauseReport, CaptureReport]:
        """``pause`` and ``capture`` in one call, the pause's hot path: one round trip.
        Idempotent like each of them. ``stop``: a stop snapshot's (``capture``).

        The write does not start here: a writer thread started before the reply leaves
        holds the GIL while the reply is serialized and delays it (~15 ms at 2,500
        sessions). ``start_writes`` (sent once every capture is in) or
        ``finish_writes`` starts it, into ``directory``."""
        with tracing.span("nemo_ckpt.pause", parent=trace, phase="pause",
                          instance=self.instance_id, **{"operation.id": snapshot_id}):
            pause = await self.pause(snapshot_id, drain_timeout_s, lease_s, directory)
            self._parts.current_snapshot(snapshot_id).trace = trace
            with tracing.span("nemo_ckpt.capture", phase="capture", instance=self.instance_id,
                              **{"operation.id": snapshot_id}) as span:
                capture = await self.capture(snapshot_id, stop)
                tracing.set_attributes(span, sessions=capture.captured_count,
                                       bytes=capture.state_bytes)
        return pause, capture

    async def release(self, snapshot_id: str) -> None:
        """The driver's block exited: open the turn gate now, while the shard is still
        being written; the snapshot stays open here (under its lease) until its commit
        or abort. Repeating it, or for a snapshot not paused here, changes nothing."""
        state = self._parts.ops.get(snapshot_id)
        if isinstance(state, SnapshotPaused):
            self._parts.set_state(snapshot_id,
                                  SnapshotReleased(state.work, state.lease_deadline))

    async def capture(self, snapshot_id: str, stop: bool = False) -> CaptureReport:
        """Copy the idle sessions in memory; sessions mid-turn are reported restarting.

        With ``stop`` (a stop snapshot, which parks every session at its commit, so no
        turn in flight ever commits after it) a session mid-turn is captured as of its
        last committed turn instead, and its turn in flight is run again after the
        restore: a final snapshot never holds less of a running rollout than the
        snapshot before it (issue 50, row 9). Its record references only committed
        turns' staging rows (a turn replaces its session's record at its commit), so
        the cut holds them; rows its turn in flight already wrote are orphans, which a
        restore clears. That turn's commit then waits for the snapshot's end: refused
        once it parked the session (a turn that counted would be missing from it),
        accepted if it was aborted (``HolderParts.after_stop_capture``)."""
        parts = self._parts
        op = parts.current_snapshot(snapshot_id)
        if op.capture is not None:
            return op.capture.report
        await parts.runtime.reached("capture")
        op = parts.current_snapshot(snapshot_id)
        if op.capture is not None:
            return op.capture.report
        start = self._clock.monotonic()
        # Held sessions are immutable (a turn replaces its session's): a list of them is
        # a consistent, cheap capture, and their rows are the report.
        held = list(parts.table)
        mid_turn = [h for h in held if h.capture_key in parts.gate] \
            if len(parts.gate) and not stop else []
        # Restart-only sessions are never captured: reported restarting, as mid-turn ones.
        restart_only = parts.sandboxes.restart_only
        if restart_only:
            mid_turn += [h for h in held if h.rollout_id in restart_only
                         and h.capture_key not in parts.gate]
        if mid_turn:
            busy = set(map(id, mid_turn))
            held = [h for h in held if id(h) not in busy]
        if stop and len(parts.gate):
            op.held_mid_turn = frozenset(h.capture_key for h in held
                                         if h.capture_key in parts.gate)
        sandboxes = parts.sandboxes.capture(held) if len(parts.sandboxes) else None
        report = CaptureReport(
            instance_id=self.instance_id,
            captured_msgpack=join_captured([h.row for h in held]),
            captured_count=len(held),
            restarting=tuple((h.rollout_id, h.attempt) for h in mid_turn),
            capture_seconds=self._clock.monotonic() - start,
            state_bytes=parts.table.held_bytes - sum(h.size for h in mid_turn),
            finished_count=parts.table.finished,  # a finished session is never mid-turn
            replay_restarts=parts.replay_restarts,
            restart_only_count=sum(1 for h in mid_turn if h.rollout_id in restart_only),
            unrecorded_keys=tuple(k for h in held
                                  for k in parts.sandboxes.unrecorded.get(h.rollout_id, ()))
            if parts.sandboxes.unrecorded else (),
        )
        op.capture = Capture(held, report, sandboxes)
        return report

    async def start_writes(self, snapshot_id: str, directory: str | None = None) -> None:
        """Start writing the captured sessions' shard in the background, into
        ``directory`` or the one ``begin_snapshot`` named. Repeating it is a no-op."""
        op = self._parts.current_snapshot(snapshot_id)
        if op.capture is None:
            raise HolderStateError(
                f"{self.instance_id}: persist for snapshot {snapshot_id} before capture")
        if directory is not None:
            op.directory = folder_at(directory)
        if op.persist is None:
            op.persist = asyncio.ensure_future(self._persist(op, op.directory, op.capture))
            # Its error reaches finish_writes; one of a snapshot that ended meanwhile
            # (aborted, lapsed) has no reader, and is not an error to report.
            op.persist.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def finish_writes(self, snapshot_id: str) -> PersistReport:
        """Wait for the shard to be durable, starting the write if ``start_writes`` has
        not (its message may come second). Refused once the snapshot ended here (its
        lease lapsed, or it was aborted)."""
        op = self._parts.current_snapshot(snapshot_id)
        if op.persist is None:
            await self.start_writes(snapshot_id)
        assert op.persist is not None
        await self._parts.runtime.reached("finish_writes")
        report = await asyncio.shield(op.persist)
        self._parts.current_snapshot(snapshot_id)  # it may have ended while writing
        return report

    async def commit_snapshot(self, snapshot_id: str, stop: bool = False) -> None:
        """The snapshot committed: open the turn gate, or with ``stop`` park (``park``).
        Repeating it, or after the snapshot ended here otherwise (its lease lapsed), is a
        no-op."""
        if self._parts.ops.snapshot(snapshot_id) is not None:
            if stop:  # parked before the gate opens: no turn begins in between
                keys = {r: h.capture_key for r in self._parts.table.rollouts()
                        if (h := self._parts.table.of_rollout(r)) is not None}
                rollouts, containers = self._park(snapshot_id)
            self._parts.set_state(snapshot_id, Ended(Outcome.COMMITTED))
            self._parts.heap.request()
            if stop:
                await self._free(snapshot_id, rollouts, containers, keys)

    def _park(self, snapshot_id: str) -> tuple[list[str], list[ContainerRef]]:
        """A stop snapshot is durable: drop every session (captured in it, or mid-turn
        and restarting, as after any crash), and refuse new sessions and turns from now
        on (``JobStoppedError``) until a restore commits here. Returns the rollouts, and
        the containers to remove."""
        parts = self._parts
        parts.parked_by = snapshot_id
        rollouts = parts.table.rollouts()
        for rollout_id in rollouts:
            held = parts.table.drop(rollout_id)
            if held is not None:
                parts.gate.drop(held.capture_key)  # a late commit is refused
        return rollouts, parts.sandboxes.park(rollouts)

    async def _free(self, snapshot_id: str, rollouts: list[str],
                    containers: list[ContainerRef], keys: dict[str, str]) -> None:
        """Free the parked sessions' sandboxes: their containers removed (awaited, so
        that a job that exits after its stop commit leaves none), their blobs swept from
        the node cache. A sandbox directory stays (its worker's files), but for one a
        provider made (``keys``: rollout id -> capture key): removed, and a restore here
        marks the continued attempt's in turn."""
        parts = self._parts
        if containers:
            await self._runtime.run_blocking(parts.sandboxes.remove_containers, containers)
        provided = parts.sandboxes.marked(keys.values())
        if provided:
            parts.sandboxes.provided_rollouts |= {r for r, k in keys.items() if k in provided}
            await self._runtime.run_blocking(parts.sandboxes.release_provided, provided)
        if not parts.ops.released() and parts.ops.current is None:
            parts.sandboxes.sweep()
        await parts.gate.notify()
        log.info("%s: stop snapshot %s parked %d session(s) and removed %d container(s)",
                 self.instance_id, snapshot_id, len(rollouts), len(containers))

    async def _persist(self, op: SnapshotWork, directory: Folder,
                       capture: Capture) -> PersistReport:
        with tracing.span("nemo_ckpt.persist", parent=op.trace, phase="persist",
                          instance=self.instance_id, sessions=len(capture.held),
                          **{"operation.id": op.id}) as span:
            report = await self._write(op, directory, capture)
            tracing.set_attributes(span, bytes=report.bytes_written)
            return report

    async def _write(self, op: SnapshotWork, directory: Folder,
                     capture: Capture) -> PersistReport:
        start = self._clock.monotonic()
        await self._parts.runtime.reached("persist")
        shards: tuple[ShardRef, ...] = ()
        if capture.held:
            entry, names = await write_capture(self._runtime, self._parts.sandboxes,
                                               self.instance_id, op.id, directory, capture)
            if self._parts.ops.snapshot(op.id) is not op \
                    and self._parts.ops.outcome(op.id) is not Outcome.COMMITTED:
                # Aborted or lapsed while the thread wrote: the files must not outlive it.
                await self._runtime.run_blocking(remove_files, directory, names)
                raise self._parts.refusal(op.id)
            shards = (entry,)
        return PersistReport(
            instance_id=self.instance_id, shards=shards,
            persist_seconds=self._clock.monotonic() - start,
            bytes_written=sum(s.bytes + (s.trees.bytes + s.trees.new_blob_bytes
                                         if s.trees else 0) for s in shards),
        )
