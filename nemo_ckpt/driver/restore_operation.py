"""A restore as the driver runs it (``RayEnvironmentCheckpoint.restored`` and
``prefetch``), the driver's room of a restore: the steps it takes, in the order
``nemo_ckpt.protocol.coordinator_api.CoordinatorApi`` states once:

    0) prefetch_restore  (``prefetch``) the holders start reading a snapshot ahead
    1) renew             from the start to the end (``nemo_ckpt.driver.operation``)
    2) prepare_restore   placed, read and verified on every holder, nothing live; the
                         caller's block runs with what it will continue
    3) commit_restore    on a clean exit: the sessions live on every holder
    or abort, on any failure or cancellation: every holder drops what it restored.

``RestoreOperation`` is a part of ``RayEnvironmentCheckpoint``; it opens its operation
through the checkpoint's ``OpenOperations``, keeps the last restore's figures and
results, and tells the snapshots what went live (``on_live``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from nemo_ckpt import tracing
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.driver.link import CoordinatorLink
from nemo_ckpt.driver.operation import OpenOperations, checkpoint_location, operation_span
from nemo_ckpt.driver.snapshot import HeldBefore
from nemo_ckpt.interfaces import EnvironmentEpisode, RestoredEnvironmentRollouts
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.transport import Transport

__all__ = ["RestoreOperation"]

log = logging.getLogger("nemo_ckpt")


class RestoreOperation:
    """The driver's restores (see the module docstring)."""

    def __init__(self, config: CheckpointConfig, link: CoordinatorLink, ops: OpenOperations,
                 transport: Callable[[], Transport],
                 on_live: Callable[[HeldBefore], None]) -> None:
        self.config = config
        self._coordinator = link.calls
        self._ops = ops
        self._transport = transport
        self._on_live = on_live
        self.results: tuple[FinishedRollout, ...] = ()  # the last restore's, once yielded
        self.last_metrics: dict[str, float | int] | None = None

    async def prefetch(self, checkpoint_path: Path) -> int:
        """Step 0 (``RayEnvironmentCheckpoint.prefetch``)."""
        path = checkpoint_location(checkpoint_path, self.config.checkpoint_root)
        return await self._coordinator.prefetch_restore(path)

    @contextlib.asynccontextmanager
    async def run(self, checkpoint_path: Path) -> AsyncIterator[RestoredEnvironmentRollouts]:
        """Steps 1-3 around the caller's block (``RayEnvironmentCheckpoint.restored``)."""
        path = checkpoint_location(checkpoint_path, self.config.checkpoint_root)  # or a URL
        clock = self._transport().runtime.clock
        started = clock.monotonic()
        self.results = ()  # a restore that fails hands nothing back
        async with self._ops.open("restore", None) as op, \
                operation_span("nemo_ckpt.restore", op.id, path) as span:
            begun = await op.step(self._coordinator.prepare_restore(op.id, path,
                                                                    tracing.traceparent()))
            tracing.set_attributes(span, sessions=len(begun.continued_attempts),
                                   bytes=int(begun.bytes_read))
            self.results = begun.finished
            try:
                yield RestoredEnvironmentRollouts(
                    continued_attempts=begun.continued_attempts,
                    staging_keys=begun.staging_keys)
                live = await op.commit(self._coordinator.commit_restore(op.id),
                                       lost=lambda: "all")
            except BaseException:
                self.results = ()  # they did not go live
                raise
            self._on_live(HeldBefore(live=frozenset(
                (inst, EnvironmentEpisode(rid, att).next_attempt())
                for inst, rid, att in begun.continued_attempts)))
            self.last_metrics = {
                "bytes_read": int(begun.bytes_read), "read_seconds": begun.read_seconds,
                "restore_seconds": clock.monotonic() - started,
                "continued_rollouts": len(begun.continued_attempts)}
            log.info("restore %s from %s: %s sessions live", op.id, path, live)
