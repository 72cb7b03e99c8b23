"""The scenarios ``nemo_ckpt.integrations.nemo_rl`` must survive, run on any NeMo RL
objects: a conformance suite a NeMo RL team runs on its own ledger, barrier and staging
partition (issue 52).

Each case drives NeMo RL's own calls (``reserve_group``, ``mark_group_dispatched``,
``mark_sibling_sealed``, ``abandon_unsealed``, ``discard_group``, ``state_dict`` and
``load_state_dict``, the barrier's ``mutation()`` and ``checkpoint()``, ...) on objects
made by the factories it is given, through ``NemoRlEnvironmentCheckpoint`` on a backend
the caller gives (``ConformanceBackend``: our double's CI runs it on the in-process
world; a team can run it on a Ray cluster), and asserts what a user sees: the ledger's
statuses, the sessions the holders keep, the rows kept, the errors::

    from nemo_ckpt.testing.nemo_rl_conformance import NemoRlFactories, conformance_cases

    FACTORIES = NemoRlFactories(ledger=RolloutRecoveryLedger,
                                barrier=DataPlaneCheckpointBarrier,
                                staging=MyStagingAdapter, granularity=RecoveryGranularity,
                                level=RecoveryTargetLevel)

    @pytest.mark.parametrize("case", conformance_cases(FACTORIES), ids=str)
    def test_nemo_rl_conformance(case, my_backend):
        asyncio.run(case.run(my_backend))

The staging object needs ``put(cut, key, value)``, an async ``list_keys()`` and
``keep_only(cut, keep)`` (returning the keys it cleared). A case raises
``AssertionError`` naming what differed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from nemo_ckpt.errors import BackendUnavailableError, UnmappedOwnerError
from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint, RestartPlan
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.storage.checkpoint_folder import environment_dir
from nemo_ckpt.testing import nemo_rl as double

__all__ = ["ConformanceBackend", "ConformanceCase", "NemoRlFactories", "conformance_cases"]


class ConformanceBackend(Protocol):
    """Where the cases run: a checkpoint and its holders' session clients.

    ``checkpoint``: a ``RayEnvironmentCheckpoint`` whose holders are up;
    ``instances``: two instance ids of its holders at least (they may be one twice);
    ``client(instance)``: a ``SessionClient`` of that holder; ``crash()``: the job dies
    and starts again (every holder and session gone, holders up again, same ids);
    ``path(name)``: a fresh checkpoint path the checkpoint may write."""

    checkpoint: Any
    instances: tuple[str, str]

    async def client(self, instance: str) -> Any: ...

    async def crash(self) -> None: ...

    def path(self, name: str) -> Path: ...


@dataclass(frozen=True)
class NemoRlFactories:
    """NeMo RL's objects, made fresh for each case.

    Attributes:
        ledger: A new, empty ``RolloutRecoveryLedger`` (schema 4 or newer).
        barrier: A new ``DataPlaneCheckpointBarrier``.
        staging: A new staging partition (the module docstring says what it needs).
        granularity: NeMo RL's ``RecoveryGranularity`` enum.
        level: NeMo RL's ``RecoveryTargetLevel`` enum.
        ledger_with_retirements: A ledger with ``gym_checkpoint_retirements`` and
            ``mark_gym_retired`` (a newer revision), for the retirement cases' second
            way; None when the team's ledger has no queue.
    """

    ledger: Callable[[], Any] = double.RolloutRecoveryLedger
    barrier: Callable[[], Any] = double.DataPlaneCheckpointBarrier
    staging: Callable[[], Any] = double.StagingPartition
    granularity: Any = double.RecoveryGranularity
    level: Any = double.RecoveryTargetLevel
    ledger_with_retirements: Optional[Callable[[], Any]] = None


@dataclass(frozen=True)
class ConformanceCase:
    """One scenario; ``await case.run(backend)`` runs it."""

    name: str
    scenario: Callable[[_Job], Awaitable[None]]
    factories: NemoRlFactories
    ledger: Callable[[], Any]

    def __str__(self) -> str:
        return self.name

    async def run(self, backend: ConformanceBackend) -> None:
        await self.scenario(_Job(self.factories, self.ledger, backend))


_REPLICAS = ("gym/replica-0", "gym/replica-1")


class _Job:
    """A NeMo RL job on the backend: its ledger, barrier and staging partition, Gym's
    workers turning rollouts, replies on the wire, and RL's published groups."""

    def __init__(self, factories: NemoRlFactories, ledger: Callable[[], Any],
                 backend: ConformanceBackend) -> None:
        self.f = factories
        self.new_ledger = ledger
        self.ledger = ledger()
        self.barrier = factories.barrier()
        self.staging = factories.staging()
        self.backend = backend
        self.owners = dict(zip(_REPLICAS, backend.instances[:2], strict=True))
        self.published: dict[str, frozenset[str]] = {}
        self.wire: list[tuple[str, int, Ep, tuple[str, ...]]] = []
        self.saved: Any = None
        self.prompts = 0
        self.env = self.integration()

    def integration(self, **kwargs: Any) -> NemoRlEnvironmentCheckpoint:
        kwargs.setdefault("owners", self.owners)
        kwargs.setdefault("retained", self.retained)
        kwargs.setdefault("drain", self.drain)
        return NemoRlEnvironmentCheckpoint(self.backend.checkpoint,
                                           ledger=lambda: self.ledger,
                                           staging=self.staging.list_keys, **kwargs)

    def retained(self) -> frozenset[str]:
        return frozenset(k for keys in self.published.values() for k in keys)

    async def client(self, owner: str) -> Any:
        return await self.backend.client(self.owners[owner])

    async def dispatch(self, group: str, owner: str, generations: int = 2,
                       granularity: str = "SIBLING") -> list[Ep]:
        self.prompts += 1  # NeMo RL's prompt payload carries its dataset index
        async with self.barrier.mutation() as cut:
            self.ledger.reserve_group(
                cut, group_id=group, prompt_id=str(self.prompts),
                prompt_payload={"idx": self.prompts},
                expected_generations=generations, target_step=1, start_weight_version=0,
                recovery_granularity=getattr(self.f.granularity, granularity),
                restore_level=self.f.level.TURN)
            self.ledger.mark_group_dispatched(cut, group, gym_instance_id=owner)
        eps = self.episodes(group, generations)
        client = await self.client(owner)
        for ep in eps:
            await client.open(ep, b"s0")
        return eps

    def episodes(self, group: str, generations: int) -> list[Ep]:
        record = self.ledger.get_group(group)
        return [Ep(*record.gym_episode(i)) for i in range(generations)]

    async def turn(self, owner: str, ep: Ep, n: int) -> None:
        client = await self.client(owner)
        async with client.turn(ep) as turn:
            key = f"{ep.capture_key}/row{n}"
            async with self.barrier.mutation() as cut:
                self.staging.put(cut, key, b"tokens")
            turn.complete(f"t{n}".encode(), f"s{n + 1}".encode(), [key])

    async def finish(self, owner: str, group: str, index: int, ep: Ep) -> None:
        """Gym finished the rollout: its session closed, its reply on the wire."""
        record = await (await self.client(owner)).close(ep)
        self.wire.append((group, index, ep, tuple(sorted(record.staging_keys))))

    async def drain(self) -> None:
        """RL seals every reply on the wire (NeMo RL's drain before its cut)."""
        while self.wire:
            group, index, _, keys = self.wire.pop(0)
            async with self.barrier.mutation() as cut:
                gate = self.ledger.get_group(group).gate_rollout_id(index)
                self.ledger.mark_sibling_sealed(
                    cut, group, generation_index=index, gate_rollout_id=gate,
                    receipt={"rollout_id": gate,
                             "manifest": [{"staging_key": k} for k in keys]},
                    reward=1.0, mask_sample=False)

    async def publish(self, group: str) -> None:
        """The controller's order: finalization starts, the group's rows join the
        replay index, the group leaves the ledger."""
        async with self.barrier.mutation() as cut:
            record = self.ledger.get_group(group)
            keys = frozenset(k for s in record.siblings
                             for k in s.current_attempt.staging_keys)
            self.ledger.finalization_inputs(group)
            self.ledger.mark_finalization_started(cut, group)
            self.published[group] = keys
            self.ledger.discard_group(cut, group)

    async def snapshot(self, path: Path, **kwargs: Any) -> dict[str, Any]:
        async with self.env.snapshot(path, **kwargs) as snapshot:
            async with self.barrier.checkpoint() as cut:
                if snapshot is not None:
                    await snapshot.check_against_cut(cut)
                self.saved = self.ledger.state_dict()
        assert snapshot is not None, "the backend holds no rollout state"
        return dict(snapshot.metrics(0.0))

    async def crash_and_load(self) -> None:
        """The job dies; a new one loads RL's ledger as last saved, binding each
        group's prompt again (NeMo RL's controller does so from its dataset)."""
        await self.backend.crash()
        self.ledger = self.new_ledger()
        async with self.barrier.mutation("recovery_restore") as cut:
            self.ledger.load_state_dict(cut, self.saved)
            for record in self.ledger.groups():
                self.ledger.bind_runtime_prompt(cut, record.group_id,
                                                {"idx": int(record.prompt_id)})

    async def restore(self, path: Path, before: Callable[[Any], None] | None = None
                      ) -> tuple[RestartPlan, frozenset[str]]:
        """The restore's hand-over, then the rows RL clears (those not kept)."""
        async with self.env.restored(path) as restored:
            async with self.barrier.checkpoint() as cut:
                if before is not None:
                    before(cut)
                plan = await self.env.prepare_for_restart(cut, restored)
                cleared = frozenset(self.staging.keep_only(cut, plan.keep_staging_keys))
        return plan, cleared

    async def held(self, owner: str) -> set[tuple[str, int]]:
        return {(r.episode.rollout_id, r.episode.attempt)
                for r in await (await self.client(owner)).sessions()}

    def status(self, group: str, index: int) -> str:
        attempt = self.ledger.get_group(group).siblings[index].current_attempt
        return str(getattr(attempt.status, "value", attempt.status))


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


