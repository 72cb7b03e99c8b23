"""A snapshot as the driver runs it (``RayEnvironmentCheckpoint.snapshot`` and
``final_snapshot``), the driver's room of a snapshot: the steps it takes, in the order
``nemo_ckpt.protocol.coordinator_api.CoordinatorApi`` states once:

    1) renew            from the start to the end (``nemo_ckpt.driver.operation``)
    2) begin_snapshot   every holder paused and captured; the caller's block runs around
                        the ``RaySnapshot`` it holds (``nemo_ckpt.driver.snapshot``)
    3) start_writes     as the block starts
    4) commit_snapshot  on a clean exit, unless the check against RL's cut raised or never
                        ran (then an abort)
    5) release          to each holder, from here as the commit leaves
                        (``nemo_ckpt.driver.holder_handles``)

``SnapshotOperation`` is a part of ``RayEnvironmentCheckpoint``; it opens its operation
through the checkpoint's ``OpenOperations`` (``nemo_ckpt.driver.operation``) and keeps
what the last snapshot held (``held_before``), which a restore resets.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nemo_ckpt import tracing
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.driver.holder_handles import HolderHandles
from nemo_ckpt.driver.link import CoordinatorLink
from nemo_ckpt.driver.operation import OpenOperations, checkpoint_location, operation_span
from nemo_ckpt.driver.snapshot import HeldBefore, RaySnapshot
from nemo_ckpt.errors import UncheckedSnapshotError
from nemo_ckpt.protocol.coordinator_api import SnapshotBegun
from nemo_ckpt.transport import Transport

__all__ = ["SnapshotOperation"]

log = logging.getLogger("nemo_ckpt")


class SnapshotOperation:
    """The driver's snapshots (see the module docstring)."""

    def __init__(self, config: CheckpointConfig, link: CoordinatorLink,
                 holder_handles: HolderHandles, ops: OpenOperations,
                 transport: Callable[[], Transport]) -> None:
        self.config = config
        self._coordinator = link.calls
        self._holder_handles = holder_handles
        self._ops = ops
        self._transport = transport
        # What the last snapshot held (or the last restore made live), for the next
        # snapshot's warning about rollouts lost since (``HeldBefore``).
        self.held_before: HeldBefore | None = None

    def live_now(self, held: HeldBefore) -> None:
        """What a restore just made live: the next snapshot's "held before"."""
        self.held_before = held

    @contextlib.asynccontextmanager
    async def run(self, checkpoint_path: Path, stop: bool, drain_timeout_s: float | None
                  ) -> AsyncIterator[Optional[RaySnapshot]]:
        """One snapshot (``RayEnvironmentCheckpoint.snapshot``, or its
        ``final_snapshot`` with ``stop``), around the caller's block."""
        path = checkpoint_location(checkpoint_path, self.config.checkpoint_root)
        clock = self._transport().runtime.clock
        started = clock.monotonic()
        async with self._ops.open("snapshot", path) as op, \
                operation_span("nemo_ckpt.snapshot", op.id, path, stop=stop) as span:
            begun = await op.step(self._coordinator.begin_snapshot(
                op.id, path, drain_timeout_s, tracing.traceparent(), stop))
            snap = RaySnapshot(begun, self.held_before)
            # A message, sent here and never raising: the writes overlap the caller's
            # block (awaiting it waits for nothing).
            await self._coordinator.start_writes(op.id)
            self._holder_handles.prepare(begun)  # in the background, for the exit
            given = snap if snap.captured_rollouts or snap.restarted_rollouts else None
            yield given
            refused = snap.refused or self._unchecked(snap, given is not None, path)
            if refused is not None:  # a check that raised (caught) or never ran
                await op.fail(refused)
            # The manifest carries what is known at commit; the holders' pause ends here,
            # as the commit releases them.
            snap._record_release(clock.monotonic() - started)
            metrics = snap.figures()
            committed = await op.commit(
                self._coordinator.commit_snapshot(op.id, path, metrics,
                                                  snap.restarted_rollouts, stop),
                # A stop keeps every gate closed until its sessions are parked.
                beside=None if stop else lambda: self._release_holders(begun),
                lost=lambda: _Committed(dict(metrics)))
            snap._record_commit(committed.metrics, clock.monotonic() - started)
            tracing.set_attributes(span, sessions=snap.captured_rollouts,
                                   bytes=int(committed.metrics.get("bytes_written", 0)))
            self.held_before = snap.held()
            log.info("%s %s committed: %d rollouts, %d restarted, %d bytes, "
                     "paused %.3fs", "stop snapshot" if stop else "snapshot", op.id,
                     snap.captured_rollouts,
                     snap.restarted_rollouts, committed.metrics.get("bytes_written", 0),
                     clock.monotonic() - started)

    def _release_holders(self, begun: SnapshotBegun) -> int:
        """Release the holders ``begun`` paused, from here: their gates open one hop
        sooner than by the coordinator's release, which still follows
        (``nemo_ckpt.driver.holder_handles``). Returns how many releases were sent."""
        return self._holder_handles.release(begun)

    def _unchecked(self, snap: RaySnapshot, yielded: bool, path: str
                   ) -> UncheckedSnapshotError | None:
        """The refusal of a snapshot whose block never checked it against the cut."""
        if not yielded or snap.check_result is not None \
                or self.config.allow_unchecked_snapshots:
            return None
        return UncheckedSnapshotError(
            f"snapshot {snap.snapshot_id} into {path} was not committed: its block never "
            f"called `await snapshot.check_against_cut(cut)` inside "
            f"`async with data_plane_barrier.checkpoint() as cut:`, so nothing proved that "
            f"the {snap.captured_rollouts} captured rollout(s) match RL's ledger; add the "
            f"check, or set CheckpointConfig(allow_unchecked_snapshots=True) for a backend "
            f"used without a data-plane cut")


@dataclass(frozen=True)
class _Committed:
    """A commit whose answer was lost, but which won (the abort said so)."""

    metrics: dict[str, float | int]
