"""The workload of a schedule: what a job does, apart from the faults that hit it and the
checks that judge it. The driver's script (snapshots into two paths, a crash and a
restore, a successor after its driver's death, second drivers without RL's ledger),
and the environment workers' rollouts, whose turns write RL's staging rows and, in a
fifth of the schedules, change sandbox directories. Each operation is recorded
(``OpRecord``) and handed to the checkers as it ends."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from actors.sim import SimActor
from nemo_ckpt.adapters import AdaptedRollout
from nemo_ckpt.errors import (
    BackendUnavailableError,
    EnvironmentAdapterError,
    NemoCkptError,
    SnapshotMismatchError,
    is_retriable,
)
from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.manager.config import RolloutCheckpointConfig
from nemo_ckpt.manager.record import RECORD_FILE
from nemo_ckpt.manager.rollout_manager import PARTIAL_SUFFIX, RolloutCheckpointManager
from nemo_ckpt.receipts import FinishedRollout
from nemo_ckpt.sessions import SessionClient
from nemo_ckpt.storage.snapshot_files import read_manifest, read_snapshot
from nemo_ckpt.testing.nemo_rl import STATE_FILE, NemoRlState
from nemo_ckpt.transport import COORDINATOR, HOLDER

from .checkers import Checkers
from .faults import DiskFaults, Faults
from .plan import CONFIG, SPARSE_BYTES
from .rl import NemoRL, NemoSaved, Saved, SimRL
from .state import RL_HALF, Driver, OpRecord, Part, State, remove_rl_half, short
from .text_env import CounterFramework, policy, reference

T = TypeVar("T")


@dataclass(frozen=True)
class NemoRestore:
    """A NeMo RL restore, as the checkers compare it with the snapshot: every restored
    session (instance, rollout, attempt), and those the integration retired."""

    continued_attempts: frozenset[tuple[str, str, int]]
    retired: frozenset[tuple[str, str, int]]


class RlHalf(NemoRlState):
    """``NemoRlState`` on RL's own disk: the faults of the checkpoint's disk
    (``DiskFaults``) do not reach its files, as they did not reach the simulation's RL
    half before issue 52."""

    def __init__(self, integration: NemoRlEnvironmentCheckpoint, nemo: NemoRL) -> None:
        super().__init__(integration, nemo.barrier, nemo.ledger, nemo.staging,
                         nemo.published)

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        await asyncio.sleep(0)
        with DiskFaults.off():
            return fn(*args)


class InjectedError(Exception):
    """Raised by the simulation inside a block, as RL's own failure would be."""


