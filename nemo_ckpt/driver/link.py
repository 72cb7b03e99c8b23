"""The driver's link to the coordinator: calls attached to it, each bounded by its
deadline (``CoordinatorLink.deadline_s``), sent again while its name still resolves to a
dead incarnation, lease renewals, aborts that learn an operation's outcome, the ledger's
retries and the wait for a shutdown's names to go.

Every call ends by its deadline whatever the coordinator or Ray does (a live
coordinator that never answers on a loaded machine, issue 56): it then raises
``BackendUnavailableError`` with ``timed_out`` set, and the call it ended may still run
there. An abort is a call of its own with its own deadline, so it never waits on the
call it aborts.

The call order a driver follows is stated once, on
``nemo_ckpt.protocol.coordinator_api.CoordinatorApi``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.errors import BackendUnavailableError
from nemo_ckpt.interfaces import EnvironmentEpisode
from nemo_ckpt.protocol.coordinator_api import coordinator_calls, direct_coordinator_calls
from nemo_ckpt.protocol.operations import new_operation_id
from nemo_ckpt.transport import COORDINATOR, Transport, detached, unavailable_error

__all__ = ["CoordinatorLink", "finish"]

log = logging.getLogger("nemo_ckpt")
# retire/forget are idempotent: a restarted coordinator or a lost holder is retried.
_LEDGER_OP_TRIES = 4
# How often a call looks the coordinator's name up again while it resolves to the dead.
NAME_RETRY_S = 0.25
# How often shutdown(wait=True) looks whether Ray has released the names.
_GONE_POLL_S = 0.1
# Calls whose outcome, when the coordinator died under them, only the abort can tell.
_OUTCOME_CALLS = frozenset({"commit_snapshot", "commit_restore"})
# The least ``ensure_holders`` (which creates the holders and waits for their first
# answer) is given: Ray starts processes slowly on a loaded machine.
CREATE_MIN_S = 120.0


class CoordinatorLink:
    """Everything the driver says to the coordinator, and how it copes with its loss."""

    def __init__(self, config: CheckpointConfig, transport: Callable[[], Transport]) -> None:
        self.config = config
        self._transport = transport  # the driver's, made on first use
        self._attached = False  # whether the coordinator has compared our config
        self._driver_id: str | None = None  # names this driver in its operation ids
        self._sequence = 0
        self.calls = coordinator_calls(
            self._call, lambda method, *args: self._transport().send(
                self._transport().coordinator(), method, *args))

    @property
    def name_wait_s(self) -> float:
        """How long a call waits for the coordinator's name to stop resolving to a dead
        incarnation: past a lease, the holders have resumed by themselves anyway."""
        return self.config.lease_s + self.config.phase_timeout_s

    def deadline_s(self, method: str, *args: Any) -> float:
        """How long one attempt of ``method`` may take before the driver gives up on it:
        the coordinator's own deadlines for the phase (a snapshot's begin waits for the
        drain and a pause call; a commit or a restore's read for the shards' writes or
        reads; either for the holders' answers: two phases), plus ``name_wait_s`` (a
        lease and a phase), the time Ray may take to tell the callers of a coordinator
        that died of its death: until then a dead coordinator looks like one that does
        not answer, and the call that learns of the death goes on to its successor
        (simulation seed 30646). An abort has that margin alone: the holders drop the
        operation within a phase, and a commit running there, which it waits for, has
        had its own deadline already."""
        cfg = self.config
        if method == "abort":
            return self.name_wait_s
        if method == "begin_snapshot":
            given = args[2] if len(args) > 2 and args[2] is not None else cfg.drain_timeout_s
            phase = min(float(given), cfg.drain_timeout_s) + 2 * cfg.phase_timeout_s
        elif method in ("commit_snapshot", "prepare_restore"):
            phase = cfg.persist_timeout_s + 2 * cfg.phase_timeout_s
        else:
            phase = 2 * cfg.phase_timeout_s
        if method == "ensure_holders":
            phase = max(CREATE_MIN_S, cfg.persist_timeout_s + 2 * cfg.phase_timeout_s)
        return phase + self.name_wait_s

    def new_operation_id(self, kind: str) -> str:
        runtime = self._transport().runtime
        if self._driver_id is None:
            self._driver_id = runtime.token()[:8]
        self._sequence += 1
        return new_operation_id(kind, runtime.clock.wall(), self._driver_id, self._sequence)

    async def _call(self, method: str, *args: Any) -> Any:
        """Call the coordinator (errors as ``Transport.call`` raises them), attached first:
        a coordinator found alive was made with someone's config
        (``CheckpointCoordinator.attach``). A call that finds the coordinator dead is sent
        again, within a lease and a phase, while Ray may still resolve its name to the
        dead actor (until it has declared the actor's node dead): the next attempt after
        a coordinator's loss then finds its successor. The wait counts from the first
        attempt that found it dead, not from the call: that attempt may itself have waited
        for Ray to notice the death (simulation seed 30646). A commit is not sent again:
        its outcome is learned from the abort (``RayEnvironmentCheckpoint``'s commit).
        The whole call, each attempt and its attach included, ends by
        ``deadline_s(method)`` from its start; an attempt that missed it is not sent
        again (it may still run)."""
        transport = self._transport()
        clock = transport.runtime.clock
        timeout = self.deadline_s(method, *args)
        # The whole call, every attempt and its attach, ends by ``timeout`` from here:
        # the deadline already holds the margin for a death and the successor
        # (``deadline_s``). An attempt after a death given a whole deadline of its own
        # let a begin that met a hung successor take 31.5 s with its abort, past the
        # 25 s its deadlines allow (simulation seed 1100396).
        ends = None if timeout is None else clock.monotonic() + timeout

        def left() -> float | None:
            """What is left of the call's deadline; unavailable once it is spent."""
            if ends is None:
                return None
            remaining = ends - clock.monotonic()
            if remaining <= 0:
                raise unavailable_error(transport.coordinator(), method, timeout=timeout)
            return remaining

        deadline: float | None = None
        while True:
            try:
                if not self._attached and method != "abort":
                    # Within the call's own deadline. An abort is sent at once, attached
                    # or not (a coordinator it makes is made with this config): it must
                    # not wait behind an attach to a coordinator that does not answer.
                    # (Simulation seed 700400: an attach and a begin_snapshot each took
                    # their whole deadline.)
                    await direct_coordinator_calls(transport, left()).attach(self.config)
                    self._attached = True
                return await transport.call(transport.coordinator(), method, *args,
                                            timeout=left())
            except BackendUnavailableError as exc:
                if not exc.timed_out:  # another coordinator may answer next: attach to it
                    self._attached = False
                if exc.unreachable != COORDINATOR or exc.timed_out or method in _OUTCOME_CALLS:
                    raise
                if deadline is None:
                    deadline = clock.monotonic() + self.name_wait_s
                elif clock.monotonic() >= deadline:
                    raise
            await asyncio.sleep(NAME_RETRY_S)

    async def abort(self, op_id: str, path: str | None, cause: BaseException) -> str | None:
        """Abort ``op_id`` everywhere, even from a cancelled task, and return its outcome
        ("committed" if its commit won), or None if the coordinator could not be reached
        (the holders then end it by their lease)."""
        # ``_call`` sends it again while the coordinator's name resolves to the dead:
        # the survivors resume at once after a node's loss, not by their lease.
        answer, _ = await finish(asyncio.ensure_future(
            self.calls.abort(op_id, path, type(cause).__name__)))
        if isinstance(answer, BaseException):
            log.warning("abort of %s after %s also failed: %s", op_id,
                        type(cause).__name__, answer)
            return None
        return str(answer)

    @contextlib.asynccontextmanager
    async def renewing(self, op_id: str) -> AsyncIterator[None]:
        """Renew ``op_id``'s lease every renewal period while the block runs; each
        renewal on its own, so that one slow answer does not delay the next."""
        pending: set[asyncio.Future[Any]] = set()

        async def renew_once() -> None:
            try:
                await direct_coordinator_calls(self._transport(),
                                               self.config.lease_s).renew(op_id)
            except Exception as exc:
                log.debug("lease renewal of %s failed: %s", op_id, exc)

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.config.renew_interval_s)
                task = asyncio.ensure_future(renew_once())
                pending.add(task)
                task.add_done_callback(pending.discard)

        task = asyncio.ensure_future(renew())
        try:
            yield
        finally:
            task.cancel()
            for each in list(pending):
                each.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def ledger_op(self, op: str, episodes: list[EnvironmentEpisode]) -> list[str]:
        """``retire`` or ``forget``, sent again after a coordinator or holder was briefly
        unavailable (both are idempotent)."""
        call = self.calls.retire if op == "retire" else self.calls.forget
        for attempt in range(_LEDGER_OP_TRIES):
            try:
                return await call(episodes)
            except BackendUnavailableError:
                if attempt == _LEDGER_OP_TRIES - 1:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    async def until_gone(self, timeout_s: float, shown_s: float | None = None) -> None:
        """Return once Ray has released every name of the namespace (killing any actor a
        straggling call made meanwhile); ``BackendUnavailableError`` after ``timeout_s``
        (``shown_s`` in its message: the caller's whole timeout), each call to the
        cluster bounded by what is left of it and waited for off the loop."""
        transport = self._transport()
        clock = transport.runtime.clock
        deadline = clock.monotonic() + timeout_s
        shown = timeout_s if shown_s is None else shown_s
        names = await detached(transport.runtime, transport.actor_names, max(0.0, timeout_s))
        while names:
            left = deadline - clock.monotonic()
            if left > 0:  # one created meanwhile by a straggling call
                await detached(transport.runtime, transport.kill_namespace, left)
                await asyncio.sleep(_GONE_POLL_S)
                left = deadline - clock.monotonic()
            if left <= 0:  # no look with no time left: the last one's names say why
                raise BackendUnavailableError(
                    f"shutdown of namespace {transport.namespace}: {', '.join(sorted(names))} "
                    f"still registered {shown:g}s after the kill (Ray releases a name "
                    f"once it has seen the actor dead; its node may be unreachable); call "
                    f"shutdown(wait=True) again")
            names = await detached(transport.runtime, transport.actor_names, left)


async def finish(future: asyncio.Future[Any]) -> tuple[Any, bool]:
    """Wait for ``future`` to end even if this task is cancelled meanwhile. Returns its
    result (or the exception it raised) and whether a cancellation came, for the caller
    to raise once it has acted on the result."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                cancelled = True
        except BaseException:
            break
    if future.cancelled():
        return asyncio.CancelledError(), True
    error = future.exception()
    return (error if error is not None else future.result()), cancelled
