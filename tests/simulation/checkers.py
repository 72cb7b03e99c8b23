"""The checkers of a schedule: the invariants, judged from what the workload saw, what
the faults did, the messages the world delivered, and the files and actors as they are
(read in-process, never through the transport). A violation is recorded with the time
it was seen; ``CASES`` names the reviewed case each one shows."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import stat
from collections import defaultdict
from pathlib import Path
from typing import Any

from actors.holder.sandboxes import Sandboxes
from actors.holder.states import Ended, SnapshotReleased
from actors.sim import SimActor
from nemo_ckpt.catalog.listing import list_snapshots
from nemo_ckpt.config import ADOPTED_FIELDS, DRIVER_FIELDS, CheckpointConfig
from nemo_ckpt.errors import (
    BackendUnavailableError,
    CheckpointPathBusyError,
    LeaseExpiredError,
    NemoCkptError,
    OperationAbortedError,
    SessionExistsError,
    SnapshotNotFoundError,
    TurnInProgressError,
    TurnTimedOutError,
    is_retriable,
)
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.phases import HolderState
from nemo_ckpt.protocol.holder_api import SESSION_METHODS
from nemo_ckpt.protocol.operations import Outcome
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.session_record import SessionHead, SessionRecord
from nemo_ckpt.shard_refs import shard_ref
from nemo_ckpt.storage.checkpoint_folder import environment_dir, environment_folder, folder_at
from nemo_ckpt.storage.claims import decode_claim
from nemo_ckpt.storage.path_claims import read_claims
from nemo_ckpt.storage.snapshot_files import committed_snapshots, read_manifest, read_snapshot
from nemo_ckpt.transport import COORDINATOR, HOLDER, RELAY
from nemo_ckpt.trees import tree_codec
from nemo_ckpt.trees.blob_claims import COLLECTOR
from nemo_ckpt.trees.blob_store import BLOB_DIR, BlobStore, digest_of
from nemo_ckpt.trees.collection import snapshot_refs
from nemo_ckpt.trees.snapshot_trees import (
    BlobsWritten,
    blob_store_of,
    read_trees_file,
    snapshot_directories,
    verify_directories,
    write_trees_file,
)
from nemo_ckpt.trees.tree_codec import pack_tree_object
from nemo_ckpt.trees.tree_types import DIR

from .plan import CONFIG, SPARSE_BYTES
from .state import Driver, OpRecord, Part, State, secret_bytes, short

_END_METHODS = ("commit_snapshot", "abort")
# How long after an operation ended a holder may still be paused for it (its abort or
# resume in flight): well under a lease, so a stuck pause is seen before it lapses.
GRACE_S = 1.0
# What one read of a stored tree may expand to in a schedule (entries): the simulation's
# sandboxes hold a few files; a planted tree names 2^30 directories.
BUDGET = CONFIG.tree_budget
READ_BUDGET = BUDGET.entries
BOMB_LEVELS = 30
_PLANTED = ".planted"  # a copy of a committed snapshot that a hostile writer changes


class _Runaway(Exception):
    """A read of a stored tree went past its budget: stopped here, so that the schedule
    ends (the read alone would run until killed)."""


class Checkers(Part):

    def __init__(self, s: State) -> None:
        super().__init__(s)
        self.paused_since: dict[tuple[int, str], float] = {}
        self.paused_reported: set[tuple[int, str]] = set()
        self.begin_delivered: dict[tuple[int, str], float] = {}
        self.end_delivered: dict[tuple[int, str], float] = {}
        # (holder, operation) -> its abort or resume messages on their way (a slow link)
        self.end_in_flight: dict[tuple[int, str], int] = defaultdict(int)
        # The same, still on their way to a relay: relay -> (holder's name, operation)
        self.end_in_relay: dict[SimActor, dict[tuple[str, str], int]] = defaultdict(
            lambda: defaultdict(int))
        self.turn_aborts_in_flight: dict[str, int] = defaultdict(int)  # by turn token
        self.blocked: list[str] = []  # blocking calls the guard found waiting
        self.dense_reported: set[Path] = set()
        # Blocking calls of zombies (declared dead, running again): (when, actor, function).
        self.zombie_io: list[tuple[float, SimActor, str]] = []
        # Control calls that waited for a slot behind session calls (turns, opens):
        # (when, holder, method, operation, seconds waited, session calls ahead, limit).
        self.queued_behind_turns: list[tuple[float, str, str, str, float, str, int]] = []
        tree_codec.expansion_observer = self._observe_expansion

    def _observe_expansion(self, where: str, expanded: int) -> None:
        """No read of a stored tree expands past its budget (``decode_tree``'s hook)."""
        if expanded > READ_BUDGET:
            self.violate(f"a read of the stored tree of {where} expanded {expanded} entries "
                         f"(a tree planted: {self.plan.tree_bomb}), past its budget of "
                         f"{READ_BUDGET}")
            raise _Runaway(where)

    # --- what the world delivers (its hooks), recorded for the checks ---------------------

    def ending(self, holder: SimActor, op_id: str) -> bool:
        """Whether an abort or resume of ``op_id`` is on its way to ``holder`` (a slow
        link), directly or through a live relay."""
        return bool(self.end_in_flight[(holder.serial, op_id)]) or any(
            relay.alive and pending[(holder.name, op_id)] > 0
            for relay, pending in self.end_in_relay.items())

    def on_send(self, caller: SimActor, callee: SimActor, method: str,
                args: tuple[Any, ...]) -> None:
        if callee.kind == HOLDER and method in _END_METHODS and args:
            self.end_in_flight[(callee.serial, args[0])] += 1
        if callee.kind == RELAY:
            for name, op in _relayed_ends(method, args):
                self.end_in_relay[callee][(name, op)] += 1
        if method in ("abort_turn", "resolve_turn") and len(args) > 1:
            self.turn_aborts_in_flight[args[1]] += 1
        driver = self.s.drivers.get(caller)
        if driver is None:
            return
        record = driver.record
        if record is not None and callee.kind == COORDINATOR:
            if method == "abort" and record.abort_sent is None:
                record.abort_sent = self.now()
            if not callee.alive or callee.noticed_at is not None:
                record.dead_calls.append((self.now(), method, callee))

    def on_deliver(self, target: SimActor, method: str, args: tuple[Any, ...]) -> None:
        if target.kind == RELAY:
            for name, op in _relayed_ends(method, args):
                self.end_in_relay[target][(name, op)] -= 1
        if method in ("abort_turn", "resolve_turn") and len(args) > 1:
            self.turn_aborts_in_flight[args[1]] -= 1
        if target.kind == HOLDER and args and isinstance(args[0], str):
            if method in ("begin_snapshot", "pause", "prepare_restore"):
                self.begin_delivered.setdefault((target.serial, args[0]), self.now())
            elif method in _END_METHODS:
                self.end_delivered.setdefault((target.serial, args[0]), self.now())
                self.end_in_flight[(target.serial, args[0])] -= 1

    def after_io(self, actor: SimActor, name: str) -> None:
        if actor.zombie:
            self.zombie_io.append((self.now(), actor, name))

    def on_queued(self, target: SimActor, method: str, args: tuple[Any, ...],
                  waited: float, ahead: tuple[str, ...], limit: int) -> None:
        turns = _session_calls(ahead)
        if method not in SESSION_METHODS and turns:
            op = args[0] if args and isinstance(args[0], str) else "?"
            self.queued_behind_turns.append((self.now(), target.name, method, op, waited,
                                             turns, limit))
            self.log(f"{method}({op}) to {target} waited {waited:.2f}s for a slot behind "
                     f"{turns}")

    def on_blocked(self, actor: SimActor, name: str, where: str) -> None:
        """From the guard's thread: a blocking call has not returned."""
        self.blocked.append(f"a call waits past its deadline: {name} of {actor.name} "
                            f"blocked in {where} (at t={self.now():.4f})")

    # --- as the workload goes: each operation as it ends, each turn, each claim -----------

    def check_commit(self, record: OpRecord) -> None:
        """A snapshot the driver saw commit is the manifest at its path, complete."""
        try:
            loaded = read_snapshot(record.path)
        except Exception as exc:
            self.violate(f"{record.op_id} committed but its snapshot does not verify: "
                         f"{type(exc).__name__}: {short(exc)}"
                         f"{self.zombie_work(record.start)}")
            return
        named = loaded.manifest.snapshot_id
        later = self._captured_later(record)
        if named != record.op_id and named not in later:
            self.violate(f"{record.op_id} committed but {Path(record.path).name}'s manifest "
                         f"names {named}")
        if record.check_failed:
            self.violate(f"{record.op_id} committed although its check against the cut failed")
        if self.plan.sparse and self.sandbox_root is not None:
            self._check_dense()
        planted = self.root / _PLANTED
        if self.plan.tree_bomb and not planted.exists() and any(
                s.trees for s in loaded.manifest.shards):
            # Kept aside (a hidden folder: no collection counts it) for the hostile
            # writer of ``_check_tree_bomb``, whatever later commits and removals leave.
            shutil.copytree(environment_dir(record.path), environment_dir(planted))

    def check_paused_through_block(self, record: OpRecord) -> None:
        """As a snapshot's block ends (RL's cut taken inside it), every live holder
        paused for it still is, unless its lease lapsed or it was aborted there: a
        release or resume meant for another snapshot, or sent before the block exited,
        would have let turns run under the cut."""
        for actor in self.world.live(HOLDER):
            state = actor.obj._parts.ops.get(record.op_id)  # in-process, as the checks read
            if isinstance(state, SnapshotReleased) or (
                    isinstance(state, Ended) and state.outcome is Outcome.COMMITTED):
                self.violate(f"{actor.name} resumed for {record.op_id} while its "
                             f"driver's block still ran ({type(state).__name__})")

    def check_unchecked_commit(self, driver: Driver, record: OpRecord, unchecked: bool
                               ) -> None:
        """A snapshot whose block held sessions commits unchecked only if its driver's
        config allows that."""
        if unchecked and not driver.config.allow_unchecked_snapshots:
            self.violate(f"{record.op_id} committed, but its block never checked it "
                         f"against a cut and its config does not allow that")

    def check_one_config(self, driver: Driver, record: OpRecord) -> None:
        """A driver whose config differs from the job's in a field that is not adopted
        never commits through actors made with the job's (ConfigMismatchError)."""
        fixed = [k for k in driver.differs if k not in ADOPTED_FIELDS | DRIVER_FIELDS]
        made = [a.obj._config for a in self.world.live(COORDINATOR)]
        if fixed and any(getattr(c, k) != getattr(driver.config, k)
                         for c in made for k in fixed):
            self.violate(f"{record.op_id} committed through a coordinator made with "
                         f"another config ({', '.join(fixed)} differ): nothing refused it")

    def check_deadlines(self, record: OpRecord, cfg: CheckpointConfig) -> None:
        """A snapshot's entry (begun, or failed and aborted) and its commit return within
        their driver's deadlines (``CoordinatorLink.deadline_s``): the call's, then the
        abort's that may follow it, with a lease of margin
        (messages, retries, a slow link). A coordinator that never answers ends neither
        (issue 56, case 2: the simulation's ``Plan.hang``)."""
        # A lease and a phase (the time Ray may take to tell of a death) on each call,
        # and as the abort's own deadline.
        abort = cfg.lease_s + cfg.phase_timeout_s
        entry = cfg.drain_timeout_s + 2 * cfg.phase_timeout_s + 2 * abort + cfg.lease_s
        # From the call, not from the wait for RL's own lock (its retires may be slow).
        called = record.entered if record.entered is not None else record.start
        entered = record.begun if record.begun is not None else record.entry_failed
        if entered is not None and entered - called > entry:
            self.violate(f"a call waits past its deadline: the snapshot {record.op_id} took "
                         f"{entered - called:.1f}s to "
                         f"{'begin' if record.begun is not None else 'fail'} (drain, phase "
                         f"and abort deadlines: {entry - cfg.lease_s:g}s)"
                         f"{self._queue_note(record.op_id)}")
        commit = cfg.persist_timeout_s + 2 * cfg.phase_timeout_s + 2 * abort + cfg.lease_s
        if record.body_end is not None and record.end is not None and \
                record.end - record.body_end > commit:
            self.violate(f"a call waits past its deadline: the commit of {record.op_id} took "
                         f"{record.end - record.body_end:.1f}s after its block ended (persist, "
                         f"phase and abort deadlines: {commit - cfg.lease_s:g}s)"
                         f"{self._queue_note(record.op_id)}")

    def check_error_kind(self, exc: BaseException, what: str) -> None:
        """Every failure the runtime reports is one of its own error classes."""
        if not isinstance(exc, NemoCkptError):
            self.violate(f"{what} raised {type(exc).__name__}, not a nemo-ckpt error: "
                         f"{short(exc)}")

    def check_dead_name(self, record: OpRecord, exc: BaseException) -> None:
        """An operation begun after the coordinator died (its death noticed before) does
        not fail only because its calls still met the dead actor's name."""
        if not isinstance(exc, BackendUnavailableError) or not record.dead_calls:
            return
        if "the nemo-ckpt coordinator" not in str(exc):
            return  # it failed on a holder (a fault of its own), after reaching a coordinator
        failing = re.search(r"during (\w+)", str(exc))
        if failing is None or failing[1] not in {m for _, m, _ in record.dead_calls}:
            # Its call that failed never met the dead name: it reached a live successor,
            # whose answer was lost (simulation seed 801133), not the dead coordinator.
            return
        when, method, dead = record.dead_calls[0]
        died = [t for t, a in self.world.kills + self.world.declared if a is dead]
        # A node that died meanwhile (its holder with it) may have left the successor
        # nowhere to start: the failure is then the cluster's, not the dead name's.
        if not died or died[0] >= record.start or \
                self.killed_since(record.start, (COORDINATOR, HOLDER)):
            return
        self.violate(f"{record.op_id or 'the ' + record.kind + ' of ' + record.driver} "
                     f"failed (BackendUnavailableError) because its "
                     f"{method} met the dead coordinator's name: {dead} died at "
                     f"t={died[0]:.2f}, before the operation began, and the name still "
                     f"resolved to it at t={when:.2f}")

    async def check_failed_snapshot(self, record: OpRecord, exc: BaseException) -> None:
        """A failed snapshot resumed every holder before its error reached the driver,
        even after its coordinator died, so long as no coordinator died after its
        driver's abort went out (the abort finds the successor)."""
        if self.killed_since(record.start, ("driver",)):
            return
        self._check_not_refused_by_its_own_claim(record, exc)
        after_abort = record.abort_sent if record.abort_sent is not None else self.now()
        if self.killed_since(after_abort - 1e-9, (COORDINATOR,)):
            return
        coordinator_died = self.killed_since(record.start, (COORDINATOR,))
        paused = []
        for actor in self.world.live(HOLDER):
            info = await self.s.ask(actor, "info")
            if info.operation_id == record.op_id and info.state is not HolderState.RUNNING \
                    and not self.ending(actor, info.operation_id):
                paused.append(info.instance_id)
                self.paused_reported.add((actor.serial, info.operation_id))
        if paused and coordinator_died:
            dead = [(t, a) for t, a in self.world.kills + self.world.declared
                    if a.kind == COORDINATOR and t > record.start]
            met = [m for _, m, _ in record.dead_calls]
            self.violate(f"{record.op_id} failed ({type(exc).__name__}) after its "
                         f"coordinator {dead[0][1]} died at t={dead[0][0]:.2f}, and its abort "
                         f"met the dead coordinator's name ({len(met)} call(s) to the dead "
                         f"actor: {sorted(set(met))}): it left {paused} paused for it until "
                         f"their lease{self._queue_note(record.op_id)}")
        elif paused:
            self.violate(f"{record.op_id} failed ({type(exc).__name__}) but left {paused} "
                         f"paused for it{self._queue_note(record.op_id)}")
        if coordinator_died:
            return
        if isinstance(exc, LeaseExpiredError) and not self._stalled(record):
            full = self._full_disk_during(record)
            if full is not None:
                over = full[0] + full[1] < self.now()
                self.violate(f"{record.op_id} lost its lease (LeaseExpiredError) although its "
                             f"driver renewed on time: the renewals' claim write met a disk "
                             f"full from {full[0]:.1f}s for {full[1]:.1f}s"
                             + (", which recovered before the commit" if over else "")
                             + self._queue_note(record.op_id))
            elif self.s.path_claimed_by_job2.get(record.path, float("inf")) <= (
                    record.end if record.end is not None else self.now()):
                self.violate(f"{record.op_id} lost its lease (LeaseExpiredError) although its "
                             f"driver renewed on time: the renewals' claim of the path was "
                             f"refused (a second job claimed it), and the holders' renewal "
                             f"was skipped with it{self._queue_note(record.op_id)}")
            else:
                self.violate(f"{record.op_id} lost its lease although nothing stalled its "
                             f"renewals{self._queue_note(record.op_id)}")

    def _check_not_refused_by_its_own_claim(self, record: OpRecord,
                                             exc: BaseException) -> None:
        """A snapshot is refused as busy only for another operation's claim, and fenced
        only by a successor coordinator (one ran since it began): never for the claim it
        wrote itself (issue 34 case 4: a claim's create or renewal that landed, and whose
        retry met it)."""
        if isinstance(exc, CheckpointPathBusyError) and record.op_id and \
                f"claimed for {record.op_id} by" in str(exc):
            self.violate(f"{record.op_id} was refused by a claim of its own: "
                         f"CheckpointPathBusyError: {short(exc)}")
        if isinstance(exc, OperationAbortedError) and "taken for dead" in str(exc) and \
                not self.killed_since(record.start - CONFIG.lease_s, (COORDINATOR,)) and \
                not self._stalled(record):
            self.violate(f"{record.op_id} was refused by a claim of its own: fenced "
                         f"although no other coordinator ran: {short(exc)}")

    def check_gc_refused(self, owner: str, exc: BaseException) -> None:
        """A gc refused as busy was refused for a collection that runs, or a snapshot's
        hold: never for a collection claim of its own, which no collection runs under
        (issue 34 case 5)."""
        claim = self.root / BLOB_DIR / f".claim-{COLLECTOR}.json"
        try:
            found = decode_claim(claim.read_bytes())
        except (OSError, ValueError, KeyError, TypeError):
            return
        if found.owner == owner:
            self.violate(f"gc ({owner}) was refused by a collection claim of its own, which "
                         f"no collection runs under: {type(exc).__name__}: {short(exc)}")

    def _check_claims_left(self) -> None:
        """Past every lease, every claim on disk belongs to a process that died holding
        it: one whose writer lives on was left behind when it gave up (issue 34: a claim
        written, then an error), and holds the path or the store for nothing."""
        writers = self.s.claim_writers
        for where, _, files in os.walk(self.root):
            for name in sorted(files):
                if not (name.startswith(".claim-") and name.endswith(".json")):
                    continue
                path = str(Path(where) / name)
                writer, when = writers.get(path, (None, 0.0))
                if writer is None or not writer.alive or \
                        any(a is writer for _, a in self.world.declared):
                    continue
                try:
                    claim = decode_claim(Path(path).read_bytes())
                    what = f"{claim.operation} of {claim.owner}"
                except (OSError, ValueError, KeyError, TypeError):
                    what = "unreadable"
                self.violate(f"a claim was left behind by a process that gave up: "
                             f"{Path(path).relative_to(self.root)} ({what}), written by "
                             f"{writer.name} at t={when:.2f}, which lives on and runs no "
                             f"operation")

    async def check_failed_restore(self, record: OpRecord, loaded: Any) -> None:
        """A failed restore left nothing it restored live: all or nothing."""
        if self.killed_since(record.start, ("driver",)):
            return
        restored = {r.continued().episode for recs in loaded.sessions.values() for r in recs}
        live = []
        for actor in self.world.live(HOLDER):
            if self.ending(actor, record.op_id or ""):
                continue  # its abort is on a slow link: it lands, or the retry adopts it
            live += [f"{actor.name}/{s.episode.capture_key}"
                     for s in await self.s.ask(actor, "sessions") if s.episode in restored]
        if live:
            self.violate(f"restore {record.op_id} failed but left {sorted(live)} live: not "
                         f"all or nothing")
        if self.plan.slow_reads and not self._stalled(record) and \
                record.outcome in ("LeaseExpiredError", "StaleSnapshotError"):
            self.violate(f"restore {record.op_id} lost its lease during a long read although "
                         f"renewals kept coming")

    def check_failed_retry(self, record: OpRecord, again: BaseException) -> None:
        """RL's retry of a failed restore succeeds unless it met a fault of its own."""
        # A retry may meet a fault of its own: a restore's materialization that
        # fails, or a disk read error (injected), refuses that retry, and rightly.
        injected = "injected" in str(again)
        # A user's removal wins when it came after the failed attempt had begun to end
        # (its driver sent the abort, which releases the restore's claim before the
        # driver hears back), or when that attempt never reached the coordinator (it
        # claimed nothing): a restore holds the snapshot only while it runs. One that
        # came while it ran is a violation.
        removed = self.s.removed.get(record.path)
        ended = record.abort_sent if record.abort_sent is not None else record.failed_at
        if isinstance(again, SnapshotNotFoundError) and removed is not None and (
                record.failed_id is None or ended is not None and removed >= ended):
            return
        if not (is_retriable(again) or injected or self.killed_since(
                record.start, (COORDINATOR, "driver", HOLDER))):
            self.violate(f"the retry of a failed restore failed: "
                         f"{type(again).__name__}: {short(again)}")

    def unreadable_at_restore(self, snapshot_id: str, exc: BaseException) -> None:
        """A snapshot RL saw committed does not read back at the restore after a crash."""
        self.violate(f"{snapshot_id} committed but its snapshot does not verify "
                     f"at the restore: {type(exc).__name__}: {short(exc)}"
                     f"{self.zombie_work(0.0)}")

    async def check_restored(self, restored: Any, loaded: Any,
                             results: tuple[FinishedRollout, ...],
                             retired: frozenset[tuple[str, str, int]] = frozenset()) -> None:
        """Restored sessions equal what was captured, each as its next attempt, and a
        finished one as it was, its result handed back instead of continued; those of
        ``retired`` (instance, rollout, attempt captured: RL starts them over) aside."""
        sessions = await self.s.live_sessions()
        for instance, records in loaded.sessions.items():
            if instance not in sessions:
                continue  # its holder died since (lost with its node)
            live = {s.episode: s for s in sessions.get(instance, [])}
            for record in records:
                want = record if record.finished else record.continued()
                if (instance, record.episode.rollout_id, record.episode.attempt) in retired:
                    continue  # retired once the restore went live (or left, if that failed)
                got = live.get(want.episode)
                if got is not None and self.sandbox_root is not None \
                        and not record.finished:  # a finished one's directory is the worker's
                    self._check_restored_directory(got)
                    got = dataclasses.replace(got, directory=None)
                if got != want:
                    self.violate(f"restored {instance}/{want.episode.capture_key} is {got}, "
                                 f"captured {want}")
        want_attempts = {(i, r.episode.rollout_id, r.episode.attempt)
                         for i, recs in loaded.sessions.items() for r in recs
                         if not r.finished}
        if set(restored.continued_attempts) != want_attempts:
            self.violate("restored.continued_attempts differs from the snapshot's sessions")
        want_results = {(i, r.episode, r.result) for i, recs in loaded.sessions.items()
                        for r in recs if r.finished}
        if {(r.instance_id, r.episode, r.result) for r in results} != want_results:
            self.violate("restored_results differ from the snapshot's finished sessions")
        self._check_one_live_session_per_rollout(sessions)

    # --- NeMo RL's recovery states (issue 52) ----------------------------------------------

    def check_drained(self, record: OpRecord, saved: Any) -> None:
        """A committed snapshot's cut met no rollout Gym had finished before the snapshot
        began whose reply RL could seal and had not: the integration's ``drain=`` sealed
        it, or a restore would run it again."""
        if saved.unsealed:
            self.violate(f"{record.op_id} committed with {len(saved.unsealed)} rollout(s) "
                         f"finished in the environment before it began, not sealed at its "
                         f"cut (a restore runs them again): {list(saved.unsealed)[:3]}")

    def check_rows_needed(self, nemo: Any, snap: Any, record: OpRecord) -> None:
        """No staging row RL still needs (a published group's, still to be trained, or a
        sealed attempt's) is reported as an orphan by the check under NeMo RL's cut."""
        result = getattr(snap, "check_result", None)
        if result is None:
            return
        needed = nemo.published.staging_keys() | nemo.ledger.expected_staging_keys()
        wrong = sorted(result.orphan_staging_keys & needed)
        if wrong:
            self.violate(f"{record.op_id}'s check reports {len(wrong)} staging row(s) RL "
                         f"still needs (published or sealed) as orphans: {wrong[:3]}")

    def check_hand_over(self, nemo: Any, saved: Any, plan: Any) -> None:
        """After a NeMo RL restore: the keep set holds every published group's rows and
        every sealed attempt's (none cleared before training), a prompt-group group's
        restored sessions are not handed over, and what the drain sealed before the cut
        is sealed still (never run again)."""
        keep = plan.keep_staging_keys
        lost = sorted((nemo.published.staging_keys() | nemo.ledger.expected_staging_keys())
                      - keep)
        if lost:
            self.violate(f"the restore from {saved.snapshot_id} leaves {len(lost)} staging "
                         f"row(s) RL still needs (published or sealed) out of its keep set: "
                         f"they are cleared before training: {lost[:3]}")
        whole = {rid for rid, _ in nemo.abandoned_whole()}
        handed = sorted(f"{rid}@{att}" for _, rid, att in plan.restored_gym_episodes
                        if rid in whole)
        if handed:
            self.violate(f"the restore from {saved.snapshot_id} handed over rollouts of "
                         f"prompt-group groups, which the ledger abandons whole: {handed}")
        redone = sorted(f"{g}_g{i}_a{a}" for g, i, a in saved.drained if not nemo.sealed(
            (g, i, a)))
        if redone:
            self.violate(f"the restore from {saved.snapshot_id} runs again rollouts "
                         f"finished in the environment and sealed by the drain before its "
                         f"cut: {redone[:3]}")

    def check_retired(self, dropped: frozenset[tuple[str, int]],
                      before: dict[str, list[SessionRecord]],
                      after: dict[str, list[SessionRecord]]) -> None:
        """After ``retire_dropped()`` no session of a rollout RL dropped (abandoned,
        failed or replaced) that a holder held before it is held still."""
        held = {(inst, s.episode) for inst, records in before.items() for s in records}
        left = sorted(f"{inst}/{s.episode.capture_key}" for inst, records in after.items()
                      for s in records if (inst, s.episode) in held
                      and (s.episode.rollout_id, s.episode.attempt) in dropped)
        if left:
            self.violate(f"after retire_dropped() {len(left)} session(s) of rollouts RL "
                         f"dropped are still on their holders: {left[:3]}")

    def _check_restored_directory(self, session: SessionRecord) -> None:
        if session.directory is None:
            self.violate(f"restored {session.episode.capture_key} has no directory")
            return
        state = Path(session.directory) / "state"
        found = state.read_bytes() if state.exists() else None
        if found != session.state:
            self.violate(f"the restored directory of {session.episode.capture_key} holds "
                         f"state {found!r}, its session {session.state!r}")

    def _check_one_live_session_per_rollout(self,
                                            sessions: dict[str, list[SessionRecord]]) -> None:
        where: dict[str, list[str]] = defaultdict(list)
        for instance, records in sessions.items():
            for s in records:
                where[s.episode.rollout_id].append(f"{instance}/{s.episode.capture_key}")
        for rollout_id, places in sorted(where.items()):
            if len(places) > 1:
                self.violate(f"rollout {rollout_id} is live {len(places)} times: {places}")

    def check_adapted_rollout(self, ep: Ep, rollout: Any, crash_free: list[dict[str, Any]],
                              when: str) -> None:
        """An adapter-driven rollout (``Plan.adapted``) over a deterministic environment:
        a continued one was rebuilt by a replay whose observations equal the recorded
        ones (no restart: nothing differs to start over for), or, captured before its
        init turn committed, started afresh by its init alone; and what it recorded, the
        replayed prefix and the finished whole, equals a run that never crashed."""
        if rollout.restarts:
            self.violate(f"the replay of {ep.capture_key} diverged from its recorded turns "
                         f"({rollout.records[0].restarted}): the restore brought back turns "
                         f"its environment does not reproduce")
        outputs = [r.output for r in rollout.records]
        fresh = rollout.rebuilt_by == "fresh" and not rollout.replayed and len(outputs) == 1
        if when == "resumed" and not fresh and (rollout.rebuilt_by != "replay" or [
                o.as_plain() for o in rollout.replayed] != outputs):
            self.violate(f"{ep.capture_key} was rebuilt by {rollout.rebuilt_by}, its replay "
                         f"returning {len(rollout.replayed)} of its {len(outputs)} recorded "
                         f"turns, or other observations than those recorded")
        expected = crash_free if when == "finished" else crash_free[:len(outputs)]
        if outputs != expected:
            self.violate(f"{ep.capture_key} ({when}, {len(outputs)} turns) differs from a "
                         f"crash-free run of it")

    def check_turns_once(self, session: SessionRecord, when: str) -> None:
        """A turn is recorded at most once: no step's record twice in a session (the
        workload's records name their step, ``t<step>``)."""
        steps = [r for r in session.turns if re.fullmatch(rb"t[0-9]+", r)]
        twice = sorted({r for r in steps if steps.count(r) > 1})
        if twice:
            self.violate(f"{session.instance_id}/{session.episode.capture_key} recorded "
                         f"turn {twice[0].decode()} twice ({when}; {len(session.turns)} "
                         f"turns): a turn reported unavailable had committed, and its "
                         f"retry ran it again")

    def check_turn_count(self, session: SessionHead, expected: int, when: str) -> None:
        """A turn is recorded once: after step ``t`` a session holds ``t + 1`` turns
        (a continued rollout runs on from its turn count), one more if a retry ran a
        committed turn again, one fewer if a turn reported committed was not."""
        if session.turn_count != expected:
            self.violate(f"{session.instance_id}/{session.episode.capture_key} holds "
                         f"{session.turn_count} turns {when}, not {expected}: "
                         + ("a turn reported unavailable had committed, and its retry ran "
                            "it again" if session.turn_count > expected else
                            "a turn reported committed was not recorded"))

    def check_retry_refusal(self, exc: BaseException, what: str) -> None:
        """A call retried because its error said nothing changed is not refused because
        the first call changed something after all (its answer was lost). A turn whose
        holder timed it out meanwhile is refused for that, rightly (seed 21174: RL's
        barrier held its worker while the pause's relay was lost, so that holder was
        never paused, and a clock jump took the turn past its timeout)."""
        if isinstance(exc, TurnTimedOutError):
            return
        if isinstance(exc, (SessionExistsError, TurnInProgressError)):
            self.violate(f"the {what} retried after an unavailable error was refused: "
                         f"{type(exc).__name__}: {short(exc)}")

    def check_turn_directory(self, ep: Ep, directory: Path, before: bytes, t: int) -> None:
        """A turn's directory starts as its session's state says (after a restore too)."""
        found = (directory / "state").read_bytes() if (directory / "state").exists() else None
        if found != before:
            self.violate(f"the directory of {ep.capture_key} holds state {found!r} at turn "
                         f"{t}, its session {before!r}")

    def check_one_job_per_path(self, path: Path, job2: SimActor) -> None:
        """A second job's claim of ``path`` (just granted) met no live claim of this job."""
        # This job's claims there that its coordinator wrote within their time to live,
        # by true time: live, whatever either clock says.
        now = self.now()
        fresh = {args[1] for t, _, name, args, _ in self.world.io_log
                 if name == "claim_path" and len(args) > 1 and now - t < CONFIG.lease_s * 2}
        running = {r.op_id for r in self.s.ops if r.end is None and r.op_id}
        ours = [c.operation for c in read_claims(environment_dir(path))
                if c.operation in running and c.operation in fresh]
        if ours:
            self.violate(f"a second job claimed {path.name} while {ours[0]} of this job "
                         f"held it: two jobs write one checkpoint path (their clocks differ "
                         f"by {job2.wall_offset - self.s.coordinator_offset():+.0f}s)")

    # --- all along ------------------------------------------------------------------------

    async def monitor(self) -> None:
        """All along: no holder stays paused or restoring for an operation that has
        ended, beyond the time its abort or resume takes to land, unless the process
        that would end it (its driver or the coordinator) died."""
        while True:
            await asyncio.sleep(0.5)
            now = self.now()
            for actor in self.world.live(HOLDER):
                state, op_id = actor.obj.current
                if state is HolderState.RUNNING or op_id is None:
                    continue
                record = next((r for r in self.s.ops if r.op_id == op_id), None)
                key = (actor.serial, op_id)
                if record is None or record.end is None or self._exempt(op_id) \
                        or key in self.paused_reported or self.ending(actor, op_id):
                    continue
                since = max(self.paused_since.setdefault(key, now), record.end)
                if now - since <= GRACE_S:
                    continue
                self.paused_reported.add(key)
                arrived = self.begin_delivered.get(key)
                ended = self.end_delivered.get(key)
                if arrived is not None and ended is not None and arrived > ended:
                    self.violate(f"{actor.name} is {state.value} for {op_id}: "
                                 f"its begin arrived after its abort or resume, and a late "
                                 f"call paused it again{self._queue_note(op_id)}")
                elif record.outcome == "CancelledError":
                    self.violate(f"{actor.name} is still {state.value} for "
                                 f"{op_id} after its driver was cancelled"
                                 f"{self._queue_note(op_id)}")
                else:
                    self.violate(f"{op_id} failed ({record.outcome}) but left "
                                 f"['{actor.name}'] {state.value} for it"
                                 f"{self._queue_note(op_id)}")

    def _exempt(self, op_id: str | None) -> bool:
        """A holder may stay paused for an operation until its lease lapses only when the
        process that would abort it (its driver or the coordinator) died."""
        record = next((r for r in self.s.ops if r.op_id == op_id), None)
        if record is None:
            return True  # an id no driver here made (a dead driver's late message)
        return self.killed_since(record.start, (COORDINATOR, "driver"))

    # --- at the end: past every lease and turn deadline -----------------------------------

    async def check_settled(self) -> None:
        """The drivers stopped and messages landed, well within a lease: no holder waits
        for an operation that a live driver and coordinator could have ended, and no turn
        is in flight for a worker that is still alive."""
        for actor in self.world.live(HOLDER):
            holder = actor.obj
            for key, token in holder.turns_in_flight():
                worker = self.s.rollout_worker.get(key)
                if self.turn_aborts_in_flight[token]:
                    continue  # its abort is on a slow link
                if worker is not None and worker.alive:
                    self.violate(f"{holder.instance_id} holds a turn of {key} in flight "
                                 f"although its worker went away alive")

    async def check_final(self) -> None:
        """Past every lease and turn deadline."""
        for message in self.blocked:
            self.violate(message)
        self._check_control_not_queued()
        self._check_claims_left()
        self._check_world()
        self._check_newest_listed_first()
        for info in await self.s.holder_infos():
            if info.state is not HolderState.RUNNING:
                self.violate(f"{info.instance_id} is {info.state.value} for "
                             f"{info.operation_id} past its lease"
                             f"{self._queue_note(info.operation_id)}")
            if info.turns_in_flight:
                self.violate(f"{info.instance_id} has {info.turns_in_flight} turn(s) in "
                             f"flight past the turn deadline")
        sessions = await self.s.live_sessions()
        self._check_one_live_session_per_rollout(sessions)
        for records in sessions.values():
            for session in records:
                self.check_turns_once(session, "at the end")
        for actor in self.world.live(HOLDER):
            bounds = actor.obj.bounds()
            if bounds["history"] > 64 or bounds["drivers"] > 64 \
                    or bounds["aborted_tokens"] > 4096 or bounds["released"]:
                self.violate(f"{actor.name} remembers more than its bounds: {bounds}")
        for actor in self.world.live(COORDINATOR):
            coordinator = actor.obj
            table = coordinator.operations
            if table:  # every operation ended, with one outcome each
                self.violate(f"the coordinator still holds "
                             f"{sorted(o.id for o in table.open_ones())} past every lease")
            if table.bounds()["history"] > 64 or coordinator.folders.locks_held:
                self.violate("the coordinator remembers more than its bounds")
        for path in sorted({r.path for r in self.s.ops}):
            env = environment_dir(path)
            if not (env / "manifest.json").exists():
                if self.s.committed.get(path):
                    self.violate(f"{Path(path).name}: committed {self.s.committed[path][-1]} "
                                 f"but no manifest is there now{self.zombie_work(0.0)}")
                continue
            try:
                loaded = read_snapshot(path)
            except Exception as exc:
                self.violate(f"{Path(path).name}: the manifest does not verify: "
                             f"{type(exc).__name__}: {short(exc)}{self.zombie_work(0.0)}")
                continue
            sid = loaded.manifest.snapshot_id  # its directories: ``_check_world``
            if sid in self.s.failed_checks:
                self.violate(f"{Path(path).name}: {sid} is committed although its check "
                             f"failed")
            seen = self.s.committed.get(path, [])
            if seen and seen[-1] != sid:
                last = next(r for r in self.s.ops if r.op_id == seen[-1])
                later = self._captured_later(last)
                if sid not in later:
                    self.violate(f"{Path(path).name}: {seen[-1]} was committed last, but "
                                 f"the manifest names {sid}")
        for _, _, name, args, _ in self.world.io_log:
            if name == "write_manifest":
                data = args[1]
                sid = json.loads(data)["snapshot_id"] if isinstance(data, bytes) else \
                    data.snapshot_id
                if sid in self.s.failed_checks:
                    self.violate(f"a manifest was written for {sid}, whose check failed")

    def _check_newest_listed_first(self) -> None:
        """``list_snapshots`` lists a snapshot before every one whose manifest was written
        before its block ended (true time), whatever the committing hosts' clocks;
        commits that overlapped may come in either order."""
        written: dict[str, float] = {}
        for t, _, name, args, _ in self.world.io_log:
            if name == "write_manifest":
                data = args[1]
                sid = json.loads(data)["snapshot_id"] if isinstance(data, bytes) else \
                    data.snapshot_id
                written[sid] = t
        committing = {r.op_id: r.body_end for r in self.s.ops
                      if r.kind == "snapshot" and r.body_end is not None}
        listed = [info for info in list_snapshots(self.root)
                  if info.readable and info.snapshot_id in written]
        for i, first in enumerate(listed):
            for later in listed[i + 1:]:
                began = committing.get(later.snapshot_id)
                if began is not None and began > written[first.snapshot_id or ""]:
                    self.violate(f"list_snapshots lists {first.snapshot_id} (written "
                                 f"t={written[first.snapshot_id or '']:.2f}) before "
                                 f"{later.snapshot_id}, whose commit began after it (t="
                                 f"{began:.2f}): the newest snapshot is not listed first")
                    return

    def _check_control_not_queued(self) -> None:
        """A holder's control calls (pause, release, renewals, persist, resume, abort) do
        not wait for a concurrency slot behind turns waiting at its gate."""
        seen = set()
        for when, holder, method, op, waited, turns, limit in self.queued_behind_turns:
            if waited <= GRACE_S or op in seen:
                continue
            seen.add(op)
            record = next((r for r in self.s.ops if r.op_id == op), None)
            outcome = f"; {op} ended {record.outcome}" if record is not None else ""
            self.violate(f"a control call queued behind turns: {method}({op}) waited "
                         f"{waited:.1f}s for a slot at {holder} behind {turns} (workers' "
                         f"session calls, held by its paused gate), in one concurrency group "
                         f"of limit {limit} (until t={when:.2f}){outcome}")

    def _check_world(self) -> None:
        """The invariants of the world outside the protocol (issue 23): every committed
        snapshot's blobs are there; nothing outside a sandbox was read into one; a sandbox's
        sparse file is not stored densely; a damaged manifest is refused with the project's
        error."""
        root = self.root
        if self.sandbox_root is not None:
            for snapshot in committed_snapshots(root):
                try:
                    manifest = read_manifest(snapshot)
                except Exception:
                    continue  # reported by the checks of each path
                problems = verify_directories(snapshot, manifest)
                if problems:
                    gcs = "".join(f"; a gc from another host, its clock {skew:+.0f}s from the "
                                  f"coordinator's, removed {n} blobs at t={t:.2f}"
                                  for t, n, skew in self.s.gc_removals)
                    self.violate(f"committed snapshot {manifest.snapshot_id} at "
                                 f"{Path(snapshot).name} references a blob that is missing or "
                                 f"damaged ({len(problems)} problem(s)): {problems[0]}{gcs}"
                                 f"{self.zombie_work(0.0)}")
            # What the file was made with, not what it holds now: a write through a link
            # would change it to what every sandbox holds.
            secret = secret_bytes(self.seed)
            if self.secret.read_bytes() != secret:
                self.violate("the secret file outside every sandbox was written through a "
                             "link in a sandbox")
            for holder in self.world.actors:
                boxes = getattr(getattr(holder.obj, "_parts", None), "sandboxes", None)
                cache = getattr(boxes, "_cache", None)
                if cache is not None and any(secret in b for b in cache._memory.values()):
                    self.violate(f"the secret file outside every sandbox was read into "
                                 f"the node cache of {holder.name} (memory)")
            for where, _, files in os.walk(root):
                for name in files:
                    path = Path(where) / name
                    if path == self.secret:
                        continue
                    try:
                        info = path.lstat()
                        if not stat.S_ISREG(info.st_mode):
                            continue
                        if info.st_size < 4096 and secret in path.read_bytes():
                            self.violate(f"the secret file outside every sandbox was read "
                                         f"into one: {path.relative_to(root)} holds it")
                    except OSError:
                        continue
            self._check_snapshots_restore()
            if self.plan.tree_bomb:
                self._check_tree_bomb()
        if self.plan.sparse:
            self._check_dense()
        if self.plan.damage is not None:
            self._check_damaged_manifest()

    def _check_snapshots_restore(self) -> None:
        """Every committed snapshot the schedule leaves restores: its directories
        materialize, each as its next attempt's (the holder's own restore code, into a
        scratch sandbox root). Those that do not verify are reported already."""
        scratch = self.root / "restore-check"
        for snapshot in committed_snapshots(self.root):
            try:
                manifest = read_manifest(snapshot)
            except Exception:
                continue  # reported by the checks of each path
            where = blob_store_of(snapshot, manifest)
            if where is None or verify_directories(snapshot, manifest):
                continue
            try:
                for shard in manifest.shards:
                    if shard.trees is None:
                        continue
                    rows = read_trees_file(environment_folder(snapshot), shard.trees,
                                           shard.instance_id)
                    keys = {r[0]: Ep(r[0], r[1]).next_attempt().capture_key for r in rows}
                    boxes = Sandboxes(shard.instance_id, str(scratch), None,
                                      namespace="check")
                    boxes.restores.prepare_restore("restore-check", environment_folder(snapshot),
                                          shard_ref(shard), where, keys)
                    boxes.restores.discard_staging("restore-check")
            except Exception as exc:
                self.violate(f"committed snapshot {manifest.snapshot_id} at "
                             f"{Path(snapshot).name} does not restore: {type(exc).__name__}: "
                             f"{short(exc)}")
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

    def _check_tree_bomb(self) -> None:
        """A hostile writer plants, in a copy of a committed snapshot, a session tree whose
        every directory names the same subtree twice (2^30 directories from 31 objects of
        under 100 bytes): verify, inspect and diff, gc and a restore each refuse it within
        their budget (``_observe_expansion``), with a nemo-ckpt error or a problem."""
        copy = self.root / _PLANTED
        if not copy.exists():
            return  # no snapshot with sandboxes committed
        where = blob_store_of(copy, read_manifest(copy))
        assert where is not None
        store = BlobStore(where, folder_at)
        data = pack_tree_object([])  # the empty directory at the bottom
        for _ in range(BOMB_LEVELS):
            digest = digest_of(data)
            store.put(digest, data)
            data = pack_tree_object([["a", DIR, 0o755, len(data), digest],
                                     ["b", DIR, 0o755, len(data), digest]])
        root_digest, root_size = digest_of(data), len(data)
        store.put(root_digest, data)
        folder = environment_folder(copy)
        manifest_path = environment_dir(copy) / "manifest.json"
        raw = json.loads(manifest_path.read_bytes())
        for k, shard in enumerate(read_manifest(copy).shards):
            if shard.trees is None:
                continue
            old = read_trees_file(folder, shard.trees, shard.instance_id)
            planted = [(r[0], r[1], root_digest, root_size, r[4]) for r in old]
            entry = write_trees_file(folder, shard.trees.file, shard.instance_id, planted,
                                     shard.trees.blobs, BlobsWritten())
            raw["shards"][k]["trees"] = entry.model_dump()
            break
        manifest_path.write_text(json.dumps(raw))
        self.s.faults += 1
        manifest = read_manifest(copy)
        shard = next(s for s in manifest.shards if s.trees is not None)
        assert shard.trees is not None
        rollout = read_trees_file(folder, shard.trees, shard.instance_id)[0]
        scratch = self.root / "restore-check"
        readers: list[tuple[str, Any]] = [
            ("verify", lambda: verify_directories(copy, manifest, BUDGET)),
            ("inspect or diff", lambda: snapshot_directories(copy, manifest, BUDGET)),
            ("gc", lambda: snapshot_refs(str(copy), store, budget=BUDGET)),
            ("a restore", lambda: Sandboxes(shard.instance_id, str(scratch), None,
                                            namespace="check", tree_budget=BUDGET
                                            ).restores.prepare_restore(
                "restore-check", folder, shard_ref(shard), blob_store_of(copy, manifest),
                {rollout[0]: Ep(rollout[0], rollout[1]).next_attempt().capture_key})),
        ]
        for what, read in readers:
            try:
                read()
            except _Runaway:
                pass  # reported by ``_observe_expansion``
            except NemoCkptError:
                pass
            except Exception as exc:
                self.violate(f"{what} of a planted tree raised {type(exc).__name__}, not a "
                             f"nemo-ckpt error: {short(exc)}")
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(copy, ignore_errors=True)

    def _check_dense(self) -> None:
        """No copy of a sandbox's sparse file (in the node caches, the blob store or a
        restored directory) takes its apparent size: the holes stay holes. Checked after
        each commit too (retention and the caches' sweep may remove them later)."""
        root, reported = self.root, self.dense_reported
        for where, _, files in os.walk(root):
            for name in files:
                path = Path(where) / name
                with contextlib.suppress(OSError):
                    info = path.lstat()
                    if stat.S_ISREG(info.st_mode) and info.st_size >= SPARSE_BYTES // 2 and \
                            info.st_blocks * 512 >= SPARSE_BYTES // 2 and path not in reported:
                        reported.add(path)
                        self.violate(f"a sparse file made in a turn ({SPARSE_BYTES >> 20} MiB "
                                     f"apparent, no blocks) was copied densely: "
                                     f"{path.relative_to(root)} takes "
                                     f"{info.st_blocks * 512 >> 20} MiB")

    def _check_damaged_manifest(self) -> None:
        """A copy of a committed snapshot whose manifest is damaged (a shard length of 1e15,
        or nesting thousands deep) is refused with a nemo-ckpt error, not a traceback."""
        committed = [p for p in committed_snapshots(self.root)]
        if not committed:
            return
        copy = self.root / "damaged"
        shutil.copytree(environment_dir(committed[0]), environment_dir(copy))
        manifest = environment_dir(copy) / "manifest.json"
        kind = self.plan.damage
        if kind == "huge":
            data = json.loads(manifest.read_bytes())
            if not data.get("shards"):
                return
            data["shards"][0]["bytes"] = 10**15
            manifest.write_text(json.dumps(data))
        else:
            manifest.write_text("[" * 100_000 + "]" * 100_000)
        self.s.faults += 1
        try:
            read_snapshot(str(copy))
        except NemoCkptError:
            pass
        except BaseException as exc:
            what = "a shard length of 1e15" if kind == "huge" else "nested 100,000 deep"
            self.violate(f"a damaged manifest ({what}) made read_snapshot raise "
                         f"{type(exc).__name__}, not a nemo-ckpt error")
        else:
            self.violate(f"a damaged manifest ({kind}) was read as a snapshot")
        shutil.rmtree(copy, ignore_errors=True)

    # --- what a violation's message explains ----------------------------------------------

    def zombie_work(self, since: float) -> str:
        """What coordinators Ray had declared dead did after ``since``, for a message."""
        work = [(t, a, name) for t, a, name in self.zombie_io
                if t >= since and a.kind == COORDINATOR]
        if not work:
            return ""
        t, actor, name = work[-1]
        declared = next(d for d, a in self.world.declared if a is actor)
        return (f"; a zombie coordinator ({actor}, declared dead at t={declared:.2f} after "
                f"its node stalled, then run again) ran {name} there at t={t:.2f}: its "
                f"clean-up took the newer snapshot's claim for a dead predecessor's and "
                f"removed its files")

    def _queue_note(self, op_id: str | None) -> str:
        """Why ``op_id``'s holders may have stayed paused: its control calls waited (or
        wait now) for a concurrency slot behind turns waiting at a holder's gate."""
        waits = {f"{method} at {holder}" for _, holder, method, op, _, _, _
                 in self.queued_behind_turns if op == op_id}
        for actor in self.world.live(HOLDER):
            for queue in actor.queues.values():
                for method, payload, _, _, ahead in queue:
                    args = pickle.loads(payload) if method not in SESSION_METHODS and \
                        _session_calls(ahead) else ()
                    if args and args[0] == op_id:
                        waits.add(f"{method} at {actor.name}")
        if not waits:
            return ""
        return (f"; a control call queued behind turns and opens waiting at the gate, in the "
                f"holder's one concurrency group: {sorted(waits)}")

    def _stalled(self, record: OpRecord) -> bool:
        """Whether a fault could have stopped the lease renewals of ``record``."""
        end = record.end if record.end is not None else self.now()
        return any(record.start <= at <= end and (
            kind.startswith(("clock_jump", "cancel", "stall")) or kind in ("kill_coordinator",
                                                                  "kill_driver"))
            for at, kind in self.s.fired) \
            or any(record.start - CONFIG.lease_s <= at <= end
                   for at, _ in self.world.slow_links) \
            or self.killed_since(record.start, (COORDINATOR, "driver"))

    def _full_disk_during(self, record: OpRecord) -> tuple[float, float] | None:
        """A window of full disk that overlapped ``record``'s life."""
        end = record.end if record.end is not None else self.now()
        for k, (start, seconds) in enumerate(self.plan.enospc):
            if k in self.s.enospc_hit and start <= end and record.start <= start + seconds:
                return start, seconds
        return None

    def _captured_later(self, record: OpRecord) -> set[str | None]:
        """The snapshots into the same path that captured after ``record`` did: a
        holder pauses for one only once the one before released it, after its begin."""
        if record.begun is None:
            return set()
        later = {r.op_id for r in self.s.ops if r.path == record.path
                 and r.begun is not None and r.begun > record.begun}
        # Two commits into one path that overlap may land in either order (either may
        # be called the newer: DESIGN, "Committed is final"), whichever captured first
        # (seed 30822: two drivers of one job, one's begin answer lost).
        if record.body_end is not None:
            later |= {r.op_id for r in self.s.ops if r.path == record.path
                      and r is not record and r.body_end is not None
                      and (r.end is None or r.end > record.body_end)}
        return later


def _relayed_ends(method: str, args: tuple[Any, ...]) -> list[tuple[str, str]]:
    """The (holder's name, operation) of each abort or resume a relay call carries."""
    calls = args[2] if method == "relay_call" and len(args) > 2 else \
        args[1] if method == "relay_send" and len(args) > 1 else None
    if calls is None or args[0] not in _END_METHODS:
        return []
    return [(name, call_args[0]) for name, (_, call_args) in calls.items() if call_args]


def _session_calls(methods: tuple[str, ...]) -> str:
    """The workers' session calls (turns, opens: they wait at a paused holder's gate)
    among ``methods``, counted by method; "" if none."""
    counts: dict[str, int] = defaultdict(int)
    for method in methods:
        if method in SESSION_METHODS:
            counts[method] += 1
    return ", ".join(f"{n} {m}" for m, n in sorted(counts.items()))


# Which reviewed case (issue 11, then 23, then 29) a violation shows, by its wording.
CASES = [
    ("34.3 a turn recorded twice", ("recorded turn",)),
    ("34.3 a call retried after a lost answer refused", ("retried after an unavailable",)),
    ("34.4 refused by a claim of its own", ("was refused by a claim of its own",
                                             "refused by a collection claim of its own")),
    ("34.5 a claim left behind by a process that gave up", ("a claim was left behind",)),
    ("56.1 a continued adapted rollout that cannot be resumed",
     ("cannot be resumed with AdaptedRollout.resume",)),
    ("28.1 an adapted rollout continued on a history it does not reproduce",
     ("differs from a crash-free run", "diverged from its recorded turns",
      "other observations than those recorded")),
    ("26.1 a holder resumed for a snapshot whose block still ran",
     ("while its driver's block still ran",)),
    ("29.1 a zombie coordinator's clean-up removed a newer snapshot's files",
     ("a zombie coordinator",)),
    ("29.2 a call after the coordinator's death met its dead name",
     ("met the dead coordinator's name",)),
    ("29.3 control calls queued behind waiting turns", ("a control call queued behind",)),
    ("29.6 a driver with another config committed", ("made with another config",)),
    ("23.1 committed snapshot references a missing blob", ("references a blob that is",)),
    ("23.2 a file outside the sandbox read into one", ("the secret file outside every",)),
    ("50.5 a read of the root opened a planted FIFO", ("nemo_ckpt.storage.local_folder:",)),
    ("50.6 a stored record nested deep raised a traceback", ("raised RecursionError",)),
    ("50.7 a managed snapshot returned without its record", ("without its record",)),
    ("50.8 a sweep removed files through a link", ("through the link planted",)),
    ("23.3 a scan blocked on a FIFO", ("opening a FIFO",)),
    ("23.9 a call waits past its deadline (not on a FIFO)", ("a call waits past its deadline",)),
    ("23.4 lease lost although renewed on time", ("although its driver renewed on time",)),
    ("23.5 a sparse file copied densely", ("was copied densely",)),
    ("23.6 a damaged manifest raised a traceback", ("a damaged manifest",)),
    ("23.7 two jobs hold one checkpoint path", ("a second job claimed",)),
    ("23.8 a disk error escaped as OSError", ("raised OSError, not a nemo-ckpt error",)),
    ("30.1 the newest snapshot not listed first", ("is not listed first",)),
    ("34.1 a committed snapshot that does not restore", ("does not restore",)),
    ("34.2 a stored tree read past its budget", ("past its budget",)),
    ("1 committed snapshot lost", ("does not verify", "but no manifest is there",
                                   "was committed last, but")),
    ("2 holders left paused by a failed operation", ("paused for it", "restoring for it")),
    ("3 holders left paused by a cancelled driver", ("after its driver was cancelled",)),
    ("4 orphan turn of a cancelled worker", ("although its worker went away alive",)),
    ("5 restore left half-live", ("not all or nothing", "the retry of a failed restore")),
    ("6 restore lost its lease during a long read", ("during a long read",)),
    ("7 late begin paused a holder after its abort", ("a late call paused it again",)),
    ("52.1 a restore failed whole for a prompt-group group",
     ("the restore failed whole on RL's ledger", "rollouts of prompt-group groups")),
    ("52.2 a dropped rollout's session left on a holder", ("after retire_dropped()",)),
    ("52.3 rows RL still needs reported as orphans or cleared",
     ("RL still needs (published or sealed)",)),
    ("52.4 a finished-unsealed rollout run again",
     ("finished in the environment",)),
    ("10 refused snapshot committed", ("check against the cut failed", "whose check failed",
                                       "although its check failed")),
]


def case_of(violation: str) -> str:
    for name, marks in CASES:
        if any(m in violation for m in marks):
            return name
    return "other"
