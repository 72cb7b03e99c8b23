"""``RayEnvironmentCheckpoint``: the ``EnvironmentCheckpoint`` contract over Ray actors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, overload

from nemo_ckpt.checkpoint_folder import PROBE_DIR, folder_at
from nemo_ckpt.config import CheckpointConfig
from nemo_ckpt.coordinator_api import CoordinatorCalls, SnapshotBegun
from nemo_ckpt.cut import CutCheckResult, DataPlaneMutationCut, check_rows_against_cut
from nemo_ckpt.errors import (
    BackendUnavailableError,
    CheckpointPathError,
    HolderBusyError,
    NemoCkptError,
    SnapshotInProgressError,
    StartupCheckError,
    UncheckedSnapshotError,
)
from nemo_ckpt.holder_handles import HolderHandles
from nemo_ckpt.interfaces import EnvironmentEpisode, RestoredEnvironmentRollouts
from nemo_ckpt.location import LocalLocation, join_location, levels_below, parse_location
from nemo_ckpt.operations import new_operation_id
from nemo_ckpt.path_claims import advisory_claims_warning
from nemo_ckpt.phases import HolderInfo, HolderState
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.sessions import register_default_transport
from nemo_ckpt.transport import COORDINATOR, Transport

__all__ = ["RayEnvironmentCheckpoint", "RaySnapshot", "ray_transport"]

log = logging.getLogger("nemo_ckpt")
# retire/forget are idempotent: a restarted coordinator or a lost holder is retried.
_LEDGER_OP_TRIES = 4
# How often a call looks the coordinator's name up again while it resolves to the dead.
_NAME_RETRY_S = 0.25
# How often shutdown(wait=True) looks whether Ray has released the names.
_GONE_POLL_S = 0.1
# Calls whose outcome, when the coordinator died under them, only the abort can tell.
_OUTCOME_CALLS = frozenset({"commit_snapshot", "commit_restore"})


class RaySnapshot:
    """The backend's half of one snapshot, as aggregated over every holder.

    Implements ``EnvironmentSnapshot``. Its figures grow as the snapshot proceeds:
    persist seconds and bytes written are known once the context has exited.
    """

    def __init__(self, begun: Any) -> None:
        self.snapshot_id: str = begun.snapshot_id
        self._begun = begun
        self.check_result: CutCheckResult | None = None
        # The error of a check that refused this snapshot: it can no longer commit,
        # even if the caller catches the error inside the block.
        self.refused: BaseException | None = None
        self._committed: dict[str, float] = {}
        self._captured: dict[str, dict[EnvironmentEpisode, frozenset[str]]] | None = None

    @property
    def restarted_rollouts(self) -> int:
        """Sessions mid-turn at the drain deadline: not captured, they restart after a crash."""
        return sum(len(c.restarting) for c in self._begun.captures)

    @property
    def captured_rollouts(self) -> int:
        """How many sessions the snapshot holds."""
        return sum(c.captured_count for c in self._begun.captures)

    def captured(self) -> dict[str, dict[EnvironmentEpisode, frozenset[str]]]:
        """Per instance, each captured episode and the staging keys it references."""
        if self._captured is None:  # decoded once, on first use, not on the pause's path
            self._captured = {
                c.instance_id: {EnvironmentEpisode(rid, att): frozenset(keys)
                                for rid, att, keys, _turns in c.captured()}
                for c in self._begun.captures
            }
        return {inst: dict(eps) for inst, eps in self._captured.items()}

    def restarting(self) -> dict[str, frozenset[EnvironmentEpisode]]:
        """Per instance, the episodes held mid-turn at the drain deadline."""
        return {c.instance_id: frozenset(EnvironmentEpisode(r, a) for r, a in c.restarting)
                for c in self._begun.captures}

    async def check_against_cut(self, cut: DataPlaneMutationCut) -> None:
        """Require the capture to match RL's ledger and staging rows at ``cut``.

        Raises ``SnapshotMismatchError`` listing every difference; the snapshot then
        does not commit, even if the caller catches the error: the exit raises it
        again. Expected rollouts the backend does not hold are counted in
        ``metrics()["not_held_rollouts"]`` and logged as a warning: they restart.
        """
        try:
            result = check_rows_against_cut(
                cut, {c.instance_id: c.rows() for c in self._begun.captures},
                {c.instance_id: c.restarting for c in self._begun.captures})
        except BaseException as exc:
            self.refused = exc
            raise
        self.check_result = result
        if result.not_held:
            shown = ", ".join(f"{i}/{ep.capture_key}" for i, ep in sorted(result.not_held)[:10])
            log.warning(
                "snapshot %s: %d rollout(s) RL expects are not held by the environment "
                "(not opened yet, or lost with a node); they restart after a crash: %s%s",
                self.snapshot_id, len(result.not_held), shown,
                " ..." if len(result.not_held) > 10 else "")
        if result.orphan_staging_keys:
            shown = ", ".join(sorted(result.orphan_staging_keys)[:10])
            log.warning(
                "snapshot %s: the cut holds %d staging row(s) that no captured session "
                "references; a restore from this snapshot clears them: %s%s. Outside the "
                "rows of rollouts mid-turn at the drain deadline (%d here), this usually "
                "means RL's data plane leaves a finished rollout's rows in staging: "
                "recording a rollout as finished must move its rows out of staging (the "
                "README's ledger rules)", self.snapshot_id, len(result.orphan_staging_keys),
                shown, " ..." if len(result.orphan_staging_keys) > 10 else "",
                len(result.restarting))

    def metrics(self, paused_seconds: float) -> dict[str, float]:
        """Figures for this snapshot, in seconds, bytes and counts."""
        b = self._begun
        figures = {
            "paused_seconds": float(paused_seconds),
            "entry_seconds": b.entry_seconds,
            "drain_seconds": max((p.drain_seconds for p in b.pauses), default=0.0),
            "capture_seconds": max((c.capture_seconds for c in b.captures), default=0.0),
            "persist_seconds": 0.0,
            "bytes_written": 0.0,
            "captured_rollouts": float(self.captured_rollouts),
            "restarted_rollouts": float(self.restarted_rollouts),
            "holders": float(len(b.instances)),
            "state_bytes": float(sum(c.state_bytes for c in b.captures)),
            # Since each holder started (nemo_ckpt.adapters: a replay that diverged).
            "replay_restarted_rollouts": float(sum(c.replay_restarts for c in b.captures)),
        }
        if self.check_result is not None:
            figures["not_held_rollouts"] = float(len(self.check_result.not_held))
            figures["orphan_staging_rows"] = float(len(self.check_result.orphan_staging_keys))
            figures["finished_rollouts"] = float(len(self.check_result.finished))
        figures.update(self._committed)
        return figures

    def _record_commit(self, manifest_metrics: dict[str, float]) -> None:
        for key in ("persist_seconds", "bytes_written"):
            if key in manifest_metrics:
                self._committed[key] = manifest_metrics[key]


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
    """

    def __init__(self, config: CheckpointConfig | None = None,
                 transport: Transport | None = None) -> None:
        """``transport`` defaults to Ray's (``actors.ray_transport.RayTransport``), made
        on first use; the simulation passes its own."""
        self.config = config or CheckpointConfig()
        self._transport_ = transport
        self._open: str | None = None
        self._closed: asyncio.Event | None = None  # set when the open operation ends
        self._restored_results: tuple[FinishedRollout, ...] = ()
        self._driver_id: str | None = None  # names this driver in its operation ids
        self._sequence = 0
        self._last_restore: dict[str, float] | None = None
        self._attached = False  # whether the coordinator has compared our config
        self._coordinator = CoordinatorCalls(
            self._call, lambda method, *args: self._transport.send(
                self._transport.coordinator(), method, *args))
        # Its own handles on the holders, to release them as a snapshot's block exits.
        self._holder_handles = HolderHandles(lambda: self._transport)

    @property
    def last_restore_metrics(self) -> dict[str, float] | None:
        """Figures of the last restore that went live (None before one did), in seconds,
        bytes and counts: ``bytes_read``; ``read_seconds``, the slowest holder's shard
        reads (fetched, verified, decoded into sessions; the mirror of a snapshot's
        ``persist_seconds``); ``restore_seconds``, ``restored()`` entered -> sessions live;
        ``continued_rollouts``."""
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
        ``config.sandbox_root`` when it is set, and that the deadlines can work.
        """
        problems: list[str] = []
        warnings: list[str] = []
        holders = await self._coordinator.ensure_holders()
        self._holder_handles.learn(h.instance_id for h in holders)
        alive = set(self._transport.alive_nodes())
        hosted = {h.node_id for h in holders}
        for node in sorted(alive - hosted):
            problems.append(f"node {node} has no session holder that answers; its "
                            f"environment workers' sessions could not be saved")
        for h in holders:
            if h.state is not HolderState.RUNNING:
                warnings.append(f"{h.instance_id} is {h.state.value} for {h.operation_id}")
        per_node: dict[str, list[str]] = {}
        for h in holders:
            per_node.setdefault(h.node_id, []).append(h.instance_id)
        for node, insts in sorted(per_node.items()):
            if len(insts) > 1:
                warnings.append(f"node {node} hosts {len(insts)} instances ({insts}); "
                                f"losing it loses all their rollouts at once")
        root = self.config.checkpoint_root
        if root is None:
            warnings.append("config.checkpoint_root is not set, so nothing checked that "
                            "every holder can write checkpoints where the driver reads them")
        else:
            probes = await self._coordinator.probe_storage(str(root))
            for inst, result in sorted(probes.items()):
                if result.startswith("error: "):
                    problems.append(f"{inst} cannot write under {root}: {result[7:]}")
                    continue
                path = result
                probes_folder = folder_at(join_location(root, PROBE_DIR))
                name = result.rsplit("/", 1)[-1]
                try:
                    content = probes_folder.read(name).decode(errors="replace")
                    probes_folder.remove([name])
                except (OSError, ValueError):
                    problems.append(
                        f"{inst} wrote {path} but the driver cannot read it: {root} is not "
                        f"shared between the holders' nodes and the driver; use a shared "
                        f"filesystem or a bucket every node and the driver reach")
                    continue
                if not content.startswith(inst + " "):
                    problems.append(f"{path} holds {content!r}, not {inst}'s probe")
            if isinstance(parse_location(root), LocalLocation):
                with contextlib.suppress(OSError):
                    (Path(root) / PROBE_DIR).rmdir()
            elif not problems:
                try:
                    advisory = advisory_claims_warning(folder_at(join_location(root,
                                                                               PROBE_DIR)))
                except (OSError, NemoCkptError) as exc:
                    problems.append(f"the driver cannot write under {root}: {exc}")
                else:
                    if advisory:
                        warnings.append(advisory)
        if self.config.sandbox_root is not None:
            for _, result in sorted((await self._coordinator.probe_sandboxes()).items()):
                if result:
                    problems.append(result[7:])
        cfg = self.config
        if cfg.phase_timeout_s < cfg.renew_interval_s:
            warnings.append(f"phase_timeout_s ({cfg.phase_timeout_s}) is shorter than the "
                            f"lease renewal period ({cfg.renew_interval_s})")
        for w in warnings:
            log.warning("check_startup: %s", w)
        if problems:
            raise StartupCheckError(
                "this deployment cannot recover as configured:\n"
                + "\n".join(f"  - {p}" for p in problems))

    @contextlib.asynccontextmanager
    async def snapshot(self, checkpoint_path: Path) -> AsyncIterator[Optional[RaySnapshot]]:
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
        path = self._checkpoint_location(checkpoint_path)  # a folder, or a URL
        self._refuse_if_open("snapshot")
        snapshot_id = self._new_operation_id("snap")
        self._set_open(snapshot_id)
        clock = self._transport.runtime.clock
        started = clock.monotonic()
        try:
            async with self._renewing(snapshot_id):  # from the start: phases can be long
                try:
                    begun = await self._coordinator.begin_snapshot(snapshot_id, path)
                except BaseException as exc:
                    await self._abort(snapshot_id, path, exc)
                    raise
                snap = RaySnapshot(begun)
                # Not awaited, and it never raises: the writes overlap the caller's block.
                self._coordinator.start_writes(snapshot_id)
                self._holder_handles.prepare(begun)  # in the background, for the exit
                given = snap if snap.captured_rollouts or snap.restarted_rollouts else None
                try:
                    yield given
                except BaseException as exc:
                    await self._abort(snapshot_id, path, exc)
                    raise
                refused = snap.refused or self._unchecked(snap, given is not None, path)
                if refused is not None:  # a check that raised (caught) or never ran
                    await self._abort(snapshot_id, path, refused)
                    raise refused
                # The manifest carries what is known at commit; paused time ends at resume.
                metrics = snap.metrics(clock.monotonic() - started)
                committed = await self._commit_snapshot(snapshot_id, path, metrics,
                                                        snap.restarted_rollouts, begun)
            snap._record_commit(committed.metrics)
            log.info("snapshot %s committed: %d rollouts, %d restarted, %.0f bytes, "
                     "paused %.3fs", snapshot_id, snap.captured_rollouts,
                     snap.restarted_rollouts, committed.metrics.get("bytes_written", 0.0),
                     clock.monotonic() - started)
        finally:
            self._set_open(None)

    def _release_holders(self, begun: SnapshotBegun) -> int:
        """Release the holders ``begun`` paused, from here: their gates open one hop
        sooner than by the coordinator's release, which still follows
        (``nemo_ckpt.holder_handles``). Returns how many releases were sent."""
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

    async def _commit_snapshot(self, snapshot_id: str, path: str, metrics: dict[str, float],
                               restarted: int, begun: SnapshotBegun) -> Any:
        """Commit, shielded from this task's cancellation, and release the holders
        beside it. A commit that failed is aborted, and the abort's answer decides: the
        commit may have won after all (its coordinator died right after the manifest's
        rename)."""
        commit = asyncio.ensure_future(
            self._coordinator.commit_snapshot(snapshot_id, path, metrics, restarted))
        # After the commit's first step (queued first), which sends it: the coordinator
        # starts its own releases meanwhile, and each holder resumes at the sooner one.
        asyncio.get_running_loop().call_soon(self._release_holders, begun)
        answer, cancelled = await _finish(commit)
        if isinstance(answer, BaseException):
            outcome = await self._abort(snapshot_id, path, answer)
            if outcome != "committed":
                if cancelled:
                    raise asyncio.CancelledError()
                raise answer
            log.warning("snapshot %s: its commit call failed (%s), but the commit won: "
                        "the manifest names it", snapshot_id, answer)
            answer = _Committed(dict(metrics))
        if cancelled:
            raise asyncio.CancelledError()
        return answer

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
        self._refuse_if_open("restore")
        restore_id = self._new_operation_id("restore")
        self._set_open(restore_id)
        self._restored_results = ()  # a restore that fails hands nothing back
        clock = self._transport.runtime.clock
        started = clock.monotonic()
        try:
            async with self._renewing(restore_id):  # from the start: reads can be long
                try:
                    begun = await self._coordinator.prepare_restore(restore_id, path)
                except BaseException as exc:
                    await self._abort(restore_id, None, exc)
                    raise
                self._restored_results = begun.finished
                try:
                    yield RestoredEnvironmentRollouts(
                        continued_attempts=begun.continued_attempts,
                        staging_keys=begun.staging_keys)
                except BaseException as exc:
                    self._restored_results = ()
                    await self._abort(restore_id, None, exc)
                    raise
                live, cancelled = await _finish(asyncio.ensure_future(
                    self._coordinator.commit_restore(restore_id)))
                if isinstance(live, BaseException):
                    # Some holders may have gone live: the abort makes them drop it again,
                    # unless the commit won (only its answer was lost): then it stands.
                    outcome = await self._abort(restore_id, None, live)
                    if outcome != "committed":
                        self._restored_results = ()
                        if cancelled:
                            raise asyncio.CancelledError()
                        raise live
                    log.warning("restore %s: its commit call failed (%s), but the commit "
                                "won: its sessions are live", restore_id, live)
                    live = len(begun.continued_attempts)
                if cancelled:
                    raise asyncio.CancelledError()
            self._last_restore = {
                "bytes_read": float(begun.bytes_read), "read_seconds": begun.read_seconds,
                "restore_seconds": clock.monotonic() - started,
                "continued_rollouts": float(len(begun.continued_attempts))}
            log.info("restore %s from %s: %d sessions live", restore_id, path, live)
        finally:
            self._set_open(None)

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
        self._refuse_if_open("retire")
        return await self._ledger_op("retire", list(episodes))

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
                return await self._ledger_op("retire", episodes)
            except HolderBusyError:
                now = clock.monotonic()
                deadline = now + self._name_wait_s if deadline is None else deadline
                if now >= deadline:
                    raise
            await asyncio.sleep(_NAME_RETRY_S)

    async def forget(self, episodes: Iterable[EnvironmentEpisode]) -> list[str]:
        """Drop these attempts' sessions and their refusals. Retried like ``retire``."""
        self._refuse_if_open("forget")
        return await self._ledger_op("forget", list(episodes))

    async def _ledger_op(self, op: str, episodes: list[EnvironmentEpisode]) -> list[str]:
        call = self._coordinator.retire if op == "retire" else self._coordinator.forget
        for attempt in range(_LEDGER_OP_TRIES):
            try:
                return await call(episodes)
            except BackendUnavailableError:
                if attempt == _LEDGER_OP_TRIES - 1:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    async def holders(self) -> list[HolderInfo]:
        """Every live holder: instance, node, state, sessions, lease."""
        return await self._coordinator.holder_infos()

    async def ensure_holders(self) -> list[HolderInfo]:
        """Create the coordinator and a holder on every alive node that lacks one."""
        holders = await self._coordinator.ensure_holders()
        self._holder_handles.learn(h.instance_id for h in holders)
        return holders

    @overload
    def shutdown(self, wait: Literal[False] = False) -> None: ...

    @overload
    def shutdown(self, wait: Literal[True], timeout_s: float = 30.0) -> Awaitable[None]: ...

    def shutdown(self, wait: bool = False, timeout_s: float = 30.0) -> Awaitable[None] | None:
        """Kill the coordinator and every holder of this namespace (their sessions go).

        The kill is sent at once; Ray releases the actors' names a moment later, and
        until then a new coordinator or holder of the namespace cannot take them. With
        ``wait=True`` this returns an awaitable that ends once every name is released:
        ``await ckpt.shutdown(wait=True)`` before a restarted driver's ``check_startup``
        and restore. It raises ``BackendUnavailableError`` naming the actors still
        registered after ``timeout_s`` (their node may be unreachable; retry)."""
        self._transport.kill_namespace()
        return self._until_gone(timeout_s) if wait else None

    async def _until_gone(self, timeout_s: float) -> None:
        transport = self._transport
        clock = transport.runtime.clock
        deadline = clock.monotonic() + timeout_s
        while names := transport.actor_names():
            if clock.monotonic() >= deadline:
                raise BackendUnavailableError(
                    f"shutdown of namespace {transport.namespace}: {', '.join(sorted(names))} "
                    f"still registered {timeout_s:g}s after the kill (Ray releases a name "
                    f"once it has seen the actor dead; its node may be unreachable); call "
                    f"shutdown(wait=True) again")
            transport.kill_namespace()  # one created meanwhile by a straggling call
            await asyncio.sleep(_GONE_POLL_S)

    # --- internals ------------------------------------------------------------------------

    @property
    def _transport(self) -> Transport:
        if self._transport_ is None:
            self._transport_ = ray_transport(self.config)
        return self._transport_

    async def _call(self, method: str, *args: Any) -> Any:
        """Call the coordinator (errors as ``Transport.call`` raises them), attached first:
        a coordinator found alive was made with someone's config
        (``CheckpointCoordinator.attach``). A call that finds the coordinator dead is sent
        again, within a lease and a phase, while Ray may still resolve its name to the
        dead actor (until it has declared the actor's node dead): the next attempt after
        a coordinator's loss then finds its successor. A commit is not: its outcome is
        learned from the abort (``_commit_snapshot``)."""
        transport = self._transport
        clock = transport.runtime.clock
        deadline = clock.monotonic() + self._name_wait_s
        while True:
            try:
                if not self._attached:
                    await CoordinatorCalls.direct(transport).attach(self.config)
                    self._attached = True
                return await transport.call(transport.coordinator(), method, *args)
            except BackendUnavailableError as exc:
                self._attached = False  # another coordinator may answer next: attach to it
                if exc.unreachable != COORDINATOR or exc.timed_out \
                        or method in _OUTCOME_CALLS or clock.monotonic() >= deadline:
                    raise
            await asyncio.sleep(_NAME_RETRY_S)

    def _new_operation_id(self, kind: str) -> str:
        runtime = self._transport.runtime
        if self._driver_id is None:
            self._driver_id = runtime.token()[:8]
        self._sequence += 1
        return new_operation_id(kind, runtime.clock.wall(), self._driver_id, self._sequence)

    async def _abort(self, op_id: str, path: str | None, cause: BaseException) -> str | None:
        """Abort ``op_id`` everywhere, even from a cancelled task, and return its outcome
        ("committed" if its commit won), or None if the coordinator could not be reached
        (the holders then end it by their lease)."""
        # ``_call`` sends it again while the coordinator's name resolves to the dead:
        # the survivors resume at once after a node's loss, not by their lease.
        answer, _ = await _finish(asyncio.ensure_future(
            self._coordinator.abort(op_id, path, type(cause).__name__)))
        if isinstance(answer, BaseException):
            log.warning("abort of %s after %s also failed: %s", op_id,
                        type(cause).__name__, answer)
            return None
        return str(answer)

    @property
    def _name_wait_s(self) -> float:
        """How long a call waits for the coordinator's name to stop resolving to a dead
        incarnation: past a lease, the holders have resumed by themselves anyway."""
        return self.config.lease_s + self.config.phase_timeout_s

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

    @contextlib.asynccontextmanager
    async def _renewing(self, op_id: str) -> AsyncIterator[None]:
        """Renew ``op_id``'s lease every renewal period while the block runs; each
        renewal on its own, so that one slow answer does not delay the next."""
        pending: set[asyncio.Future[Any]] = set()

        async def renew_once() -> None:
            try:
                await CoordinatorCalls.direct(self._transport,
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


@dataclass(frozen=True)
class _Committed:
    """A commit whose answer was lost, but which won (the abort said so)."""

    metrics: dict[str, float]


async def _finish(future: asyncio.Future[Any]) -> tuple[Any, bool]:
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


def ray_transport(config: CheckpointConfig) -> Transport:
    """Ray's transport for ``config``'s namespace (Ray is imported here, when first used)."""
    from actors.ray_transport import RayTransport

    return RayTransport(config)


# A worker's SessionClient.connect() without a transport reaches its holder over Ray; the
# core's sessions module does not import the Ray side itself.
register_default_transport(lambda namespace: ray_transport(CheckpointConfig(namespace=namespace)))