# --- the cases ----------------------------------------------------------------------------


async def _prompt_group_granularity(job: _Job) -> None:
    """Point 1: a turn-level group of PROMPT_GROUP granularity does not fail the restore
    whole; its sessions are retired and named, the others continue."""
    r0 = _REPLICAS[0]
    whole = await job.dispatch("g1", r0, granularity="PROMPT_GROUP")
    single = await job.dispatch("g2", r0, generations=1)
    for ep in (*whole, *single):
        await job.turn(r0, ep, 0)
    path = job.backend.path("pg")
    await job.snapshot(path)
    await job.crash_and_load()
    plan, _ = await job.restore(path)
    _check(plan.restored_gym_episodes == {(r0, single[0].rollout_id, 0)},
           f"continued {sorted(plan.restored_gym_episodes)}, not g2's sibling")
    _check(plan.abandoned == {(r0, ep.rollout_id, 0) for ep in whole},
           f"abandoned named {sorted(plan.abandoned)}, not g1's siblings")
    _check([job.status("g1", i) for i in range(2)] == ["abandoned"] * 2,
           "the ledger did not abandon the prompt-group group whole")
    _check({rid for rid, _ in await job.held(r0)} == {single[0].rollout_id},
           "the abandoned group's sessions were not retired")


async def _retired_when_abandoned(job: _Job) -> None:
    """Point 2: ``retire_dropped`` retires an abandoned group's sessions (with or
    without the ledger's queue, which it acknowledges)."""
    r0 = _REPLICAS[0]
    eps = await job.dispatch("g1", r0)
    kept = await job.dispatch("g2", r0, generations=1)
    async with job.barrier.mutation() as cut:
        job.ledger.abandon_unsealed(cut, "g1")
    retired = await job.env.retire_dropped()
    _check(retired == {(r0, ep.rollout_id, 0) for ep in eps},
           f"retire_dropped retired {sorted(retired)}")
    _check(await job.held(r0) == {(kept[0].rollout_id, 0)},
           "an abandoned group's sessions stayed on the holder")
    _queue_acknowledged(job)


