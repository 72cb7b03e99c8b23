"""``RayEnvironmentCheckpoint``: the ``EnvironmentCheckpoint`` contract over Ray actors.

It keeps the contract, the restore and RL's ledger calls; a snapshot runs in
``nemo_ckpt.driver.snapshot_operation``, and both open their operation through the
skeleton they share, ``nemo_ckpt.driver.operation``. What it says to the coordinator
goes through ``nemo_ckpt.driver.link``, and ``check_startup``'s checks are
``nemo_ckpt.driver.startup``'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
from collections.abc import Callable, Coroutine, Generator, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from nemo_ckpt import tracing
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.driver.holder_handles import HolderHandles
from nemo_ckpt.driver.link import NAME_RETRY_S, CoordinatorLink
from nemo_ckpt.driver.operation import OpenOperations
from nemo_ckpt.driver.restore_operation import RestoreOperation
from nemo_ckpt.driver.snapshot import RaySnapshot
from nemo_ckpt.driver.snapshot_operation import SnapshotOperation
from nemo_ckpt.driver.startup import (
    Findings,
    container_findings,
    deadline_findings,
    holder_findings,
    sandbox_findings,
    storage_findings,
)
from nemo_ckpt.errors import (
    BackendUnavailableError,
    HolderBusyError,
    NemoCkptError,
    StartupCheckError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode, RestoredEnvironmentRollouts
from nemo_ckpt.phases import HolderInfo
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.sessions import register_default_transport
from nemo_ckpt.transport import Transport, detached, runtime_transport

__all__ = ["RayEnvironmentCheckpoint", "ShutdownStarted", "ray_transport"]

log = logging.getLogger("nemo_ckpt")


class RayEnvironmentCheckpoint:
    """Turn-level recovery for an environment backend whose sessions live in holders.

    One ``CheckpointCoordinator`` actor (named, in ``config.namespace``) fans every
    phase out to one ``SessionHolder`` per node. Environment workers reach their
    node's holder through ``nemo_ckpt.SessionClient``.

    Call order for a snapshot::

        async with ckpt.snapshot(path) as snapshot:            # holders paused, captured
            async with data_plane_barrier.checkpoint() as cut:  # RL's data plane frozen
                if snapshot is not None:
                    await snapshot.check_against_cut(cut)
                ...                                              # RL saves; shards persist
        # clean exit: every shard durable, manifest.json written, holders resumed
        # exception: holders resumed, this snapshot's files deleted, error re-raised

    and for a restore::

        async with ckpt.restored(path) as restored:   # verified and loaded, not yet live
            ...                                        # RL restores its data plane
        # clean exit: restored sessions live; exception: every holder drops them

    Between the two, ``retire`` and ``forget`` serve RL's ledger; both are refused
    while a snapshot or restore is open. Only one snapshot or restore is open at a time.
    What each of these calls asks of the coordinator, in order: ``CoordinatorApi``.
    """

    def __init__(self, config: CheckpointConfig | None = None,
                 transport: Transport | None = None) -> None:
        """``transport`` defaults to Ray's (``actors.ray_transport.RayTransport``), made
        on first use; the simulation passes its own."""
        self.config = config or CheckpointConfig()
        self._transport_ = transport
        if self.config.trace_file is not None:
            tracing.write_spans_to(str(self.config.trace_file))
        self._link = CoordinatorLink(self.config, lambda: self._transport)
        self._coordinator = self._link.calls
        # Its own handles on the holders, to release them as a snapshot's block exits.
        self._holder_handles = HolderHandles(lambda: self._transport)
        # The one snapshot or restore open at a time, and the snapshots run through it.
        self._ops = OpenOperations(self._link)
        self._snapshots = SnapshotOperation(self.config, self._link, self._holder_handles,
                                            self._ops, lambda: self._transport)
        self._restores = RestoreOperation(self.config, self._link, self._ops,
                                          lambda: self._transport, self._snapshots.live_now)

    @property
    def last_restore_metrics(self) -> dict[str, float | int] | None:
        """Figures of the last restore that went live (None before one did), seconds as
        floats, bytes and counts as ints: ``bytes_read``; ``read_seconds``, the slowest
        holder's shard reads (fetched, verified, decoded into sessions; the mirror of a
        snapshot's ``persist_seconds``); ``restore_seconds``, ``restored()`` entered ->
        sessions live; ``continued_rollouts``."""
        last = self._restores.last_metrics
        return None if last is None else dict(last)

    @property
    def restored_results(self) -> tuple[FinishedRollout, ...]:
        """The finished, unacknowledged rollouts the last restore brought back, with
        their results (``nemo_ckpt.receipts``); set when ``restored()`` yields, so RL
        reads them inside its block, and empty again if that restore fails. They are
        live again, finished, on their instances, and not in ``continued_attempts``: RL
        records the ones its restored ledger does not have as finished, then
        ``acknowledge``s every one."""
        return self._restores.results

    @property
    def open_operation(self) -> str | None:
        """The id of the snapshot or restore open now, if any (for logs and tests)."""
        return self._ops.current

    # --- the contract --------------------------------------------------------------------

    @property
    def holds_rollout_state(self) -> bool:
        """True: holders keep sessions between turns, so snapshots must capture them."""
        return True

    async def check_startup(self) -> None:
        """Refuse a deployment that cannot recover; warn where recovery will be partial.

        Checks that every alive node has a holder that answers, that every holder can
        write under ``config.checkpoint_root`` and the driver can read what they wrote
        (a shared filesystem), that every holder can keep sandboxes' files under
        ``config.sandbox_root`` when it is set, that every holder's node can record
        containers when ``config.containers`` is on (and says where CRIU does not work:
        filesystems only there), and that the deadlines can work.
        """
        found = Findings()
        holders = await self.ensure_holders()
        holder_findings(found, holders, set(self._transport.alive_nodes()))
        found.warnings.extend(await self._coordinator.startup_warnings())
        root = self.config.checkpoint_root
        if root is None:
            found.warnings.append("config.checkpoint_root is not set, so nothing checked that "
                                  "every holder can write checkpoints where the driver "
                                  "reads them")
        else:
            storage_findings(found, str(root),
                             await self._coordinator.probe_storage(str(root)))
        if self.config.sandbox_root is not None:
            sandbox_findings(found, await self._coordinator.probe_sandboxes())
        if self.config.containers:
            container_findings(found, await self._coordinator.probe_containers())
        deadline_findings(found, self.config)
        for w in found.warnings:
            log.warning("check_startup: %s", w)
        if found.problems:
            raise StartupCheckError(
                "this deployment cannot recover as configured:\n"
                + "\n".join(f"  - {p}" for p in found.problems))

    def snapshot(self, checkpoint_path: Path
                 ) -> contextlib.AbstractAsyncContextManager[Optional[RaySnapshot]]:
        """Pause every holder and save its sessions under ``checkpoint_path``.

        Yields ``None`` when no holder has a session (an empty manifest still commits).
        A snapshot into a path that holds an older one replaces it atomically: the new
        manifest's rename is the commit point, and the older shards go only after it.

        Whatever ends the block (an exception, a cancellation, a failed
        ``check_against_cut`` even if the caller caught it) aborts the snapshot on every
        holder before the error propagates. The commit, once started, runs to its end
        even if this task is cancelled meanwhile (the cancellation is raised after it):
        a commit is never torn by an abort.
        """
        return self._snapshots.run(checkpoint_path, stop=False, drain_timeout_s=None)

    def final_snapshot(self, checkpoint_path: Path, *, drain_timeout_s: float | None = None
                       ) -> contextlib.AbstractAsyncContextManager[Optional[RaySnapshot]]:
        """A job told to stop: ``snapshot`` (the same block, the same check against
        RL's cut), whose commit parks every session once the manifest is durable.

        A session still mid-turn at the drain deadline is captured as of its last
        committed turn (not restarted, as a periodic snapshot's is): the turn in flight
        runs again after the restore, and its commit waits for this snapshot's end,
        refused once it parked the session. No holder resumes before the commit; then
        each drops its sessions, removes their containers, sweeps their blobs from its
        node's cache, and refuses new sessions and turns with ``JobStoppedError`` until
        a restore (from this snapshot) commits. ``drain_timeout_s`` shortens the wait for turns in
        flight below ``CheckpointConfig.drain_timeout_s`` (a preemption's deadline:
        ``nemo_ckpt.driver.preemption``). A snapshot that fails or is aborted parks
        nothing: the holders resume as after any failed snapshot."""
        return self._snapshots.run(checkpoint_path, stop=True,
                                   drain_timeout_s=drain_timeout_s)

    async def prefetch(self, checkpoint_path: Path) -> int:
        """Have the holders start reading and verifying the snapshot at
        ``checkpoint_path`` now, so that ``restored(checkpoint_path)`` finds its shards
        read (after a crash, while the rest of the job starts up). Returns once the reads
        have started, with how many shards they cover. It changes nothing a restore
        guarantees: nothing is installed, a restore of another snapshot drops these
        reads, one that failed is read again by the restore, and memory is bounded per
        holder. Raises as ``restored`` would for a path that holds no snapshot."""
        return await self._restores.prefetch(checkpoint_path)

    def restored(self, checkpoint_path: Path
                 ) -> contextlib.AbstractAsyncContextManager[RestoredEnvironmentRollouts]:
        """Restore every instance's sessions from ``checkpoint_path`` as next attempts.

        The snapshot is verified, every shard included, before any holder changes.
        Sessions go live on a clean exit; on an exception (or a cancellation, or a
        commit that failed on some holder) every holder drops them: all or nothing.
        """
        return self._restores.run(checkpoint_path)

    def is_unavailable(self, error: BaseException) -> bool:
        """True only for a failure that left nothing RL holds changed and goes away by
        itself: a holder or the coordinator unreachable, dead or late, a lease that
        lapsed while something stalled, a holder busy with another operation. It reads
        each error class's ``retriable`` (listed in docs/FAILURES.md)."""
        if isinstance(error, NemoCkptError):
            return error.retriable
        if "ray" not in sys.modules:  # only Ray's own errors are left to look at
            return False
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        if isinstance(error, RayTaskError):
            cause = error.cause
            return isinstance(cause, BaseException) and cause is not error \
                and self.is_unavailable(cause)
        return isinstance(error, (RayActorError, GetTimeoutError))

    # --- RL's ledger operations and introspection ----------------------------------------

    async def retire(self, episodes: Iterable[EnvironmentEpisode]) -> list[str]:
        """Drop these attempts' sessions and refuse their late turns (result consumed).

        Returns the capture keys dropped. Idempotent, so a coordinator or holder that is
        briefly unavailable is retried here before ``BackendUnavailableError`` escapes.
        """
        self._ops.refuse_if_open("retire")
        return await self._link.ledger_op("retire", list(episodes))

    async def acknowledge(self, episodes: Iterable[EnvironmentEpisode]) -> list[str]:
        """RL has durably recorded these finished rollouts: drop their sessions and
        results (``nemo_ckpt.receipts``). Returns the capture keys dropped.

        Unlike ``retire`` it needs no lock against snapshots: while a snapshot or
        restore is open on this driver it waits for its end, and a holder busy with one
        is retried until the operation's lease would have ended it."""
        episodes = list(episodes)
        clock = self._transport.runtime.clock
        deadline: float | None = None  # from the first busy holder, not while we wait
        while True:
            await self._ops.wait_closed()
            try:
                return await self._link.ledger_op("retire", episodes)
            except HolderBusyError:
                now = clock.monotonic()
                deadline = now + self._link.name_wait_s if deadline is None else deadline
                if now >= deadline:
                    raise
            await asyncio.sleep(NAME_RETRY_S)

    async def forget(self, episodes: Iterable[EnvironmentEpisode]) -> list[str]:
        """Drop these attempts' sessions and their refusals. Retried like ``retire``."""
        self._ops.refuse_if_open("forget")
        return await self._link.ledger_op("forget", list(episodes))

    async def holders(self) -> list[HolderInfo]:
        """Every live holder: instance, node, state, sessions, lease."""
        return await self._coordinator.holder_infos()

    async def draining_holders(self) -> list[HolderInfo]:
        """The holders whose node the cluster announced it drains (Ray's
        ``drain-node``, a preemption to come), each with its node's ``drain_deadline``
        when the drain has one: what ``nemo_ckpt.Preemption`` watches. One look at the
        cluster's drains when nothing drains."""
        draining: dict[str, float | None] = await detached(
            self._transport.runtime, self._transport.draining_nodes)
        if not draining:
            return []
        return [replace(h, drain_deadline=draining[h.node_id])
                for h in await self.holders() if h.node_id in draining]

    async def ensure_holders(self) -> list[HolderInfo]:
        """Create the coordinator and a holder on every alive node that lacks one."""
        holders = await self._coordinator.ensure_holders()
        self._holder_handles.learn(h.instance_id for h in holders)
        return holders

    def shutdown(self, wait: bool = False, timeout_s: float = 30.0) -> ShutdownStarted:
        """Kill the coordinator and every holder of this namespace (their sessions go).

        The kill is started by the call itself, awaited or not: a plain
        ``ckpt.shutdown()`` at the end of a job is enough (what it returns, dropped
        unawaited, waits for the kill to be sent). Ray releases the actors' names a
        moment later, and until then a new coordinator or holder of the namespace cannot
        take them. What it returns may be awaited in every form: ``await
        ckpt.shutdown()`` returns once the kill is sent; ``await
        ckpt.shutdown(wait=True)`` returns once every name is released, before a
        restarted driver's ``check_startup`` and restore, and raises
        ``BackendUnavailableError`` naming the actors still registered after
        ``timeout_s`` (their node may be unreachable; retry). Not awaited, it waits for
        no release and warns nothing.

        Every call to the cluster here is bounded by ``timeout_s``, the kill included: a
        cluster whose control plane is gone (a signal to the whole process group ends
        the local raylet and GCS too) never answers them. Then the kill gives up after
        ``timeout_s`` with one warning, and ``wait=True`` raises
        ``BackendUnavailableError`` saying so. Awaited, the calls are waited for off the
        event loop, whose other tasks (a preemption's signal handlers) run meanwhile;
        each runs on a thread that nothing waits for at exit (``Runtime.detach``)."""
        transport = self._transport
        clock = transport.runtime.clock
        deadline = clock.monotonic() + timeout_s
        kill = transport.runtime.detach(transport.kill_namespace, timeout_s)
        until_gone = (lambda: self._link.until_gone(deadline - clock.monotonic(), timeout_s)) \
            if wait else None
        return ShutdownStarted(kill, until_gone, self.config.namespace, timeout_s)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` off the event loop, as this job's runtime runs file work (a
        thread; inline in the simulation): the rollout checkpoint manager's and the NeMo
        RL integration's reads of the catalog go through it."""
        return await self._transport.runtime.run_blocking(fn, *args)

    # --- internals ------------------------------------------------------------------------

    @property
    def _transport(self) -> Transport:
        if self._transport_ is None:
            self._transport_ = ray_transport(self.config)
        return self._transport_


class ShutdownStarted:
    """What ``RayEnvironmentCheckpoint.shutdown`` returns, its kill already started: an
    awaitable that waits off the loop for the kill, then for the names' release when
    ``wait=True`` asked for it. The wait's coroutine is made only when awaited, so a
    call left unawaited leaves none behind ("coroutine ... was never awaited"); such a
    call waits for its kill as it is dropped (``ckpt.shutdown()`` as a statement: before
    the caller's next line, a ``ray.shutdown()`` say), as the synchronous call it reads as.
    """

    def __init__(self, kill: concurrent.futures.Future[None],
                 until_gone: Callable[[], Coroutine[Any, Any, None]] | None,
                 namespace: str, timeout_s: float) -> None:
        self._kill = kill
        self._until_gone = until_gone
        self._namespace = namespace
        # The kill gives up by itself after timeout_s; the margin: its thread's handover.
        self._join_s = timeout_s + _KILL_HANDOVER_S
        self._awaited = False

    def __await__(self) -> Generator[Any, None, None]:
        self._awaited = True
        return self._finish().__await__()

    async def _finish(self) -> None:
        try:
            if not self._kill.done():
                await asyncio.wrap_future(self._kill)
            self._kill.result()
        except BackendUnavailableError as exc:
            if self._until_gone is not None:
                raise
            self._warn(exc)
            return
        if self._until_gone is not None:
            await self._until_gone()

    def _warn(self, error: BaseException | str) -> None:
        log.warning("shutdown of namespace %s: %s", self._namespace, error)

    def __del__(self) -> None:
        if self._awaited:
            return
        try:
            self._kill.result(timeout=self._join_s)
        except concurrent.futures.TimeoutError:
            self._warn(f"the kill did not end within {self._join_s:g}s")
        except Exception as exc:  # nowhere to raise it: a destructor
            self._warn(exc)


# How long past its timeout_s an unawaited shutdown waits for its kill's thread to say
# that it gave up (a thread cut off by the interpreter's exit never says so).
_KILL_HANDOVER_S = 1.0


def ray_transport(config: CheckpointConfig) -> Transport:
    """Ray's transport for ``config``'s namespace (Ray is imported when first used)."""
    return runtime_transport(config, "ray")


# A worker's SessionClient.connect() without a transport reaches its holder over Ray; the
# core's sessions module does not import the Ray side itself.
register_default_transport(lambda namespace: ray_transport(CheckpointConfig(namespace=namespace)))
