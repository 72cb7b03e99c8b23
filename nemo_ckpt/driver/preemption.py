"""``Preemption``: a job told to stop keeps its rollouts.

Kubernetes and Slurm send SIGTERM and kill a grace period later; Ray's ``drain-node``
announces a node's end. Around the job's main body::

    async with Preemption(manager.final_snapshot, deadline_s=25.0,
                          drains=ckpt.draining_holders):
        await train()

on SIGTERM or SIGINT, or once a node hosting a holder drains, ``final(seconds_left)``
runs beside the body (the snapshot it takes is the job's usual one, RL's half saved
through the same hook: ``RolloutCheckpointManager.final_snapshot``), held to the
deadline; then the body is cancelled and the process exits with the signal's
conventional status, ``128 + signal`` (143 for SIGTERM, 130 for SIGINT; a drain exits as
SIGTERM would). A final snapshot that fails or misses its deadline is aborted, which
leaves the last committed snapshot untouched, and one line says so. The body runs on
meanwhile: its turns end at the snapshot's pause, and a stop commit then refuses them
(``JobStoppedError``) as the job goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Collection, Iterable
from types import TracebackType
from typing import Any

__all__ = ["Preemption"]

log = logging.getLogger("nemo_ckpt")

# Of the seconds left at the trigger, what the final snapshot may use: the rest covers
# the exit (Ray's shutdown, the logs' flush) before the grace period ends.
_EXIT_MARGIN = 0.1


class Preemption:
    """Turns a stop request into a final snapshot within a deadline, then an exit.

    Args:
        final: Takes the final snapshot given the seconds it may use; raises if it did
            not commit.
        deadline_s: Seconds from the signal (or the drain's announcement) to the kill:
            the grace period (Kubernetes' ``terminationGracePeriodSeconds``, 30 s by
            default; Slurm's ``--signal`` lead time).
        signals: The signals that stop the job (handled on the running event loop,
            which must be the main thread's); the handlers there before come back
            when the block exits.
        drains: Returns the holders whose node drains now (e.g.
            ``RayEnvironmentCheckpoint.draining_holders``), polled every
            ``drain_poll_s``; None watches no drain.
    """

    def __init__(self, final: Callable[[float], Awaitable[Any]], *,
                 deadline_s: float = 25.0,
                 signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
                 drains: Callable[[], Awaitable[Collection[Any]]] | None = None,
                 drain_poll_s: float = 1.0) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, not {deadline_s!r}")
        self._final = final
        self.deadline_s = float(deadline_s)
        self._signals = tuple(signals)
        self._drains = drains
        self._drain_poll_s = drain_poll_s
        self.reason: str | None = None  # what stopped the job, once something did
        self.status: int | None = None  # the exit status it calls for
        self.committed: bool | None = None  # whether the final snapshot committed
        self.requested = asyncio.Event()
        self._body: asyncio.Task[Any] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._installed: list[signal.Signals] = []
        self._exiting = False  # the body has ended: __aexit__ runs

    async def __aenter__(self) -> Preemption:
        loop = asyncio.get_running_loop()
        self._body = asyncio.current_task()
        for sig in self._signals:
            loop.add_signal_handler(sig, self.stop, f"signal {sig.name}", 128 + sig)
            self._installed.append(sig)
        if self._drains is not None:
            self._watch = asyncio.ensure_future(self._watch_drains())
        return self

    def stop(self, reason: str, status: int = 128 + signal.SIGTERM) -> None:
        """Stop the job as a signal would: the final snapshot, then the exit with
        ``status``. A second request while stopping changes nothing."""
        if self._stopping is not None:
            log.warning("preemption: %s while already stopping (%s); the final snapshot "
                        "goes on", reason, self.reason)
            return
        self.reason, self.status = reason, status
        self.requested.set()
        log.warning("preemption: %s; taking the final snapshot within %gs", reason,
                    self.deadline_s)
        self._stopping = asyncio.ensure_future(self._stop(asyncio.get_running_loop().time()))

    async def _stop(self, since: float) -> None:
        loop = asyncio.get_running_loop()
        left = max(0.0, self.deadline_s * (1 - _EXIT_MARGIN) - (loop.time() - since))
        final = asyncio.ensure_future(self._final(left))
        done, _ = await asyncio.wait({final}, timeout=left)
        if not done:  # cancelled: an abort before the commit; a commit runs to its end
            final.cancel()
            done, _ = await asyncio.wait({final}, timeout=self.deadline_s * _EXIT_MARGIN / 2)
        why = _why_not_committed(final) if done else "missed its deadline"
        self.committed = why is None
        if why is None:
            log.warning("preemption: %s: the final snapshot committed in %.2fs; exiting "
                        "with status %s", self.reason, loop.time() - since, self.status)
        else:
            log.error("preemption: %s: the final snapshot %s within %gs and was aborted%s; "
                      "the last committed snapshot is untouched and the job restores from "
                      "it", self.reason, why, self.deadline_s,
                      "" if done else " (its commit had begun: if it ends before the "
                      "process does, it is a newer snapshot)")
        if self._body is not None and not self._exiting:  # else it waits in __aexit__
            self._body.cancel()

    async def _watch_drains(self) -> None:
        assert self._drains is not None
        while self._stopping is None:
            try:
                draining = await self._drains()
            except Exception as exc:  # a failed look is no drain; the next one retries
                log.debug("preemption: looking for drains failed: %s", exc)
                draining = ()
            if draining:
                shown = ", ".join(sorted(str(getattr(h, "instance_id", h)) for h in draining))
                self.stop(f"a node hosting {shown} drains")
                return
            await asyncio.sleep(self._drain_poll_s)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: TracebackType | None) -> bool:
        self._exiting = True
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._stopping is None:
            return False  # never told to stop: the body's own outcome
        await asyncio.shield(self._stopping)  # a body that ended first waits for it
        raise SystemExit(self.status)  # our own cancellation of the body ends here


def _why_not_committed(final: asyncio.Future[Any]) -> str | None:
    """Why an ended final snapshot did not commit, or None if it did."""
    if final.cancelled():
        return "missed its deadline"
    error = final.exception()
    if error is None:
        return None
    if isinstance(error, asyncio.TimeoutError):
        return "missed its deadline"
    first = str(error).splitlines()[0] if str(error) else ""
    return f"failed ({type(error).__name__}: {first})"