async def _retired_when_discarded(job: _Job) -> None:
    """Point 2: a group that left the ledger while Gym held it (schema 4 keeps no
    record of it once the integration has seen it held)."""
    r0 = _REPLICAS[0]
    eps = await job.dispatch("g1", r0)
    await job.snapshot(job.backend.path("discarded"))
    async with job.barrier.mutation() as cut:
        job.ledger.discard_group(cut, "g1")
    retired = await job.env.retire_dropped()
    _check(retired == {(r0, ep.rollout_id, 0) for ep in eps},
           f"retire_dropped retired {sorted(retired)}")
    _check(await job.held(r0) == set(), "a discarded group's sessions stayed on the holder")
    _queue_acknowledged(job)


def _queue_acknowledged(job: _Job) -> None:
    method = getattr(job.ledger, "gym_checkpoint_retirements", None)
    if method is not None:
        left = method(set(_REPLICAS))
        _check(all(not pairs for pairs in left.values()),
               f"the retirement queue was not acknowledged: {left}")


async def _sealed_and_published_rows(job: _Job) -> None:
    """Point 3: sealed attempts' rows and published groups' rows (still to be trained)
    are never orphans, and a restore keeps them."""
    r0 = _REPLICAS[0]
    done = await job.dispatch("g1", r0)
    for index, ep in enumerate(done):
        await job.turn(r0, ep, 0)
        await job.finish(r0, "g1", index, ep)
    await job.drain()
    await job.publish("g1")
    open_ = await job.dispatch("g2", r0)
    for ep in open_:
        await job.turn(r0, ep, 0)
    await job.finish(r0, "g2", 1, open_[1])
    await job.drain()
    path = job.backend.path("rows")
    metrics = await job.snapshot(path)
    _check(metrics.get("orphan_staging_rows") == 0,
           f"{metrics.get('orphan_staging_rows')} row(s) RL still needs were orphans")
    await job.crash_and_load()
    plan, cleared = await job.restore(path)
    needed = job.published["g1"] | {f"{ep.capture_key}/row0" for ep in open_}
    _check(needed <= plan.keep_staging_keys and not cleared & needed,
           f"rows RL still needs were cleared: {sorted(cleared & needed)}")


