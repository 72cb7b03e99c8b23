"""``RayEnvironmentCheckpoint``: the ``EnvironmentCheckpoint`` contract over Ray actors.

It keeps the contract and one operation skeleton that ``snapshot()`` and ``restored()``
share; what it says to the coordinator goes through ``nemo_ckpt.driver.link``, and
``check_startup``'s checks are ``nemo_ckpt.driver.startup``'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from nemo_ckpt import tracing
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.driver.holder_handles import HolderHandles
from nemo_ckpt.driver.link import NAME_RETRY_S, CoordinatorLink, finish
from nemo_ckpt.driver.snapshot import HeldBefore, RaySnapshot
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
    CheckpointPathError,
    HolderBusyError,
    NemoCkptError,
    SnapshotInProgressError,
    StartupCheckError,
    UncheckedSnapshotError,
)
from nemo_ckpt.interfaces import EnvironmentEpisode, RestoredEnvironmentRollouts
from nemo_ckpt.phases import HolderInfo
from nemo_ckpt.protocol.coordinator_api import SnapshotBegun
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.sessions import register_default_transport
from nemo_ckpt.storage.location import LocalLocation, join_location, levels_below, parse_location
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
        self._open: str | None = None
        self._closed: asyncio.Event | None = None  # set when the open operation ends
        self._restored_results: tuple[FinishedRollout, ...] = ()
        self._last_restore: dict[str, float | int] | None = None
        # What the last snapshot held (or the last restore made live), for the next
        # snapshot's warning about rollouts lost since (``HeldBefore``).
        self._held_before: HeldBefore | None = None
        self._link = CoordinatorLink(self.config, lambda: self._transport)
        self._coordinator = self._link.calls
        # Its own handles on the holders, to release them as a snapshot's block exits.
        self._holder_handles = HolderHandles(lambda: self._transport)

    @property
    def last_restore_metrics(self) -> dict[str, float | int] | None:
        """Figures of the last restore that went live (None before one did), seconds as
        floats, bytes and counts as ints: ``bytes_read``; ``read_seconds``, the slowest
        holder's shard reads (fetched, verified, decoded into sessions; the mirror of a
        snapshot's ``persist_seconds``); ``restore_seconds``, ``restored()`` entered ->
        sessions live; ``continued_rollouts``."""
        return None if self._last_restore is None else dict(self._last_restore)

    @property
    def restored_results(self) -> tuple[FinishedRollout, ...]:
        """The finished, unacknowledged rollouts the last restore brought back, with
        their results (``nemo_ckpt.receipts``); set when ``restored()`` yields, so RL
        reads them inside its block, and empty again if that restore fails. They are
        live again, finished, on their instances, and not in ``continued_attempts``: RL
        records the ones its restored ledger does not have as finished, then
        ``acknowledge``s every one."""
        return self._restored_results

    @property
    def open_operation(self) -> str | None:
        """The id of the snapshot or restore open now, if any (for logs and tests)."""
        return self._open

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
        return self._snapshot(checkpoint_path, stop=False, drain_timeout_s=None)

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
        return self._snapshot(checkpoint_path, stop=True, drain_timeout_s=drain_timeout_s)

    @contextlib.asynccontextmanager
    async def _snapshot(self, checkpoint_path: Path, stop: bool,
                        drain_timeout_s: float | None
                        ) -> AsyncIterator[Optional[RaySnapshot]]:
        path = self._checkpoint_location(checkpoint_path)  # a folder, or a URL
        clock = self._transport.runtime.clock
        started = clock.monotonic()
        async with self._operation("snapshot", path) as op, \
                self._span("nemo_ckpt.snapshot", op.id, path, stop=stop) as span:
            begun = await op.step(self._coordinator.begin_snapshot(
                op.id, path, drain_timeout_s, tracing.traceparent(), stop))
            snap = RaySnapshot(begun, self._held_before)
            # Not awaited, and it never raises: the writes overlap the caller's block.
            self._coordinator.start_writes(op.id)
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
            snap._record_commit(committed.metrics)
            tracing.set_attributes(span, sessions=snap.captured_rollouts,
                                   bytes=int(committed.metrics.get("bytes_written", 0)))
            self._held_before = snap.held()
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

    def _checkpoint_location(self, checkpoint_path: Path | str) -> str:
        """``checkpoint_path`` as the actors are handed it, or ``CheckpointPathError``:
        every node resolves it alike only when it is absolute, and the blob store and
        ``check_startup``'s probes are the root's, so it must lie below the root."""
        location = parse_location(checkpoint_path)
        text = str(location)
        if isinstance(location, LocalLocation) and not location.path.is_absolute():
            raise CheckpointPathError(
                text, f"checkpoint path {text!r} is relative: the holders on other nodes "
                      f"would resolve it against their own working directories; pass an "
                      f"absolute path (os.path.abspath)")
        root = self.config.checkpoint_root
        if root is not None and levels_below(root, text) is None:
            raise CheckpointPathError(
                text, f"checkpoint path {text} is not below CheckpointConfig.checkpoint_root "
                      f"{root}; pass a path below the root (one per checkpoint, e.g. "
                      f"{join_location(root, 'step-100')}), or set checkpoint_root to a "
                      f"folder that holds it")
        return text

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

    async def prefetch(self, checkpoint_path: Path) -> int:
        """Have the holders start reading and verifying the snapshot at
        ``checkpoint_path`` now, so that ``restored(checkpoint_path)`` finds its shards
        read (after a crash, while the rest of the job starts up). Returns once the reads
        have started, with how many shards they cover. It changes nothing a restore
        guarantees: nothing is installed, a restore of another snapshot drops these
        reads, one that failed is read again by the restore, and memory is bounded per
        holder. Raises as ``restored`` would for a path that holds no snapshot."""
        path = self._checkpoint_location(checkpoint_path)
        return await self._coordinator.prefetch_restore(path)

    @contextlib.asynccontextmanager
    async def restored(self, checkpoint_path: Path) -> AsyncIterator[RestoredEnvironmentRollouts]:
        """Restore every instance's sessions from ``checkpoint_path`` as next attempts.

        The snapshot is verified, every shard included, before any holder changes.
        Sessions go live on a clean exit; on an exception (or a cancellation, or a
        commit that failed on some holder) every holder drops them: all or nothing.
        """
        path = self._checkpoint_location(checkpoint_path)  # a folder, or a URL
        clock = self._transport.runtime.clock
        started = clock.monotonic()
        self._restored_results = ()  # a restore that fails hands nothing back
        async with self._operation("restore", None) as op, \
                self._span("nemo_ckpt.restore", op.id, path) as span:
            begun = await op.step(self._coordinator.prepare_restore(op.id, path,
                                                                    tracing.traceparent()))
            tracing.set_attributes(span, sessions=len(begun.continued_attempts),
                                   bytes=int(begun.bytes_read))
            self._restored_results = begun.finished
            try:
                yield RestoredEnvironmentRollouts(
                    continued_attempts=begun.continued_attempts,
                    staging_keys=begun.staging_keys)
                live = await op.commit(self._coordinator.commit_restore(op.id),
                                       lost=lambda: "all")
            except BaseException:
                self._restored_results = ()  # they did not go live
                raise
            self._held_before = HeldBefore(live=frozenset(
                (inst, EnvironmentEpisode(rid, att).next_attempt())
                for inst, rid, att in begun.continued_attempts))
            self._last_restore = {
                "bytes_read": int(begun.bytes_read), "read_seconds": begun.read_seconds,
                "restore_seconds": clock.monotonic() - started,
                "continued_rollouts": len(begun.continued_attempts)}
            log.info("restore %s from %s: %s sessions live", op.id, path, live)

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

    # --- the operation skeleton both share ------------------------------------------------

    @contextlib.asynccontextmanager
    async def _span(self, name: str, op_id: str, path: str, **attributes: Any
                    ) -> AsyncIterator[Any]:
        """The operation's root span (``nemo_ckpt.tracing``), entered and left in the
        caller's task, around the caller's block too."""
        with tracing.span(name, **{"operation.id": op_id, "path": path}, **attributes) as s:
            yield s

    @contextlib.asynccontextmanager
    async def _operation(self, kind: str, path: str | None) -> AsyncIterator[_Operation]:
        """One snapshot or restore: refused while another is open, given an id, its lease
        renewed from the start (phases and reads can be long), and aborted on every
        holder by whatever ends it early (``_Operation``'s steps)."""
        self._refuse_if_open(kind)
        op = _Operation(self._link.new_operation_id("snap" if kind == "snapshot"
                                                    else "restore"), path, self)
        self._set_open(op.id)
        try:
            async with self._link.renewing(op.id):
                try:
                    yield op
                except BaseException as exc:
                    if not op.ended:  # the caller's block, or a step before it, raised
                        await op.end(exc)
                    raise
        finally:
            self._set_open(None)

    # --- RL's ledger operations and introspection ----------------------------------------

    async def retire(self, episodes: Iterable[EnvironmentEpisode]) -> list[str]:
        """Drop these attempts' sessions and refuse their late turns (result consumed).

        Returns the capture keys dropped. Idempotent, so a coordinator or holder that is
        briefly unavailable is retried here before ``BackendUnavailableError`` escapes.
        """
        self._refuse_if_open("retire")
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
            while self._closed is not None:
                await self._closed.wait()
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
        self._refuse_if_open("forget")
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

    def _set_open(self, op_id: str | None) -> None:
        self._open = op_id
        if op_id is not None:
            self._closed = asyncio.Event()
        elif self._closed is not None:
            self._closed.set()
            self._closed = None

    def _refuse_if_open(self, what: str) -> None:
        if self._open is not None:
            raise SnapshotInProgressError(
                f"cannot {what} while {self._open} is open; finish its `async with` block "
                f"first")


class _Operation:
    """The steps of one open snapshot or restore (``RayEnvironmentCheckpoint._operation``):
    each ends the operation on every holder when it fails, once."""

    def __init__(self, op_id: str, path: str | None, owner: RayEnvironmentCheckpoint) -> None:
        self.id = op_id
        self.path = path  # a snapshot's; None for a restore
        self._owner = owner
        self.ended = False

    async def end(self, cause: BaseException) -> str | None:
        """Abort the operation everywhere; its outcome ("committed" if its commit won)."""
        self.ended = True
        return await self._owner._link.abort(self.id, self.path, cause)

    async def step(self, call: Awaitable[Any]) -> Any:
        """A phase before the caller's block; a failure aborts and propagates."""
        try:
            return await call
        except BaseException as exc:
            await self.end(exc)
            raise

    async def fail(self, error: BaseException) -> None:
        """Abort with ``error`` and raise it (a refusal after the caller's block)."""
        await self.end(error)
        raise error

    async def commit(self, call: Awaitable[Any], lost: Callable[[], Any],
                     beside: Callable[[], object] | None = None) -> Any:
        """The commit, shielded from this task's cancellation (raised after it), with
        ``beside`` sent once the commit has left. A commit that failed is aborted, and
        the abort's answer decides: the commit may have won after all (its reply was
        lost, or the coordinator died right after it), and then ``lost()`` stands for
        its answer. Otherwise every holder drops the operation and the error propagates."""
        commit = asyncio.ensure_future(call)
        if beside is not None:
            # After the commit's first step (queued first), which sends it.
            asyncio.get_running_loop().call_soon(beside)
        answer, cancelled = await finish(commit)  # the commit's call ends by its deadline
        if isinstance(answer, BaseException):
            outcome = await self.end(answer)
            if outcome != "committed":
                if cancelled:
                    raise asyncio.CancelledError()
                if outcome is None and getattr(answer, "timed_out", False):
                    raise _outcome_unknown(self.id, self.path, answer)
                raise answer
            log.warning("%s: its commit call failed (%s), but the commit won: its "
                        "outcome is committed", self.id, answer)
            answer = lost()
        if cancelled:
            raise asyncio.CancelledError()
        return answer


def _outcome_unknown(op_id: str, path: str | None, cause: BaseException) -> NemoCkptError:
    """The error of a commit that missed its deadline and whose abort could not learn
    its outcome either (a coordinator that does not answer): it may still commit."""
    if path is not None:
        what, then = (f"snapshot {op_id} into {path}", "Retry it (a snapshot into the "
                      "same path replaces it); `nemo-ckpt ls` shows what committed")
    else:
        what, then = (f"restore {op_id}", "Its sessions may go live: "
                      "`ckpt.holders()` shows them; retry once the coordinator answers")
    error = BackendUnavailableError(
        f"the commit of {what} got no answer by its deadline ({cause}), and the abort "
        f"that asks the coordinator for its outcome got none either: it may still "
        f"commit. {then}")
    error.unreachable, error.timed_out = "coordinator", True
    return error


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


@dataclass(frozen=True)
class _Committed:
    """A commit whose answer was lost, but which won (the abort said so)."""

    metrics: dict[str, float | int]


def ray_transport(config: CheckpointConfig) -> Transport:
    """Ray's transport for ``config``'s namespace (Ray is imported when first used)."""
    return runtime_transport(config, "ray")


# A worker's SessionClient.connect() without a transport reaches its holder over Ray; the
# core's sessions module does not import the Ray side itself.
register_default_transport(lambda namespace: ray_transport(CheckpointConfig(namespace=namespace)))
