"""``RolloutCheckpointManager``: what NeMo RL's periodic rollout snapshots and Orbax's
``CheckpointManager`` do, around the seed's call order.

Each snapshot it takes runs the order ``nemo_ckpt.interfaces`` states, with RL's half
saved by the ``RlHalf`` it is given inside the barrier section, and its own record
(``nemo_ckpt.manager.record``: the trainer step it anchors to, the job's fingerprint)
written there too, before the environment's manifest commits. Snapshots are numbered by
their commit sequence (``SnapshotInfo.sequence``), never by parsing a path. Retention
keeps the ``keep_latest_k`` newest and the one the newest trainer checkpoint anchors,
removing the environment's half first (its manifest is the commit point), then the
record, then RL's half through ``RlHalf.remove``; what an interrupted removal or
snapshot left behind is swept at the next retention. The sweep takes only what is the
manager's own: a real folder directly under the root (never a link, which it leaves
with a warning), named as it names them, holding no committed manifest, and claimed by
no operation live (a claim judged on the manager's own clock,
``nemo_ckpt.storage.claims``): another manager's snapshot on the same root, inside its
barrier section, is never taken for a leftover. A snapshot whose record is gone when
its commit returns is not reported as taken. On a folder a snapshot is taken
under ``<name>.partial`` and renamed to its name once committed and resumed, as NeMo RL
does (a committed snapshot restores from either name); on a bucket, where a rename is a
copy, it is taken under its name. Retention's removals and the sweep are the manager's
part ``nemo_ckpt.manager.removals.ManagedRemovals``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from nemo_ckpt.catalog.listing import (
    SnapshotInfo,
    list_snapshots,
)
from nemo_ckpt.catalog.snapshot_diff import snapshot_index
from nemo_ckpt.driver.preemption import EXIT_MARGIN_S, Preemption
from nemo_ckpt.errors import (
    CheckpointPathBusyError,
    NemoCkptError,
    RolloutCheckpointFailedError,
)
from nemo_ckpt.manager.config import RolloutCheckpointConfig
from nemo_ckpt.manager.contract import ManagedSnapshot, RlHalf
from nemo_ckpt.manager.fingerprint import refuse_changes
from nemo_ckpt.manager.handover import RestoreHandover
from nemo_ckpt.manager.record import RECORD_FILE, ManagedRecord, read_record, write_record
from nemo_ckpt.manager.removals import SNAPSHOT_PREFIX, ManagedRemovals
from nemo_ckpt.manager.restoring import choose, hand_over, passed_over_line
from nemo_ckpt.manager.stop_anchor import (
    SaveTrainerCheckpoint,
    StopPlan,
    anchor_at_stop,
    hook_budget_s,
)
from nemo_ckpt.storage.location import LocalLocation, join_location, parse_location
from nemo_ckpt.storage.manifest import FORMAT_VERSION
from nemo_ckpt.storage.snapshot_files import read_manifest

__all__ = ["PARTIAL_SUFFIX", "RolloutCheckpointManager", "SNAPSHOT_PREFIX"]

log = logging.getLogger("nemo_ckpt")

# A snapshot being taken into a folder has this suffix until it has committed.
PARTIAL_SUFFIX = ".partial"


class RolloutCheckpointManager:
    """Interval and trainer-anchored rollout snapshots, retention, a failure budget and a
    configuration fingerprint (the module docstring).

    Args:
        checkpoint: The environment's checkpoint (``RayEnvironmentCheckpoint``, or
            ``NemoRlEnvironmentCheckpoint`` under NeMo RL).
        barrier: RL's data-plane barrier: ``checkpoint()`` yields a live cut.
        rl: RL's half (``RlHalf``).
        config: ``RolloutCheckpointConfig``.
        fingerprint: Fields of the job's configuration recovery depends on beyond what
            the manager finds itself (instance ids, sandbox root, formats): the
            environment adapters, a digest of RL's configuration, ...
        clock: The monotonic clock the interval is measured on.
        on_event: Called with ``(event, path)`` as a snapshot is ``committed`` and
            ``renamed`` to its final name, and as retention is ``removing`` one (for
            logs, traces and crash drills; docs/MANAGER.md lists them).
        names: Names each new snapshot's folder (must begin with ``rollout-``);
            default: the UTC time and a random suffix.
        save_trainer_checkpoint: Saves the trainer's checkpoint at a stop, given the
            seconds it may use, and returns the step saved (``stop_anchor``): the final
            snapshot is then anchored to it. None: a final snapshot is anchored to none.
    """

    def __init__(self, checkpoint: Any, barrier: Any, rl: RlHalf,
                 config: RolloutCheckpointConfig, *,
                 fingerprint: Mapping[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[str, str], None] | None = None,
                 names: Callable[[], str] | None = None,
                 save_trainer_checkpoint: SaveTrainerCheckpoint | None = None) -> None:
        for obj, what, methods in ((checkpoint, "checkpoint", ("snapshot", "restored",
                                                               "is_unavailable")),
                                   (barrier, "barrier", ("checkpoint",)),
                                   (rl, "rl", ("save", "restore", "remove"))):
            missing = [m for m in methods if not callable(getattr(obj, m, None))]
            if missing:
                raise TypeError(f"RolloutCheckpointManager's {what} "
                                f"({type(obj).__name__}) has no {', '.join(missing)}")
        self.checkpoint = checkpoint
        self.barrier = barrier
        self.rl = rl
        self.config = config
        self._extra = dict(fingerprint or {})
        self._clock = clock
        self._last_attempt = clock()
        self.consecutive_failures = 0
        # The error of the last snapshot that failed (None once one commits).
        self.last_failure: BaseException | None = None
        self._on_event = on_event or (lambda event, path: None)
        self._names = names or _default_name
        self.save_trainer_checkpoint = save_trainer_checkpoint
        # One snapshot, retention or restore at a time: the sweep takes any folder of
        # the manager's without a committed manifest for a leftover.
        self._lock = asyncio.Lock()
        # The newest trainer step whose checkpoint is known saved (None: none known).
        self.trainer_step: int | None = None
        # File work off the loop as the job's runtime does it (inline in the simulation).
        self._blocking: Callable[..., Awaitable[Any]] = getattr(
            checkpoint, "run_blocking", None) or asyncio.to_thread
        # Retention's removals, the sweep of leftovers and a failed snapshot's tidy.
        self._removals = ManagedRemovals(self, self._blocking, clock, self._on_event)

    # --- snapshots ------------------------------------------------------------------------

    async def maybe_snapshot(self) -> ManagedSnapshot | None:
        """A periodic snapshot once ``snapshot_attempt_interval_s`` has passed since the
        last attempt (or the manager's start); None otherwise, or after a transient
        failure within the budget (``snapshot``)."""
        if self._clock() - self._last_attempt < self.config.snapshot_attempt_interval_s:
            return None
        return await self.snapshot()

    async def snapshot_at_trainer_checkpoint(self, step: int) -> ManagedSnapshot | None:
        """A snapshot anchored to trainer step ``step``, taken just before the trainer
        checkpoint of ``step`` is saved; ``restore_mode="trainer_checkpoint"`` restores it
        with that checkpoint. Once the checkpoint is saved, ``trainer_checkpoint_saved``
        lets retention drop older anchors."""
        _check_step(step)
        return await self.snapshot(anchor_step=step)

    async def trainer_checkpoint_saved(self, step: int) -> list[str]:
        """The trainer checkpoint of ``step`` is durable: retention may now remove the
        snapshots anchored to older steps (returns the paths removed)."""
        _check_step(step)
        self.trainer_step = step if self.trainer_step is None else max(step,
                                                                       self.trainer_step)
        return await self.apply_retention()

    async def snapshot(self, anchor_step: int | None = None) -> ManagedSnapshot | None:
        """Take a snapshot now, then apply retention.

        Returns it, or None after a transient failure (``checkpoint.is_unavailable``)
        while fewer than ``max_consecutive_failures`` failed in a row: the next interval
        retries. Raises ``RolloutCheckpointFailedError`` once that many did, and any
        other failure at once."""
        async with self._lock:
            return await self._snapshot_now(anchor_step)

    async def final_snapshot(self, within_s: float, *,
                             save_trainer_checkpoint: SaveTrainerCheckpoint | None = None
                             ) -> ManagedSnapshot:
        """The job was told to stop: a snapshot as ``snapshot`` takes it (RL's half
        saved by the same ``RlHalf.save``), whose commit parks every session
        (``RayEnvironmentCheckpoint.final_snapshot``), with the wait for turns in
        flight shortened to a quarter of ``within_s``: a session whose turn still runs
        then is captured as of its last committed turn, and that turn runs again after
        the restore (a final snapshot never holds less of a running rollout than the one
        before it). Inside its barrier section, after RL's half, the trainer's
        checkpoint is saved by ``save_trainer_checkpoint`` (the manager's when not
        given), by three quarters of ``within_s``, and the snapshot is anchored to the
        step it returns; one that is absent, raises or runs over anchors it to none,
        and its record says why (``nemo_ckpt.manager.stop_anchor``). Waits for a
        snapshot under way first. No retention runs, and no failure budget: any failure
        raises, and the last committed snapshot stands (``Preemption`` holds this to
        its deadline)."""
        stop = StopPlan(max(0.0, within_s / 4), within_s,
                        asyncio.get_running_loop().time(),
                        save_trainer_checkpoint or self.save_trainer_checkpoint)
        async with self._lock:
            taken = await self._snapshot_now(None, stop)
        assert taken is not None  # a final snapshot raises rather than returning None
        return taken

    def preemption(self, deadline_s: float = 25.0, *, watch_drains: bool = True,
                   signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
                   drain_poll_s: float = 1.0, exit_margin_s: float = EXIT_MARGIN_S,
                   exit_by_deadline: bool = True,
                   save_trainer_checkpoint: SaveTrainerCheckpoint | None = None
                   ) -> Preemption:
        """A ``Preemption`` whose final snapshot is ``final_snapshot`` (anchored to the
        trainer checkpoint ``save_trainer_checkpoint`` saves, the manager's when not
        given): wrap the job's main body in ``async with manager.preemption():``. With
        ``watch_drains`` it also stops once a node hosting a holder drains (the
        checkpoint's ``draining_holders``, when it has them), by that drain's deadline
        if sooner. ``exit_margin_s`` and ``exit_by_deadline``: ``Preemption``'s."""
        drains = getattr(self.checkpoint, "draining_holders", None) if watch_drains else None

        async def final(within_s: float) -> ManagedSnapshot:
            return await self.final_snapshot(
                within_s, save_trainer_checkpoint=save_trainer_checkpoint)

        return Preemption(final, deadline_s=deadline_s, signals=signals,
                          drains=drains, drain_poll_s=drain_poll_s,
                          exit_margin_s=exit_margin_s, exit_by_deadline=exit_by_deadline)

    async def _snapshot_now(self, anchor_step: int | None,
                            stop: StopPlan | None = None) -> ManagedSnapshot | None:
        self._last_attempt = self._clock()
        path = join_location(self.config.root, self._names())
        # On a folder, as NeMo RL does: taken under a partial name, renamed once the
        # backend resumed, so a folder with the final name is always whole.
        taking = path + PARTIAL_SUFFIX if _is_local(path) else path
        try:
            record = ManagedRecord(anchor_step=anchor_step,
                                   fingerprint=await self.fingerprint())
            async with self._snapshot(taking, stop) as snap:
                async with self.barrier.checkpoint() as cut:
                    if snap is not None:
                        await snap.check_against_cut(cut)
                    await self.rl.save(cut, taking)
                    if stop is not None:  # the trainer's checkpoint, in the same cut
                        record = await self._stop_record(record, stop)
                    await self._blocking(write_record, taking, record)
        except Exception as exc:
            await self._removals.tidy(taking)
            if stop is not None:
                raise
            self._failed(exc, taking)
            return None
        self.consecutive_failures = 0
        self.last_failure = None
        self._on_event("committed", taking)
        if taking != path:  # committed: a crash before the rename leaves it restorable
            try:
                await self._blocking(os.rename, taking, path)
            except OSError as exc:
                log.warning("rollout snapshot %s committed, but not renamed to %s (%s); "
                            "it restores under its partial name", taking, path, exc)
                path = taking
            else:
                self._on_event("renamed", path)
        try:
            info = await self._blocking(_info, path)
            number, created = info.sequence, info.created_at
        except (OSError, NemoCkptError) as exc:  # committed all the same
            log.warning("rollout snapshot %s committed; its manifest did not read back "
                        "(%s)", path, exc)
            number, created = None, None
        if not await self._blocking(_record_stands, path, record):
            lost = CheckpointPathBusyError(
                f"rollout snapshot {path} committed, but its record {RECORD_FILE} was "
                f"removed before the commit returned (by a sweep of another job's manager "
                f"of an older release, or by hand), so it cannot be listed or restored "
                f"and is not reported as taken; give each job its own root, or run "
                f"managers of this release only")
            if stop is not None:
                raise lost
            self._failed(lost, path)
            return None
        taken = ManagedSnapshot(number, path, record.anchor_step, created, record.final,
                                record.trainer_checkpoint, record.unanchored_why)
        log.info("rollout snapshot %s committed as number %s%s", path, taken.number,
                 "" if taken.anchor_step is None
                 else f", anchored to trainer step {taken.anchor_step}")
        if stop is not None:  # the job is stopping: retention waits for the next
            if taken.anchor_step is not None:  # its trainer checkpoint is durable
                self.trainer_step = max(taken.anchor_step, self.trainer_step or 0)
            return taken
        try:
            await self._removals.retain(await self.snapshots(), self.trainer_step)
        except (OSError, NemoCkptError) as exc:  # the snapshot stands; the next one retries
            log.warning("rollout retention after %s failed (%s); the next snapshot retries",
                        path, exc)
        return taken

    # --- the catalog ----------------------------------------------------------------------

    async def snapshots(self) -> list[ManagedSnapshot]:
        """The committed snapshots the manager took under the root, newest first. A
        snapshot whose record does not read is left out, with a warning."""
        return await self._blocking(self._managed)

    async def latest(self) -> ManagedSnapshot | None:
        """The newest committed snapshot (not verified: ``restore`` verifies)."""
        found = await self.snapshots()
        return found[0] if found else None

    async def apply_retention(self) -> list[str]:
        """Remove every managed snapshot but the ``keep_latest_k`` newest and the
        anchors retention keeps (``trainer_checkpoint_saved``), and what interrupted
        snapshots or removals left. Returns the paths removed."""
        async with self._lock:
            return await self._removals.retain(await self.snapshots(), self.trainer_step)

    # --- restore --------------------------------------------------------------------------

    async def restore(self, trainer_step: int | None = None) -> RestoreHandover | None:
        """Restore per ``restore_mode``: the newest snapshot that verifies, or the one
        anchored to ``trainer_step`` (required then). None when ``latest`` finds no
        snapshot (a fresh start). Before anything is restored, the snapshot's fingerprint
        is compared with the job's: a change outside ``allow_changed`` raises
        ``FingerprintMismatchError`` and modifies nothing. Returns the hand-over
        (``RestoreHandover``): the rollouts that continue, those that start over and
        why, the rows kept, and the newer snapshots passed over (said in one line too)."""
        async with self._lock:
            return await self._restore(trainer_step)

    async def _restore(self, trainer_step: int | None) -> RestoreHandover | None:
        found = await self.snapshots()
        chosen = await self._blocking(choose, found, self.config.restore_mode,
                                      trainer_step, self.config.root)
        if chosen is None:
            return None
        record = await self._blocking(read_record, chosen.path)
        assert record is not None  # choose takes only managed snapshots
        allowed = refuse_changes(chosen.path, record.fingerprint, await self.fingerprint(),
                                 self.config.allow_changed)
        _, captured = await self._blocking(snapshot_index, chosen.path)
        if chosen.anchor_step is not None and trainer_step is not None:
            self.trainer_step = trainer_step
        for field, (saved, now) in allowed.items():
            log.warning("restoring %s: %s changed (saved %s, now %s), allowed", chosen.path,
                        field, saved, now)
        async with self.checkpoint.restored(Path(chosen.path) if _is_local(chosen.path)
                                            else chosen.path) as restored:
            plan = await self.rl.restore(chosen.path, restored)
        passed = tuple(found[:found.index(chosen)])
        dropped = passed_over_line(chosen, passed)
        if dropped is not None:
            log.log(logging.WARNING if any(s.final for s in passed) else logging.INFO,
                    "%s", dropped)
        owners = getattr(self.checkpoint, "owners", None)
        return hand_over(chosen, restored, plan, captured,
                         owners if isinstance(owners, Mapping) else None, passed, dropped)

    async def fingerprint(self) -> dict[str, Any]:
        """What recovery depends on, as this job runs: the formats, the sandbox root, the
        instance ids (of the live holders), the owners (under NeMo RL), and the fields
        given at construction."""
        found: dict[str, Any] = {"formats": {"manifest": FORMAT_VERSION, "record": 1}}
        config = getattr(self.checkpoint, "config", None)
        if config is not None:
            root = getattr(config, "sandbox_root", None)
            found["sandbox_root"] = None if root is None else str(root)
        holders = getattr(self.checkpoint, "holders", None)
        if callable(holders):
            found["instance_ids"] = sorted(h.instance_id for h in await holders())
        owners = getattr(self.checkpoint, "owners", None)
        if isinstance(owners, Mapping):
            found["owners"] = dict(owners)
        found.update(self._extra)
        return found

    # --- internals ------------------------------------------------------------------------

    async def _stop_record(self, record: ManagedRecord, stop: StopPlan) -> ManagedRecord:
        """A final snapshot's record: anchored to the trainer checkpoint the stop's hook
        saved within its share of the deadline (inside the barrier), or saying why not."""
        loop = asyncio.get_running_loop()
        anchor = await anchor_at_stop(stop.hook, hook_budget_s(stop.within_s, stop.started,
                                                                loop.time()))
        return record.model_copy(update={
            "anchor_step": anchor.step, "final": True, "trainer_checkpoint": anchor.path,
            "unanchored_why": anchor.unanchored_why})

    def _snapshot(self, path: str, stop: StopPlan | None) -> Any:
        timeout = self.config.snapshot_timeout_s
        target: Any = Path(path) if _is_local(path) else path
        if stop is not None:
            final = getattr(self.checkpoint, "final_snapshot", None)
            if final is None:
                raise TypeError(f"{type(self.checkpoint).__name__} has no final_snapshot, so "
                                f"a stop cannot park its sessions; use "
                                f"RayEnvironmentCheckpoint or NemoRlEnvironmentCheckpoint")
            return final(target, drain_timeout_s=stop.drain_s)
        if timeout is not None and "timeout_s" in inspect.signature(
                self.checkpoint.snapshot).parameters:
            return self.checkpoint.snapshot(target, timeout_s=timeout)
        return self.checkpoint.snapshot(target)

    def _failed(self, error: Exception, path: str) -> None:
        self.consecutive_failures += 1
        self.last_failure = error
        if not self.checkpoint.is_unavailable(error):
            raise error
        if self.consecutive_failures >= self.config.max_consecutive_failures:
            raise RolloutCheckpointFailedError(
                f"{self.consecutive_failures} rollout snapshots failed in a row (the last, "
                f"into {path}: {error}); the job would run on without a recoverable "
                f"snapshot: find why the backend keeps failing, or raise "
                f"max_consecutive_failures") from error
        log.warning("rollout snapshot into %s failed (%s); %d of %d failures in a row, "
                    "retried at the next interval", path, error, self.consecutive_failures,
                    self.config.max_consecutive_failures)

    def _managed(self) -> list[ManagedSnapshot]:
        found = []
        for info in list_snapshots(self.config.root):
            if not info.readable:
                continue
            try:
                record = read_record(info.path)
            except NemoCkptError as exc:
                log.warning("%s: its rollout record does not read (%s); left alone",
                            info.path, exc)
                continue
            if record is not None:
                found.append(ManagedSnapshot(info.sequence, info.path, record.anchor_step,
                                             info.created_at, record.final,
                                             record.trainer_checkpoint,
                                             record.unanchored_why))
        return found  # list_snapshots' order: newest first by commit number


def _default_name() -> str:
    return f"{SNAPSHOT_PREFIX}{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"the trainer step must be a non-negative int, not {step!r}")


def _info(path: str) -> SnapshotInfo:
    return SnapshotInfo.of(path, read_manifest(path))


def _is_local(path: str) -> bool:
    return isinstance(parse_location(path), LocalLocation)




def _record_stands(path: str, record: ManagedRecord) -> bool:
    """Whether the record a commit wrote at ``path`` is still there (True too when it
    cannot be read now: only a record gone or replaced says the snapshot was removed)."""
    try:
        found = read_record(path)
    except NemoCkptError:
        return True
    # As written: a value's Python type may not survive JSON (a tuple reads as a list).
    return found is not None and found.model_dump_json() == record.model_dump_json()