async def _finished_not_sealed(job: _Job) -> None:
    """Point 4: a rollout Gym finished whose reply RL had not sealed at the cut is
    sealed before it (RL's drain), and not run again after a restore."""
    r0 = _REPLICAS[0]
    eps = await job.dispatch("g1", r0)
    for ep in eps:
        await job.turn(r0, ep, 0)
    await job.finish(r0, "g1", 0, eps[0])
    path = job.backend.path("finished")
    await job.snapshot(path)
    await job.crash_and_load()
    plan, _ = await job.restore(path)
    _check(job.status("g1", 0) == "sealed",
           f"the finished rollout is {job.status('g1', 0)} after the restore: it runs again")
    _check(plan.restored_gym_episodes == {(r0, eps[1].rollout_id, 0)},
           f"continued {sorted(plan.restored_gym_episodes)}")


@contextlib.contextmanager
def _tracing_errors() -> Iterator[list[logging.LogRecord]]:
    """What OpenTelemetry logs meanwhile (its "Failed to detach context")."""
    found: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.append(record)

    handler, logger = Catch(logging.DEBUG), logging.getLogger("opentelemetry")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


async def _drain_past_deadline(job: _Job) -> None:
    """Points 4 and 5: the drain is bounded by the snapshot's deadline (transient,
    nothing committed), and no deadline logs a tracing context error."""

    async def hang() -> None:
        await asyncio.sleep(3600)

    job.env = job.integration(drain=hang)
    await job.dispatch("g1", _REPLICAS[0])
    path = job.backend.path("deadline")
    with _tracing_errors() as logged:
        try:
            await job.snapshot(path, timeout_s=2.0)
        except BackendUnavailableError as exc:
            _check(job.env.is_unavailable(exc), "a missed deadline is not transient")
        else:
            raise AssertionError("a drain past the snapshot's deadline did not fail it")
        job.env = job.integration()
        await job.snapshot(job.backend.path("deadline-2"), timeout_s=30.0)
    _check(not logged, f"OpenTelemetry logged {[r.getMessage() for r in logged]}")
    _check(not (environment_dir(path) / "manifest.json").exists(),
           "a snapshot past its deadline committed")


async def _unknown_owner(job: _Job) -> None:
    """Point 6: an owner ``owners=`` lacks is our error, naming the fix."""
    job.env = job.integration(owners={_REPLICAS[0]: job.owners[_REPLICAS[0]]})
    await job.dispatch("g1", _REPLICAS[1], generations=1)
    try:
        await job.snapshot(job.backend.path("owner"))
    except UnmappedOwnerError as exc:
        _check(_REPLICAS[1] in str(exc) and "add each RL owner id to owners=" in str(exc),
               f"the error does not name the owner and the fix: {exc}")
    else:
        raise AssertionError("a rollout of an unmapped owner did not fail the snapshot")