class Workload(Part):
    def __init__(self, s: State, check: Checkers, inject: Faults) -> None:
        super().__init__(s)
        self.check, self.inject = check, inject
        self.stop = False
        self._restart: list[tuple[str, Ep]] = []
        self._record_bombed = False  # Plan.record_bomb: done once
        # NeMo RL's side (Plan.nemo_rl): the attempts a restore continues, each sibling's
        # home instance, and the attempt ids (the double's, drawn from the seed).
        self._continue: list[tuple[str, Ep]] = []
        self._homes: list[str] = []
        self._ids = random.Random(f"nemo-rl-ids-{s.seed}")
        self._retries = 12  # live failures RL retries (a rollout failing always: no churn)
        if self.plan.nemo_rl:
            s.nemo = self._new_nemo()

    def on_send(self, caller: SimActor, callee: SimActor, method: str,
                args: tuple[Any, ...]) -> None:
        """Learn each operation's id from the first message its driver sends."""
        driver = self.s.drivers.get(caller)
        if driver is None:
            return
        if driver.record is not None and driver.record.op_id is None \
                and method in ("begin_snapshot", "prepare_restore") and args:
            driver.record.op_id = args[0]
            self.log(f"{driver.name} {driver.record.kind} {args[0]} "
                     f"({Path(driver.record.path).name})")

    # --- the driver's script --------------------------------------------------------------

    async def drive(self) -> None:
        for op in self.plan.ops:
            await asyncio.sleep(self.rng.uniform(0.3, 1.8))
            driver = await self.current_driver()
            if driver is None:
                return
            if op == "restore":
                await self._crash_and_restore()
                continue
            path = str(self.root / op.split(":")[1])
            task = self.world.spawn(driver.actor, self._snapshot(driver, path, checked=True))
            driver.op_task = task
            with contextlib.suppress(BaseException):
                await task
            driver.op_task = None

    async def current_driver(self) -> Driver | None:
        """The live main driver; after a driver's death a successor starts (a restarted
        controller of the same job)."""
        if self.s.driver is not None and self.s.driver.actor.alive:
            return self.s.driver
        await asyncio.sleep(self.rng.uniform(0.1, 2.0))
        config = None
        if self.plan.successor_config == "lease":  # adopted by the live coordinator
            config = self.config.model_copy(update={"lease_s": 9.0})
        elif self.plan.successor_config == "mismatch":  # refused: ConfigMismatchError
            config = self.config.model_copy(update={"max_state_bytes": 1 << 20})
        self.s.driver = Driver(self.s, f"driver-{len(self.world.actors)}", config)
        self.log(f"{self.s.driver.name} starts (successor, config differs in "
                 f"{self.s.driver.differs})")
        return self.s.driver

    async def _snapshot(self, driver: Driver, path: str, checked: bool) -> None:
        if self.s.nemo is not None and checked:  # NeMo RL's controller, before a snapshot
            await self._retire_dropped(self.s.nemo)
        if self.plan.manager and checked:
            await self._managed_snapshot(driver)
            return
        record = OpRecord(driver.name, "snapshot", path, self.now())
        self.s.ops.append(record)
        driver.record = record
        ckpt = driver.ckpt
        bad = checked and self.rng.random() < self.plan.bad_cut
        saved: Saved | NemoSaved | None = None
        held = False  # a snapshot of nothing yields None, which needs no check
        nemo = self.s.nemo if checked else None
        env: Any = ckpt if nemo is None else nemo.integration(ckpt)
        try:
            record.entered = self.now()
            async with env.snapshot(Path(path)) as snap:
                record.begun = self.now()
                held = snap is not None
                if nemo is not None:  # NeMo RL's: its barrier, ledger and staging say
                    saved = await self._nemo_cut(nemo, env, snap, record, bad)
                elif checked:
                    async with self.s.rl.checkpoint() as cut:
                        if snap is not None:
                            if bad:
                                cut = self.inject.corrupt(cut)
                            try:
                                await snap.check_against_cut(cut)
                            except SnapshotMismatchError:
                                self._check_failed(record, bad)
                        saved = self.s.rl.state(record.op_id or "?")
                await asyncio.sleep(  # RL saves its half
                    CONFIG.lease_s * self.rng.uniform(1.2, 2.0) if self.plan.long_save
                    else self.rng.uniform(0.0, 1.5))
                self.check.check_paused_through_block(record)
                record.body_end = self.now()
            record.outcome = "committed"
            self.check.check_unchecked_commit(driver, record, held and not checked)
            if saved is not None:
                self.s.saves[path] = saved
            if isinstance(saved, NemoSaved):
                self.check.check_drained(record, saved)
            self.s.committed[path].append(record.op_id or "?")
            self.log(f"{record.op_id} committed")
            self.check.check_commit(record)
            self.check.check_one_config(driver, record)
        except BaseException as exc:
            if record.begun is None:
                record.entry_failed = self.now()
            record.outcome = type(exc).__name__
            self.log(f"{record.op_id} failed: {type(exc).__name__}: {short(exc)}")
            if not isinstance(exc, asyncio.CancelledError):
                self.check.check_error_kind(exc, f"snapshot {record.op_id}")
                self.check.check_dead_name(record, exc)
                await self.check.check_failed_snapshot(record, exc)
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise
        finally:
            record.end = self.now()
            driver.record = None
            self.check.check_deadlines(record, driver.config)

    def _check_failed(self, record: OpRecord, bad: bool) -> None:
        """The check of ``record`` under RL's cut raised ``SnapshotMismatchError``: noted,
        and raised on unless RL catches it (a bad cut, in some schedules)."""
        record.check_failed = True
        assert record.op_id is not None
        self.s.failed_checks.add(record.op_id)
        self.log(f"check of {record.op_id} failed (caught: {self.plan.catch_mismatch and bad})")
        if not (self.plan.catch_mismatch and bad):
            raise

    async def _nemo_cut(self, nemo: NemoRL, env: NemoRlEnvironmentCheckpoint, snap: Any,
                        record: OpRecord, bad: bool) -> NemoSaved:
        """NeMo RL's cut of a snapshot: its barrier's checkpoint, the check through the
        integration (``bad``: a staging listing RL could not have taken), and RL's half
        saved with ``NemoRlState`` (beside the store: ``rl-halves/<op id>``)."""
        async with nemo.barrier.checkpoint() as cut:
            unsealed = nemo.finished_unsealed(record.entered or 0.0)
            if snap is not None:
                nemo.corrupt = self.inject.corrupt_listing if bad else None
                try:
                    await snap.check_against_cut(cut)
                except SnapshotMismatchError:
                    self._check_failed(record, bad)
                finally:
                    nemo.corrupt = None
                if not bad:
                    self.check.check_rows_needed(nemo, snap, record)
            half = str(self.root / "rl-halves" / (record.op_id or "none"))
            await RlHalf(env, nemo).save(cut, half)
            return NemoSaved(record.op_id or "?", half, frozenset(nemo.drained),
                             tuple(unsealed))

    async def _managed_snapshot(self, driver: Driver) -> None:
        """A snapshot through the driver's ``RolloutCheckpointManager`` (``Plan.manager``):
        its folder name, its check under RL's cut (NeMo RL's shape), RL's save as its
        ``RlHalf``, its rename and its retention; the same checks as any snapshot."""
        name = f"rollout-{len(self.s.ops):04d}"
        record = OpRecord(driver.name, "snapshot", str(self.root / (name + PARTIAL_SUFFIX)),
                          self.now())
        self.s.ops.append(record)
        driver.record = record
        bad = self.rng.random() < self.plan.bad_cut
        nemo = self.s.nemo
        assert nemo is not None  # Plan.manager only in the nemo_rl schedules
        env = nemo.integration(driver.ckpt)
        saved: list[NemoSaved] = []
        unsealed: list[str] = []
        workload = self

        class Barrier:
            @contextlib.asynccontextmanager
            async def checkpoint(self) -> Any:
                record.begun = workload.now()
                async with nemo.barrier.checkpoint() as cut:
                    unsealed[:] = nemo.finished_unsealed(record.entered or 0.0)
                    yield cut

        class Half:
            async def save(self, cut: Any, path: str) -> None:
                # RL's half on disk as it begins (a sweep must leave it), then its time.
                await RlHalf(env, nemo).save(cut, path)
                saved.append(NemoSaved(record.op_id or "?", path, frozenset(nemo.drained),
                                       tuple(unsealed)))
                (Path(path) / RL_HALF).write_bytes(b"RL's half")
                await asyncio.sleep(workload.rng.uniform(0.0, 1.5))
                workload.check.check_paused_through_block(record)
                record.body_end = workload.now()

            async def restore(self, path: str, restored: Any) -> None:
                raise AssertionError("the simulation restores by path")

            async def remove(self, path: str) -> None:
                remove_rl_half(path)
                (Path(path) / STATE_FILE).unlink(missing_ok=True)
                workload.log(f"RL's half of {Path(path).name} removed (managed)")

        if driver.manager is None:
            driver.manager = RolloutCheckpointManager(
                env, Barrier(), Half(),
                RolloutCheckpointConfig(root=str(self.root), snapshot_attempt_interval_s=1.0,
                                        keep_latest_k=2, max_consecutive_failures=100),
                names=lambda: self.s.next_managed_name, on_event=self.managed_event,
                clock=self.world.runtime(driver.actor).clock.monotonic)
        manager = driver.manager
        self.s.next_managed_name = name
        # This operation's barrier, RL half and integration (a restore made a new RL).
        manager.barrier, manager.rl, manager.checkpoint = Barrier(), Half(), env
        nemo.corrupt = self.inject.corrupt_listing if bad else None
        error: BaseException | None = None
        try:
            record.entered = self.now()
            taken = await manager.snapshot()
        except SnapshotMismatchError as exc:
            record.check_failed, error = True, exc
            if record.op_id is not None:
                self.s.failed_checks.add(record.op_id)
        except BaseException as exc:
            error = exc
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise
        else:
            error = manager.last_failure if taken is None else None
        finally:
            nemo.corrupt = None
            record.end = self.now()
            driver.record = None
            self.check.check_deadlines(record, driver.config)
        if error is None:
            assert taken is not None
            lost = [name for name in (RECORD_FILE, RL_HALF)
                    if not (Path(taken.path) / name).is_file()]
            if taken.path not in self.s.managed_removing and lost:
                self.check.violate(f"{record.op_id} was returned as taken without its record "
                                   f"or RL's half ({', '.join(lost)} gone): it can never be "
                                   f"listed or restored")
            if self.plan.record_bomb and not self._record_bombed:
                # A hostile writer's record, 200 KB nested 100,000 deep: every later
                # snapshot's retention reads it (issue 50, case 6).
                self._record_bombed = True
                self.s.faults += 1
                (Path(taken.path) / RECORD_FILE).write_bytes(
                    b'{"format": 1, "fingerprint": {"x": ' + b"[" * 100_000
                    + b"]" * 100_000 + b"}}")
                self.log(f"fault: {Path(taken.path).name}'s record nested 100,000 deep")
            record.path, record.outcome = taken.path, "committed"
            self.s.saves[taken.path] = dataclasses.replace(saved[-1], half=taken.path)
            self.check.check_drained(record, saved[-1])
            self.s.committed[taken.path].append(record.op_id or "?")
            self.log(f"{record.op_id} committed (managed, {Path(taken.path).name})")
            self.check.check_commit(record)
            self.check.check_one_config(driver, record)
            return
        record.outcome = type(error).__name__
        self.log(f"{record.op_id} failed (managed): {type(error).__name__}: {short(error)}")
        if not isinstance(error, asyncio.CancelledError):
            self.check.check_error_kind(error, f"snapshot {record.op_id}")
            self.check.check_dead_name(record, error)
            await self.check.check_failed_snapshot(record, error)

    def managed_event(self, event: str, path: str) -> None:
        if event != "removing":
            return
        # Retention begins to remove it: from now on no snapshot RL may restore (its
        # manifest goes first; a removal that fails after that is retried later).
        self.s.managed_removing.add(path)
        gone = Path(path).resolve()
        for key in [k for k in self.s.committed if Path(k).resolve() == gone]:
            self.s.saves.pop(key, None)
            self.s.committed.pop(key, None)
        self.log(f"retention removes {Path(path).name} (managed)")

    async def second_driver(self, at: float, k: int) -> None:
        await asyncio.sleep(at)
        # Without RL's ledger: it takes no cut, and only some are allowed to commit so.
        allowed = random.Random(f"unchecked-{self.seed}-{k}").random() < 0.5
        driver = Driver(self.s, f"second-{k}", self.config.model_copy(
            update={"allow_unchecked_snapshots": allowed}))
        self.log(f"{driver.name} starts")
        task = self.world.spawn(driver.actor, self._snapshot(
            driver, str(self.root / "C"), checked=False))
        with contextlib.suppress(BaseException):
            await task

    # --- crash and restore ----------------------------------------------------------------

    async def _crash_and_restore(self) -> None:
        candidates = []
        for path, saved in sorted(self.s.saves.items()):
            with contextlib.suppress(Exception):
                if read_manifest(path).snapshot_id == saved.snapshot_id:
                    candidates.append(path)
        if not candidates:
            return
        path = self.rng.choice(candidates)
        saved = self.s.saves[path]
        self.log(f"CRASH; restore from {Path(path).name} ({saved.snapshot_id})")
        for worker in list(self.s.workers.values()):
            self.world.kill(worker)
        for actor in self.world.live(HOLDER) + self.world.live(COORDINATOR):
            self.world.kill(actor)
        if self.s.driver is not None:
            self.world.kill(self.s.driver.actor)
        self.s.rollout_tasks.clear()
        try:
            loaded = read_snapshot(path)
        except NemoCkptError as exc:
            self.check.unreadable_at_restore(saved.snapshot_id, exc)
            return
        # RL's half, restored inside restored(): every unfinished rollout of the cut either
        # continues (captured) or starts over as its next attempt.
        self.s.rl = SimRL()
        self.s.saves = {}  # RL's process restarts: the saves it knows of are made anew
        if self.s.nemo is not None:  # each attempt loads RL's half into a new one
            self.s.nemo = self._new_nemo()
        driver = Driver(self.s, f"driver-{len(self.world.actors)}")
        self.s.driver = driver
        record = OpRecord(driver.name, "restore", path, self.now())
        self.s.ops.append(record)
        driver.record = record
        raise_inside = self.plan.raise_in_restore and self.rng.random() < 0.5
        # Some restores are read ahead first (RayEnvironmentCheckpoint.prefetch): of the
        # snapshot restored, or of another one, whose reads the restore must drop.
        ahead = self.rng.choice([None, None, path, self.rng.choice(candidates)])
        task = self.world.spawn(driver.actor, self._restore(driver, path, saved,
                                                            raise_inside, ahead))
        driver.op_task = task
        try:
            restored = await task
        except BaseException as exc:
            record.outcome = type(exc).__name__
            record.failed_at, record.failed_id = self.now(), record.op_id
            self.log(f"restore {record.op_id} failed: {type(exc).__name__}: {short(exc)}")
            if not isinstance(exc, asyncio.CancelledError):
                if not isinstance(exc, InjectedError):
                    self.check.check_error_kind(exc, f"restore {record.op_id}")
                await self.check.check_failed_restore(record, loaded)
            if not (is_retriable(exc) or isinstance(exc, InjectedError)) \
                    or not driver.actor.alive:
                self._restore_given_up()
                return
            # RL retries, as is_unavailable says, a few times with a pause between.
            again: BaseException | None = exc
            for _ in range(4):
                await asyncio.sleep(self.rng.uniform(0.5, 2.0))
                self.log("retrying the restore")
                try:
                    restored = await self.world.spawn(
                        driver.actor, self._restore(driver, path, saved, False))
                except BaseException as error:
                    again = error
                    self.log(f"retry failed: {type(error).__name__}: {short(error)}")
                    if is_retriable(error) and driver.actor.alive:
                        continue
                else:
                    again = None
                break
            if again is not None:
                self.check.check_failed_retry(record, again)
                self._restore_given_up()
                return
        finally:
            record.end = self.now()
            driver.op_task = None
            driver.record = None
        record.outcome = "committed"
        results = driver.ckpt.restored_results
        if isinstance(restored, NemoRestore):
            await self.check.check_restored(restored, loaded, results, restored.retired)
            await self._apply_nemo_restore()
            await self.start_workers(fresh=False, restored=restored)
            return
        await self.check.check_restored(restored, loaded, results)
        self._apply_restore(saved, restored, results)
        if results:  # RL recorded them above: the backend lets go
            await self._acknowledge([r.episode for r in results])
        await self.start_workers(fresh=False, restored=restored)

    async def _restore(self, driver: Driver, path: str, saved: Saved, raise_inside: bool,
                       ahead: str | None = None) -> Any:
        if ahead is not None:
            try:
                started = await driver.ckpt.prefetch(Path(ahead))
                self.log(f"prefetch of {Path(ahead).name}: {started} shard reads started")
            except Exception as exc:  # a prefetch that fails changes nothing
                self.log(f"prefetch of {Path(ahead).name} failed: {type(exc).__name__}")
        if self.plan.nemo_rl:  # RL's ledger loaded first, then the hand-over
            return await self._nemo_rl_restore(driver, saved, path, raise_inside)
        async with driver.ckpt.restored(Path(path)) as restored:
            if raise_inside:
                self.s.faults += 1
                self.log("fault: RL's restore raises inside restored()")
                raise InjectedError("RL's own restore failed")
            return restored

    async def _nemo_rl_restore(self, driver: Driver, saved: NemoSaved, path: str,
                               raise_inside: bool) -> NemoRestore:
        """NeMo RL's restore: a new RL process (ledger, barrier, staging), the
        environment's ``restored()``, inside it RL's half loaded with ``NemoRlState``
        and handed over (``prepare_for_restart``), then what it kept checked."""
        nemo = self.s.nemo = self._new_nemo()
        env = nemo.integration(driver.ckpt)
        async with env.restored(Path(path)) as restored:
            if raise_inside:
                self.s.faults += 1
                self.log("fault: RL's restore raises inside restored()")
                raise InjectedError("RL's own restore failed")
            try:
                plan = await RlHalf(env, nemo).restore(saved.half, restored)
            except (ValueError, RuntimeError, TypeError) as exc:
                self.check.violate(f"the restore failed whole on RL's ledger "
                                   f"({type(exc).__name__}: {short(exc)}), prompt-group "
                                   f"groups {sorted(nemo.prompt_groups())}")
                raise
        self.log(f"the hand-over continues {len(plan.restored_gym_episodes)} rollout(s), "
                 f"drops {len(plan.dropped)} ({len(plan.abandoned)} of abandoned groups)")
        self.check.check_hand_over(nemo, saved, plan)
        # What the checkers compare with the snapshot: every restored session, handed
        # over or retired (the owners are the instances).
        return NemoRestore(frozenset(plan.restored_gym_episodes | plan.dropped),
                           frozenset(plan.dropped))

    def _restore_given_up(self) -> None:
        """RL gave its restore up: a NeMo RL job starts again with nothing (not a ledger
        a failed attempt half loaded)."""
        if self.s.nemo is not None:
            self.s.nemo = self._new_nemo()

    def _new_nemo(self) -> NemoRL:
        return NemoRL(self.plan, self._ids, self.now, self.log)

    async def _apply_nemo_restore(self) -> None:
        """RL after its restore: the loaded groups' prompts bound again, the published
        groups trained in time, fresh attempts for the dropped siblings; then which
        attempts start and which continue."""
        nemo = self.s.nemo
        assert nemo is not None
        await nemo.bind_prompts()
        for group_id in sorted(nemo.published.groups):
            after = self.plan.nemo_groups[NemoRL.plan_index(group_id)].train_after
            nemo.train_later(group_id, after or 0.0)
        await nemo.retry_dropped()
        self._restart, self._continue = nemo.to_run(self._homes)

    def _apply_restore(self, saved: Saved, restored: Any,
                       results: tuple[FinishedRollout, ...]) -> None:
        continued = {(i, r): a for i, r, a in restored.continued_attempts}
        handed = {(r.instance_id, r.episode): r for r in results}
        if results:
            self.log(f"the restore handed back {len(results)} finished result(s): "
                     f"{sorted(r.episode.capture_key for r in results)}")
        for result in results:
            expected = result.episode in saved.expected.get(result.instance_id, ())
            if not expected and result.episode.rollout_id not in saved.finished:
                self.check.violate(f"the restore handed back {result.instance_id}/"
                                   f"{result.episode.capture_key}, which RL's saved ledger "
                                   f"neither expects there nor recorded as finished")
        for instance, eps in saved.expected.items():
            for ep in eps:
                if (instance, ep) in handed:
                    # Finished before the cut, recorded now: never run again.
                    self.s.rl.finished.add(ep.rollout_id)
                    continue
                nxt = ep.next_attempt()
                self.s.rl.expected[instance].add(nxt)
                self.s.rl.where[ep.rollout_id] = (instance, nxt)
                if (instance, ep.rollout_id) not in continued:
                    self.s.rl.expected[instance].discard(nxt)  # re-dispatched by its worker
                    del self.s.rl.where[ep.rollout_id]
                    self._restart.append((instance, nxt))
        self.s.rl.rows = set(saved.rows & restored.staging_keys)
        self.s.rl.finished = set(saved.finished)

    # --- workers --------------------------------------------------------------------------

    async def start_workers(self, fresh: bool, restored: Any = None) -> None:
        infos = None
        for _ in range(5):  # the coordinator may be dying: RL retries, as is_unavailable says
            driver = await self.current_driver()  # or its successor, if it was killed
            if driver is None:
                return
            try:
                infos = await driver.ckpt.holders()
                break
            except BackendUnavailableError:
                pass
            except asyncio.CancelledError:
                if driver.actor.alive:
                    raise
                # The driver was killed during the call: its successor asks next.
            await asyncio.sleep(1.0)
        if infos is None:
            return
        self.s.workers = {}
        for info in infos:
            worker = self.world.new_actor("worker", f"worker-{info.instance_id}",
                                          info.node_id)
            self.s.workers[info.instance_id] = worker
        if fresh and self.s.nemo is not None:  # a group per rollout of a node
            self._restart = []
            self._homes = sorted(info.instance_id for info in infos)
            if self._homes:  # none found (all dying at the start): RL reserves nothing
                await self.s.nemo.reserve(len(self._homes))
            for instance, ep in self.s.nemo.to_run(self._homes)[0]:
                self._spawn_rollout(instance, ep, 0, True)
            return
        if fresh:
            self._restart = []
            for info in infos:
                for k in range(self.plan.rollouts_per_node):
                    ep = Ep(self._rollout_id(info.instance_id, k), 0)
                    self._spawn_rollout(info.instance_id, ep, 0, True)
            return
        assert restored is not None
        sessions = await self.s.live_sessions()
        continued = self._continue if self.s.nemo is not None else [
            (instance, Ep(rollout_id, attempt + 1))
            for instance, rollout_id, attempt in sorted(restored.continued_attempts)]
        self._continue = []
        for instance, ep in continued:
            turns = next((len(s.turns) for s in sessions.get(instance, [])
                          if s.episode == ep), 0)
            self._spawn_rollout(instance, ep, turns, False)
        for instance, ep in self._restart:
            self._spawn_rollout(instance, ep, 0, True)
        self._restart = []

    def _rollout_id(self, instance: str, k: int) -> str:
        """The id of a node's ``k``-th rollout: the first one's ``plan.long_id``
        characters long, when the plan draws long ids (near and past what a restored
        directory's name can hold)."""
        rollout_id = f"{instance}-r{k}"
        if k == 0 and self.plan.long_id is not None:
            rollout_id = f"{rollout_id}-".ljust(self.plan.long_id, "x")
        return rollout_id

    def _spawn_rollout(self, instance: str, ep: Ep, start: int, fresh: bool) -> None:
        worker = self.s.workers.get(instance)
        if worker is None:
            return
        task = self.world.spawn(worker, self._rollout(worker, instance, ep, start, fresh))
        self.s.rollout_tasks[ep.capture_key] = task
        self.s.rollout_worker[ep.capture_key] = worker

    async def _rollout(self, worker: SimActor, instance: str, ep: Ep, start: int,
                       fresh: bool) -> None:
        transport = self.world.transport(worker, self.config)
        try:
            await asyncio.sleep(self.rng.uniform(0.0, 0.5))
            handle = transport.holder(instance)
            if handle is None:
                return
            client = SessionClient(handle, transport)
            nemo = self.s.nemo
            if nemo is not None and not await nemo.dispatch(instance, ep):
                self.log(f"rollout {ep.capture_key}: RL's ledger moved on from it")
                return
            if self.plan.adapted:
                await self._adapted_rollout(client, instance, ep, fresh)
                return
            if fresh and nemo is None:
                await self.s.rl.dispatch(instance, ep)
            if fresh:
                directory = None
                if self.sandbox_root is not None:
                    # A worker's own name for it: a long id is not a file name here.
                    directory = self.sandbox_root / "work" / (
                        ep.capture_key[:64] if nemo is None else ep.capture_key[-64:])
                    shutil.rmtree(directory, ignore_errors=True)
                    directory.mkdir(parents=True)
                    (directory / "state").write_bytes(f"{ep.rollout_id}:0".encode())
                await self._retried(f"open of {ep.capture_key}", lambda: client.open(
                    ep, f"{ep.rollout_id}:0".encode(), directory=directory))
            for t in range(start, self.plan.turns):
                if self.stop:
                    return
                await self._retried(f"turn {t} of {ep.capture_key}",
                                    functools.partial(self._turn, client, ep, t))
                await asyncio.sleep(self.rng.uniform(0.0, 0.2))
            if nemo is not None:
                await self._closed(nemo, client, instance, ep)
                return
            final = await self._retried(f"finish of {ep.capture_key}", lambda: client.finish(
                ep, f"{ep.rollout_id}:done".encode()))  # the receipt
            self.check.check_turns_once(final, "as handed in")
            await self._finish(instance, ep)
        except Exception as exc:
            self.log(f"rollout {ep.capture_key} gives up: {type(exc).__name__}: {short(exc)}")
            self.check.check_error_kind(exc, f"a session call of {ep.capture_key}")
            if self.s.nemo is not None and not self.stop:
                await self._nemo_failed(self.s.nemo, ep)

    async def _closed(self, nemo: NemoRL, client: SessionClient, instance: str, ep: Ep
                      ) -> None:
        """NeMo Gym's end of a rollout: its session closed (NeMo RL never acknowledges
        a result), its reply on its way to RL, which seals it later (or its drain, before
        a cut). Closed once: a close whose answer was lost is a failed rollout."""
        final = await client.close(ep)
        self.check.check_turns_once(final, "as closed")
        nemo.deliver(instance, ep, tuple(sorted(final.staging_keys)),
                     self.rng.uniform(0.0, self.plan.seal_delay))

    async def _nemo_failed(self, nemo: NemoRL, ep: Ep) -> None:
        """RL's answer to a rollout that failed live: its group's unsealed work abandoned
        as its granularity says and retried; the dropped sessions retired
        (``retire_dropped``), then the fresh attempts started."""
        if self._retries <= 0 or not await nemo.fail(ep):
            return
        self._retries -= 1
        self.log(f"RL abandons the unsealed work of {ep.capture_key}'s group, retries it")
        await self._retire_dropped(nemo)
        if self.stop or self.s.nemo is not nemo:
            return
        for instance, fresh in nemo.to_run(self._homes)[0]:
            if fresh.capture_key not in self.s.rollout_tasks:
                self._spawn_rollout(instance, fresh, 0, True)

    async def _retire_dropped(self, nemo: NemoRL) -> None:
        """The integration's ``retire_dropped()`` from the live driver; the sessions of
        dropped rollouts held before it must be gone after it."""
        driver = self.s.driver
        if driver is None or not driver.actor.alive:
            return
        env = nemo.integration(driver.ckpt)
        dropped = nemo.dropped()
        try:
            before = await self.s.live_sessions()
        except Exception:  # a holder died as it was asked: nothing to compare with
            return
        try:
            sent = await self.world.spawn(driver.actor, env.retire_dropped())
        except Exception as exc:
            self.log(f"retire_dropped failed: {type(exc).__name__}: {short(exc)}")
            self.check.check_error_kind(exc, "retire_dropped")
            return
        self.log(f"retire_dropped retired {len(sent)} episode(s)")
        try:
            after = await self.s.live_sessions()
        except Exception:
            return
        self.check.check_retired(dropped, before, after)

    async def _write_row(self, key: str) -> None:
        if self.s.nemo is not None:
            await self.s.nemo.write_row(key)
        else:
            await self.s.rl.write_row(key)

    async def _retried(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, run again as a worker following the docs does while its error's
        ``is_unavailable`` is true (nothing changed), a few times; a retry refused only
        because the first call had landed (its answer lost) is a violation."""
        for attempt in range(4):
            try:
                return await call()
            except NemoCkptError as exc:
                if not is_retriable(exc) or attempt == 3 or self.stop:
                    if attempt:
                        self.check.check_retry_refusal(exc, what)
                    raise
                self.log(f"{what} retried: {type(exc).__name__}: {short(exc)}")
            await asyncio.sleep(self.rng.uniform(0.1, 1.0))
        raise AssertionError("unreachable")

    async def _turn(self, client: SessionClient, ep: Ep, t: int) -> None:
        """Turn ``t``: its record names its step, so a turn recorded twice shows."""
        async with client.turn(ep) as turn:
            await asyncio.sleep(self.rng.uniform(0.05, 0.6))
            key = f"{ep.capture_key}/row{t}"
            await self._write_row(key)
            state = f"{ep.rollout_id}:{t + 1}".encode()
            if turn.directory is not None:
                # A retry after an aborted turn: the environment undoes what that turn
                # did to its directory (nemo-ckpt does not roll a live directory back).
                (turn.directory / "state").write_bytes(turn.state)
                self._sandbox_turn(ep, turn.directory, turn.state, t, state)
            turn.complete(f"t{t}".encode(), state, [key])
        self.check.check_turn_count(turn.session, t + 1, f"after turn {t}")

    async def _adapted_rollout(self, client: SessionClient, instance: str, ep: Ep,
                               fresh: bool) -> None:
        """A rollout of a text environment through ``AdaptedRollout``: ``init`` and
        ``plan.turns - 1`` steps, each a turn that writes its staging row; a continued
        rollout is rebuilt by replay, which the checkers compare with a crash-free run."""
        framework = CounterFramework(ep.rollout_id, max(1, self.plan.turns - 1))

        async def staging(turn: int) -> list[str]:
            await asyncio.sleep(self.rng.uniform(0.05, 0.6))  # the model's time, in the turn
            key = f"{ep.capture_key}/row{turn}"
            await self._write_row(key)
            return [key]

        if fresh:
            if self.s.nemo is None:
                await self.s.rl.dispatch(instance, ep)
            rollout = await AdaptedRollout.start(client, ep, framework, framework.prompt,
                                                 staging=staging)
        else:
            try:
                rollout = await AdaptedRollout.resume(client, ep, framework)
            except EnvironmentAdapterError as exc:  # the README's call, as the example makes it
                self.check.violate(f"the continued rollout {ep.capture_key} cannot be "
                                   f"resumed with AdaptedRollout.resume: {short(exc)}")
                return
            self.log(f"rollout {ep.capture_key} rebuilt by {rollout.rebuilt_by} at "
                     f"{len(rollout.records)} turn(s)")
            self.check.check_adapted_rollout(ep, rollout, reference(framework), "resumed")
        while not rollout.done:
            if self.stop:
                return
            await rollout.step(policy(ep.rollout_id, len(rollout.records)), staging)
            await asyncio.sleep(self.rng.uniform(0.0, 0.2))
        self.check.check_adapted_rollout(ep, rollout, reference(framework), "finished")
        if self.s.nemo is not None:
            rollout.close()
            await self._closed(self.s.nemo, client, instance, ep)
            return
        await rollout.finish()  # the receipt
        await self._finish(instance, ep)

    def _sandbox_turn(self, ep: Ep, directory: Path, before: bytes, t: int,
                      after: bytes) -> None:
        """A turn's work in its directory: it must start as the session's state says
        (after a restore too), then a file is added, one edited, one removed."""
        self.check.check_turn_directory(ep, directory, before, t)
        # Replaced, not written through: a turn run again (its answer lost) must not
        # follow the link the sandbox's process swapped in (HostileSandbox) to the secret.
        (directory / f"t{t}").unlink(missing_ok=True)
        (directory / f"t{t}").write_bytes(b"x" * (t + 1))
        if self.plan.sparse and t == 1 and not (directory / "sparse").exists():
            self.s.faults += 1
            self.log(f"a turn of {ep.capture_key} makes a sparse file")
            with open(directory / "sparse", "wb") as f:
                f.truncate(SPARSE_BYTES)
        (directory / "state").write_bytes(after)
        with contextlib.suppress(FileNotFoundError):
            (directory / f"t{t - 2}").unlink()

    async def _finish(self, instance: str, ep: Ep) -> None:
        """RL records the result, then acknowledges it, with no lock against snapshots:
        the backend keeps the result the worker handed in until then."""
        del instance
        await self.s.rl.record_finish(ep)
        await self._acknowledge([ep])

    async def _acknowledge(self, eps: list[Ep]) -> None:
        for _ in range(20):
            driver = self.s.driver
            if driver is not None and driver.actor.alive:
                try:
                    await driver.ckpt.acknowledge(eps)
                    return
                except NemoCkptError as exc:
                    self.log(f"acknowledge {[e.capture_key for e in eps]}: "
                             f"{type(exc).__name__}")
            await asyncio.sleep(self.rng.uniform(0.2, 1.0))

    async def stop_workers(self) -> None:
        self.stop = True
        tasks = [t for t in self.s.rollout_tasks.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=CONFIG.lease_s + 5)
        for key, task in self.s.rollout_tasks.items():
            if not task.done():
                self.log(f"stopping rollout {key} (cancelled)")
                task.cancel()
        await asyncio.sleep(CONFIG.phase_timeout_s)
