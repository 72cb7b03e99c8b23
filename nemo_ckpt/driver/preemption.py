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
(``JobStoppedError``) as the job goes. The manager's final snapshot saves the trainer's
checkpoint too, when given ``save_trainer_checkpoint``, and is anchored to its step; the
line that says it committed names its anchor, or why it has none
(``nemo_ckpt.manager.stop_anchor``).

Where the seconds go (``StopBudget``): the final snapshot gets the deadline less the exit
margin, a measured figure (``EXIT_MARGIN_S``) for what the process does after it (Ray's
shutdown, the logs' flush); an abort's answer is awaited for a quarter of the margin;
and a process still alive just before the deadline (a shutdown that took longer than its
margin) is ended then with the signal's status, rather than by the scheduler's SIGKILL
(137). A drain with a deadline (Ray's GCS gives one per draining node) shortens the
deadline to it (``drain_deadline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = ["EXIT_MARGIN_S", "Preemption", "StopBudget", "drain_deadline"]

log = logging.getLogger("nemo_ckpt")

# Seconds kept after the final snapshot for the process's exit. Measured (issue 50, row
# 11) on a 2-core machine: ray.shutdown() of a driver that started its own cluster took
# 1.1-1.4 s with one actor and 2-3 s with the preemption example's job; a 10% margin
# of a 10 s grace did not cover it. Pass ``exit_margin_s`` for a slower exit.
EXIT_MARGIN_S = 3.0
# How long before the kill a process still running ends itself (``StopBudget``).
_KILL_SLACK_S = 0.5


@dataclass(frozen=True)
class StopBudget:
    """How the seconds from a stop to the kill are spent, counted from the stop: pure
    arithmetic, so that it is tested without a clock.

    ``deadline_s`` is the grace period (or a drain's deadline, if sooner);
    ``exit_margin_s`` what the exit needs. A short deadline keeps at least half of it
    for the snapshot."""

    deadline_s: float
    exit_margin_s: float = EXIT_MARGIN_S

    @property
    def margin_s(self) -> float:
        """The seconds kept for the exit."""
        return max(0.0, min(self.exit_margin_s, self.deadline_s / 2))

    @property
    def snapshot_s(self) -> float:
        """Seconds from the stop that the final snapshot may use."""
        return self.deadline_s - self.margin_s

    @property
    def abort_s(self) -> float:
        """Seconds past ``snapshot_s`` that an abort's answer is awaited."""
        return self.margin_s / 4

    @property
    def exit_s(self) -> float:
        """Seconds from the stop after which a process still running ends itself: just
        before the kill, whatever its shutdown still had to do."""
        return self.deadline_s - min(_KILL_SLACK_S, self.deadline_s / 20)


def drain_deadline(grace_s: float, deadlines: Iterable[float | None], now: float
                   ) -> tuple[float, str]:
    """The deadline a drain leaves, in seconds from ``now``, and how it was chosen.

    ``deadlines`` are the draining nodes' deadlines as Ray's GCS gives them, converted to
    seconds since the epoch (None: a drain without one). They are wall-clock times set by
    whoever asked for the drain (``ray drain-node``'s host, the autoscaler's), so they
    are read once, on the driver's wall clock (``now``), into seconds left; an offset
    between those hosts' clocks shifts them by as much (NTP keeps it to milliseconds).
    The earliest deadline wins if it is sooner than the job's grace ``grace_s``. One
    already past on this clock says nothing reliable (a clock offset, or a drain seen
    late): the grace stands, and the reason says so."""
    known = [d for d in deadlines if d is not None and d > 0]
    if not known:
        return grace_s, f"the job's grace period ({grace_s:g}s)"
    left = min(known) - now
    if left <= 0:
        return grace_s, (f"the job's grace period ({grace_s:g}s): the drain's deadline "
                         f"is {-left:.1f}s past on this host's clock")
    if left < grace_s:
        return left, f"the drain's deadline ({left:.1f}s away)"
    return grace_s, f"the job's grace period ({grace_s:g}s, before the drain's deadline)"


class Preemption:
    """Turns a stop request into a final snapshot within a deadline, then an exit.

    Args:
        final: Takes the final snapshot given the seconds it may use; raises if it did
            not commit.
        deadline_s: Seconds from the signal (or the drain's announcement) to the kill:
            the grace period (Kubernetes' ``terminationGracePeriodSeconds``, 30 s by
            default; Slurm's ``--signal`` lead time). A drain whose node has a sooner
            deadline is held to that one (``drain_deadline``).
        signals: The signals that stop the job (handled on the running event loop,
            which must be the main thread's); the handlers there before (Ray's, say)
            come back when the block exits.
        drains: Returns the holders whose node drains now (e.g.
            ``RayEnvironmentCheckpoint.draining_holders``; a holder's
            ``drain_deadline``, when it has one, is its node's), polled every
            ``drain_poll_s``; None watches no drain.
        exit_margin_s: Seconds kept after the final snapshot for the process's exit
            (``EXIT_MARGIN_S``, measured; ``StopBudget``).
        exit_by_deadline: Once told to stop, end the process (``os._exit`` with the
            signal's status) if it still runs just before the deadline, its shutdown cut
            short, so a scheduler's SIGKILL never makes it 137. False for a process that
            goes on after the stop (a test, a notebook).
        wall_clock: Seconds since the epoch, to read a drain's deadline by.
    """

    def __init__(self, final: Callable[[float], Awaitable[Any]], *,
                 deadline_s: float = 25.0,
                 signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
                 drains: Callable[[], Awaitable[Collection[Any]]] | None = None,
                 drain_poll_s: float = 1.0, exit_margin_s: float = EXIT_MARGIN_S,
                 exit_by_deadline: bool = True,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, not {deadline_s!r}")
        if not exit_margin_s >= 0:
            raise ValueError(f"exit_margin_s must be 0 or more, not {exit_margin_s!r}")
        self._final = final
        self.deadline_s = float(deadline_s)
        self.exit_margin_s = float(exit_margin_s)
        self._signals = tuple(signals)
        self._drains = drains
        self._drain_poll_s = drain_poll_s
        self._exit_by_deadline = exit_by_deadline
        self._wall = wall_clock
        self.reason: str | None = None  # what stopped the job, once something did
        self.status: int | None = None  # the exit status it calls for
        self.committed: bool | None = None  # whether the final snapshot committed
        self.budget: StopBudget | None = None  # how the stop's seconds go, once stopped
        self.snapshot: Any = None  # what the final snapshot returned, once it committed
        self.requested = asyncio.Event()
        self._body: asyncio.Task[Any] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        # Each signal handled here, with the handler that was there before.
        self._installed: list[tuple[signal.Signals, Any]] = []
        self._exiting = False  # the body has ended: __aexit__ runs
        self._exit_timer: threading.Timer | None = None

    async def __aenter__(self) -> Preemption:
        loop = asyncio.get_running_loop()
        self._body = asyncio.current_task()
        for sig in self._signals:
            before = signal.getsignal(sig)
            loop.add_signal_handler(sig, self.stop, f"signal {sig.name}", 128 + sig)
            self._installed.append((sig, before))
        if self._drains is not None:
            self._watch = asyncio.ensure_future(self._watch_drains())
        return self

    def stop(self, reason: str, status: int = 128 + signal.SIGTERM,
             deadline_s: float | None = None, why: str | None = None) -> None:
        """Stop the job as a signal would: the final snapshot, then the exit with
        ``status``; within ``deadline_s`` if given (a drain's), else the grace period.
        A second request while stopping changes nothing."""
        if self._stopping is not None:
            log.warning("preemption: %s while already stopping (%s); the final snapshot "
                        "goes on", reason, self.reason)
            return
        self.reason, self.status = reason, status
        self.budget = StopBudget(self.deadline_s if deadline_s is None else deadline_s,
                                 self.exit_margin_s)
        self.requested.set()
        log.warning("preemption: %s; taking the final snapshot within %.3gs (the deadline: "
                    "%s; %.3gs kept for the exit)", reason, self.budget.snapshot_s,
                    why or f"the job's grace period ({self.deadline_s:g}s)",
                    self.budget.margin_s)
        if self._exit_by_deadline:
            self._arm_exit(self.budget.exit_s)
        self._stopping = asyncio.ensure_future(self._stop(asyncio.get_running_loop().time()))

    def _arm_exit(self, seconds: float) -> None:
        """End the process ``seconds`` from now if it still runs then (a daemon timer:
        it never holds the process up)."""
        timer = threading.Timer(max(0.0, seconds), self._exit_now, (seconds,))
        timer.daemon = True
        timer.start()
        self._exit_timer = timer

    def _exit_now(self, seconds: float) -> None:
        log.error("preemption: %s: the process still ran %.3gs after the stop, just before "
                  "the deadline; exiting with status %s now (what its shutdown had left is "
                  "cut short)", self.reason, seconds, self.status)
        logging.shutdown()  # flushes every handler
        with contextlib.suppress(Exception):
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        os._exit(self.status if self.status is not None else 128 + signal.SIGTERM)

    async def _stop(self, since: float) -> None:
        loop = asyncio.get_running_loop()
        budget = self.budget
        assert budget is not None
        left = max(0.0, budget.snapshot_s - (loop.time() - since))
        final = asyncio.ensure_future(self._final(left))
        done, _ = await asyncio.wait({final}, timeout=left)
        if not done:  # cancelled: an abort before the commit; a commit runs to its end
            final.cancel()
            done, _ = await asyncio.wait({final}, timeout=budget.abort_s)
        why = _why_not_committed(final) if done else "missed its deadline"
        self.committed = why is None
        if why is None:
            self.snapshot = final.result()
            log.warning("preemption: %s: the final snapshot committed in %.2fs%s; exiting "
                        "with status %s", self.reason, loop.time() - since,
                        _anchor_said(self.snapshot), self.status)
        else:
            log.error("preemption: %s: the final snapshot %s within %.3gs and was aborted%s; "
                      "the last committed snapshot is untouched and the job restores from "
                      "it", self.reason, why, budget.snapshot_s,
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
                deadline, why = drain_deadline(
                    self.deadline_s, (getattr(h, "drain_deadline", None) for h in draining),
                    self._wall())
                self.stop(f"a node hosting {shown} drains", deadline_s=deadline, why=why)
                return
            await asyncio.sleep(self._drain_poll_s)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: TracebackType | None) -> bool:
        self._exiting = True
        loop = asyncio.get_running_loop()
        for sig, before in self._installed:
            loop.remove_signal_handler(sig)  # leaves the default behind
            if before is not None:  # None: one not set from Python, which cannot be put back
                signal.signal(sig, before)
        self._installed.clear()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._stopping is None:
            return False  # never told to stop: the body's own outcome
        await asyncio.shield(self._stopping)  # a body that ended first waits for it
        raise SystemExit(self.status)  # our own cancellation of the body ends here


def _anchor_said(taken: Any) -> str:
    """What a manager's final snapshot says of its trainer anchor (nothing for another
    final's result)."""
    step = getattr(taken, "anchor_step", None)
    if step is not None:
        return f", anchored to trainer step {step}"
    why = getattr(taken, "unanchored_why", None)
    return f", anchored to no trainer checkpoint ({why})" if why else ""


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