async def _second_crash_before_resend(job: _Job) -> None:
    """A restore continues a rollout (reserved, Gym's next attempt; ``retire_dropped``
    leaves it alone); the job crashes again before RL sends it on: the next restore
    continues it from the same turns."""
    r0 = _REPLICAS[0]
    eps = await job.dispatch("g1", r0, generations=1)
    for n in range(2):
        await job.turn(r0, eps[0], n)
    await job.snapshot(job.backend.path("first"))
    await job.crash_and_load()
    await job.restore(job.backend.path("first"))
    retired = await job.env.retire_dropped()  # a continued rollout is never dropped
    _check(not any(rid == eps[0].rollout_id for _, rid, _ in retired),
           f"retire_dropped retired the continued rollout: {sorted(retired)}")
    await job.snapshot(job.backend.path("second"))  # before the re-send
    await job.crash_and_load()
    plan, _ = await job.restore(job.backend.path("second"))
    _check(plan.restored_gym_episodes == {(r0, eps[0].rollout_id, 1)},
           f"continued {sorted(plan.restored_gym_episodes)}")
    attempt = job.ledger.get_group("g1").siblings[0].current_attempt
    _check(attempt.gym_attempt == 2, f"Gym's attempt is {attempt.gym_attempt}, not 2")
    async with job.barrier.mutation() as cut:
        job.ledger.mark_group_dispatched(cut, "g1", generation_indices=[0],
                                         gym_instance_id=r0)
    record = await (await job.client(r0)).get(Ep(eps[0].rollout_id, 2))
    _check(tuple(record.turns) == (b"t0", b"t1"), f"turns {record.turns}")


async def _group_still_finalizing(job: _Job) -> None:
    """A group still being published at the restore: the ledger's RuntimeError comes
    first and the restore changes nothing of RL's."""
    r0 = _REPLICAS[0]
    done = await job.dispatch("g1", r0, generations=1)
    await job.turn(r0, done[0], 0)
    await job.finish(r0, "g1", 0, done[0])
    await job.drain()
    running = await job.dispatch("g2", r0, generations=1)
    await job.turn(r0, running[0], 0)
    path = job.backend.path("finalizing")
    await job.snapshot(path)
    await job.crash_and_load()
    try:
        await job.restore(path, before=lambda cut: job.ledger.mark_finalization_started(
            cut, "g1"))
    except RuntimeError:
        pass
    else:
        raise AssertionError("a restore with a group still finalizing did not fail")
    attempt = job.ledger.get_group("g2").siblings[0].current_attempt
    _check((job.status("g2", 0), attempt.gym_attempt) == ("dispatched", 0),
           "the failed restore changed the ledger")


_CASES: tuple[tuple[str, Callable[[_Job], Awaitable[None]], bool], ...] = (
    ("prompt_group_granularity_group_is_retired_and_named_at_a_restore",
     _prompt_group_granularity, False),
    ("an_abandoned_groups_sessions_are_retired", _retired_when_abandoned, True),
    ("a_discarded_groups_sessions_are_retired", _retired_when_discarded, True),
    ("sealed_and_published_rows_are_never_orphans_and_kept", _sealed_and_published_rows,
     False),
    ("a_rollout_finished_but_not_sealed_is_not_run_again", _finished_not_sealed, False),
    ("a_drain_past_the_deadline_is_transient_and_logs_no_tracing_error",
     _drain_past_deadline, False),
    ("an_unknown_owner_is_unmapped_owner_error", _unknown_owner, False),
    ("a_second_crash_before_the_resend_continues_from_the_same_turns",
     _second_crash_before_resend, False),
    ("a_group_still_finalizing_fails_the_restore_and_changes_nothing",
     _group_still_finalizing, False),
)


def conformance_cases(factories: NemoRlFactories) -> list[ConformanceCase]:
    """Every case, on objects ``factories`` makes; the retirement cases twice when it
    gives a ledger with a retirement queue (``ledger_with_retirements``)."""
    cases = [ConformanceCase(name, scenario, factories, factories.ledger)
             for name, scenario, _ in _CASES]
    if factories.ledger_with_retirements is not None:
        cases += [ConformanceCase(f"{name}_with_the_retirement_queue", scenario,
                                  factories, factories.ledger_with_retirements)
                  for name, scenario, both in _CASES if both]
    return cases
