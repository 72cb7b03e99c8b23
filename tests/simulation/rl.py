"""RL's side of a schedule, as the contract assumes it (``SimRL``: the ledger of dispatched
episodes, the staging rows, the barrier that freezes both while a cut is live, and RL's
own saves), or as NeMo RL's objects are (``NemoRL``, issue 52: the recovery ledger, barrier
and staging of ``nemo_ckpt.testing.nemo_rl``, driven through ``nemo_ckpt.integrations.nemo_rl``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nemo_ckpt.integrations.nemo_rl import NemoRlEnvironmentCheckpoint
from nemo_ckpt.interfaces import EnvironmentEpisode as Ep
from nemo_ckpt.testing import nemo_rl as double
from nemo_ckpt.testing.data_plane import StaticCut
from nemo_ckpt.testing.nemo_rl import (
    DataPlaneCheckpointBarrier,
    DataPlaneMutationCut,
    NemoRlState,
    PromptGroupRecoveryRecord,
    PromptGroupStatus,
    PublishedGroups,
    RecoveryGranularity,
    RecoveryTargetLevel,
    RolloutAttemptRecord,
    RolloutAttemptStatus,
    RolloutRecoveryLedger,
    RolloutRecoveryLedgerWithRetirements,
    SiblingSealResult,
    StagingPartition,
    publish_group,
)

from .plan import Plan


@dataclass
class Saved:
    snapshot_id: str
    expected: dict[str, frozenset[Ep]]
    rows: frozenset[str]
    finished: frozenset[str]


class SimRL:
    """RL's ledger and data plane, as the contract assumes them: a dispatch is recorded
    before the session opens, rows are written inside turns, and the barrier freezes
    both while a cut is live. A finish is recorded with no lock against snapshots: the
    worker handed the result to the backend first (completion receipts)."""

    def __init__(self) -> None:
        self.expected: dict[str, set[Ep]] = defaultdict(set)
        self.where: dict[str, tuple[str, Ep]] = {}  # rollout -> (instance, episode)
        self.rows: set[str] = set()
        self.finished: set[str] = set()
        self.unfrozen = asyncio.Event()
        self.unfrozen.set()

    async def dispatch(self, instance: str, ep: Ep) -> None:
        await self.unfrozen.wait()
        self.expected[instance].add(ep)
        self.where[ep.rollout_id] = (instance, ep)

    async def write_row(self, key: str) -> None:
        await self.unfrozen.wait()
        self.rows.add(key)

    async def record_finish(self, ep: Ep) -> None:
        """Record ``ep`` as finished, once the barrier lets mutations through; nothing if
        the ledger has moved on from it (a restore since)."""
        await self.unfrozen.wait()
        if self.where.get(ep.rollout_id, (None, None))[1] == ep:
            self.finish(ep.rollout_id)

    def finish(self, rollout_id: str) -> None:
        instance, ep = self.where.pop(rollout_id)
        self.expected[instance].discard(ep)
        self.finished.add(rollout_id)

    @contextlib.asynccontextmanager
    async def checkpoint(self) -> AsyncIterator[StaticCut]:
        self.unfrozen.clear()
        cut = StaticCut({i: set(eps) for i, eps in self.expected.items()}, set(self.rows))
        try:
            yield cut
        finally:
            cut.expire()
            self.unfrozen.set()

    def state(self, snapshot_id: str) -> Saved:
        return Saved(snapshot_id, {i: frozenset(e) for i, e in self.expected.items()},
                     frozenset(self.rows), frozenset(self.finished))


# RL's owner ids (Gym replicas) are the instances' own.
OWNERS = {f"holder-{k}": f"holder-{k}" for k in range(64)}
_HOLDS = (RolloutAttemptStatus.DISPATCHED, RolloutAttemptStatus.RESERVED)


@dataclass(frozen=True)
class Reply:
    """A finished rollout's reply on its way to RL: Gym closed its session at ``at``."""

    instance: str
    episode: Ep
    keys: tuple[str, ...]
    at: float


@dataclass(frozen=True)
class NemoSaved:
    """A committed snapshot's RL half: ``NemoRlState``'s folder, and the rollouts the
    integration's drain sealed before its cut ((group, generation index, attempt id))."""

    snapshot_id: str
    half: str
    drained: frozenset[tuple[str, int, str]]
    # Capture keys of the rollouts finished before the snapshot began, unsealed at its cut.
    unsealed: tuple[str, ...] = ()


class NemoRL:
    """RL's side of a NeMo RL schedule (``Plan.nemo_rl``): ``nemo_ckpt.testing.nemo_rl``'s
    ledger (schema 4, or with its retirement queue: ``Plan.retirement_queue``), barrier,
    staging and published groups, a prompt group per ``Plan.nemo_groups`` with a sibling
    per instance, and the integration over them (its ``retained=`` the published rows, its
    ``drain=`` the seal of every reply on its way). A finished rollout's reply reaches RL
    ``Plan.seal_delay`` seconds at most after Gym closed its session; a sealed group is
    published (``publish_group``) and trained later, or stays sealed in the ledger. One
    per controller process: a restore starts a new one."""

    def __init__(self, plan: Plan, ids: random.Random, now: Callable[[], float],
                 log: Callable[[str], None]) -> None:
        self.plan = plan
        self.ids = ids  # attempt ids from the schedule's seed (the double draws uuid4)
        self.now, self.log = now, log
        self.barrier = DataPlaneCheckpointBarrier()
        self.ledger: RolloutRecoveryLedger = (
            RolloutRecoveryLedgerWithRetirements() if plan.retirement_queue
            else RolloutRecoveryLedger())
        self.staging = StagingPartition()
        self.published = PublishedGroups()
        self.replies: dict[str, Reply] = {}  # Gym rollout id -> reply not sealed yet
        self.drained: set[tuple[str, int, str]] = set()  # sealed by the last drain
        self.trained: set[str] = set()
        # A bad cut (``Plan.bad_cut``): the staging listing as RL could not have shown it.
        self.corrupt: Callable[[frozenset[str]], frozenset[str]] | None = None
        self._integrations: list[NemoRlEnvironmentCheckpoint] = []
        self._background: list[asyncio.Future[Any]] = []

    # --- the integration and RL's half ------------------------------------------------

    def integration(self, ckpt: Any) -> NemoRlEnvironmentCheckpoint:
        """The driver's ``NemoRlEnvironmentCheckpoint`` (one per backend checkpoint: it
        remembers what it retired)."""
        for made in self._integrations:
            if made.checkpoint is ckpt:
                return made
        made = NemoRlEnvironmentCheckpoint(
            ckpt, ledger=self.ledger, staging=self.list_staging, owners=OWNERS,
            retained=self.published.staging_keys, drain=self.drain)
        self._integrations.append(made)
        return made

    def half(self, integration: NemoRlEnvironmentCheckpoint) -> NemoRlState:
        return NemoRlState(integration, self.barrier, self.ledger, self.staging,
                           self.published)

    async def list_staging(self) -> frozenset[str]:
        await asyncio.sleep(0)
        keys = frozenset(self.staging.rows)
        return keys if self.corrupt is None else self.corrupt(keys)

    # --- the controller ---------------------------------------------------------------

    @staticmethod
    def group_id(k: int, long_id: int | None) -> str:
        """Group ``k``'s id: the first one's long enough that its Gym rollout ids are
        ``long_id`` characters (``<group>_g<i>_a<32 hex>``), when the plan draws long ids."""
        if k == 0 and long_id is not None and long_id - 37 > 3:
            return "g0-".ljust(long_id - 37, "x")
        return f"g{k}"

    @staticmethod
    def plan_index(group_id: str) -> int:
        """The ``Plan.nemo_groups`` index of ``group_id`` (``group_id``'s inverse)."""
        return int(group_id[1:].partition("-")[0])

    async def reserve(self, siblings: int) -> None:
        """The plan's prompt groups, a sibling per instance, reserved and admitted."""
        async with self.barrier.mutation("prompt_reservations") as cut:
            with self._seeded_ids():
                for k, group in enumerate(self.plan.nemo_groups):
                    self.ledger.reserve_group(
                        cut, prompt_id=str(k), prompt_payload={"idx": k},
                        expected_generations=siblings, target_step=0, start_weight_version=0,
                        recovery_granularity=RecoveryGranularity(group.granularity),
                        restore_level=RecoveryTargetLevel(group.level),
                        group_id=self.group_id(k, self.plan.long_id))

    async def bind_prompts(self) -> None:
        """A loaded ledger's prompts, bound again from the dataset (before its next save)."""
        async with self.barrier.mutation("recovery_restore") as cut:
            for record in self._records():
                self.ledger.bind_runtime_prompt(cut, record.group_id,
                                                {"idx": int(record.prompt_id)})

    async def retry_dropped(self) -> None:
        """Fresh attempts for every generating group's abandoned or failed siblings."""
        async with self.barrier.mutation("recovery_retries") as cut:
            with self._seeded_ids():
                for record in self._records():
                    if record.status is PromptGroupStatus.GENERATING and any(
                            s.current_attempt.status in (RolloutAttemptStatus.ABANDONED,
                                                         RolloutAttemptStatus.FAILED)
                            for s in record.siblings):
                        self.ledger.prepare_incomplete_retry(cut, record.group_id)

    def to_run(self, homes: list[str]) -> tuple[list[tuple[str, Ep]], list[tuple[str, Ep]]]:
        """The reserved attempts of generating groups, as ``(instance, episode)``: those
        to start (on their sibling's home instance) and those a restore continues (on
        their owner's)."""
        fresh, continued = [], []
        for record in self._records():
            if record.status is not PromptGroupStatus.GENERATING:
                continue
            for sibling in record.siblings:
                attempt = sibling.current_attempt
                if attempt.status is not RolloutAttemptStatus.RESERVED:
                    continue
                ep = Ep(*record.gym_episode(sibling.generation_index))
                if attempt.gym_attempt > 0:
                    assert attempt.gym_instance_id is not None
                    continued.append((attempt.gym_instance_id, ep))
                elif sibling.generation_index < len(homes):
                    fresh.append((homes[sibling.generation_index], ep))
        return fresh, continued

    # --- a rollout's life -------------------------------------------------------------

    async def dispatch(self, instance: str, ep: Ep) -> bool:
        """RL records ``ep``'s dispatch to ``instance`` before its session opens (or
        continues); False if the ledger has moved on from it."""
        async with self.barrier.mutation("other") as cut:
            found = self._locate(ep.rollout_id)
            if found is None:
                return False
            record, index = found
            attempt = record.siblings[index].current_attempt
            if (record.status is not PromptGroupStatus.GENERATING
                    or attempt.status is not RolloutAttemptStatus.RESERVED
                    or attempt.gym_attempt != ep.attempt):
                return False
            self.ledger.mark_group_dispatched(cut, record.group_id,
                                              generation_indices=[index],
                                              gym_instance_id=instance)
            return True

    async def write_row(self, key: str) -> None:
        async with self.barrier.mutation("other") as cut:
            self.staging.put(cut, key, b"")

    def deliver(self, instance: str, ep: Ep, keys: tuple[str, ...], delay: float) -> None:
        """Gym closed ``ep``'s session: its reply reaches RL, sealed ``delay`` s later."""
        self.replies[ep.rollout_id] = Reply(instance, ep, keys, self.now())
        self._background.append(asyncio.ensure_future(self._seal_later(ep, delay)))

    async def _seal_later(self, ep: Ep, delay: float) -> None:
        await asyncio.sleep(delay)
        if ep.rollout_id in self.replies:
            await self.seal([ep.rollout_id])

    async def drain(self) -> None:
        """The integration's ``drain=``: every reply on its way, sealed now (NeMo RL's
        controller drains its on-wire Gym replies before its cut)."""
        self.drained = set()
        async with self.barrier.mutation("sibling_seals") as cut:
            self.drained = self._seal_now(cut, sorted(self.replies))
        if self.drained:
            self.log(f"RL's drain sealed {len(self.drained)} finished rollout(s) before "
                     f"the cut")

    async def seal(self, rollout_ids: list[str]) -> None:
        async with self.barrier.mutation("sibling_seals") as cut:
            self._seal_now(cut, rollout_ids)

    def _seal_now(self, cut: DataPlaneMutationCut, rollout_ids: list[str]
                  ) -> set[tuple[str, int, str]]:
        """Seal the replies of ``rollout_ids`` that can be: a sibling's alone, a prompt
        group's once every sibling's reply is in; drop those of attempts no longer
        current. A group sealed is published when its plan says so."""
        sealed: set[tuple[str, int, str]] = set()
        for rid in rollout_ids:
            if rid not in self.replies:
                continue
            found = self._locate(rid)
            if found is None or found[0].siblings[found[1]].current_attempt.status \
                    is not RolloutAttemptStatus.DISPATCHED:
                del self.replies[rid]  # stale: its attempt was dropped since
                continue
            record, index = found
            if record.recovery_granularity is RecoveryGranularity.SIBLING:
                self.ledger.mark_sibling_sealed(
                    cut, record.group_id, generation_index=index,
                    gate_rollout_id=record.gate_rollout_id(index),
                    receipt=self._receipt(record, index, rid), reward=1.0,
                    mask_sample=False)
                del self.replies[rid]
                sealed.add(_logical(record, index))
            else:
                ids = [record.gym_episode(s.generation_index)[0] for s in record.siblings]
                if not all(i in self.replies for i in ids) or any(
                        s.current_attempt.status is not RolloutAttemptStatus.DISPATCHED
                        for s in record.siblings):
                    continue  # sealed whole, once every sibling's reply is in
                self.ledger.mark_group_sealed(cut, record.group_id, {
                    s.generation_index: SiblingSealResult(
                        record.gate_rollout_id(s.generation_index),
                        self._receipt(record, s.generation_index, i), 1.0, False)
                    for s, i in zip(record.siblings, ids, strict=True)})
                for s, i in zip(record.siblings, ids, strict=True):
                    del self.replies[i]
                    sealed.add(_logical(record, s.generation_index))
            self._publish(cut, record.group_id)
        return sealed

    def _receipt(self, record: PromptGroupRecoveryRecord, index: int, rid: str
                 ) -> dict[str, Any]:
        return {"rollout_id": record.gate_rollout_id(index),
                "manifest": [{"staging_key": k} for k in self.replies[rid].keys]}

    def _publish(self, cut: DataPlaneMutationCut, group_id: str) -> None:
        k = int(self._record(group_id).prompt_id)
        after = self.plan.nemo_groups[k].train_after
        if after is None or self._record(group_id).status \
                is not PromptGroupStatus.READY_TO_FINALIZE:
            return
        publish_group(cut, self.ledger, self.published, group_id)
        self.log(f"RL publishes group {group_id[:16]} (trained in {after}s)")
        self.train_later(group_id, after)

    def train_later(self, group_id: str, after: float) -> None:
        self._background.append(asyncio.ensure_future(self._train(group_id, after)))

    async def _train(self, group_id: str, after: float) -> None:
        """A train step takes the published group; RL clears its rows."""
        await asyncio.sleep(after)
        async with self.barrier.mutation("sample_clears") as cut:
            if group_id in self.published.groups:
                rows = self.published.take(cut, group_id)
                self.staging.clear(cut, [key for keys in rows for key in keys])
                self.trained.add(group_id)
                self.log(f"RL trains on group {group_id[:16]}: its rows cleared")

    async def fail(self, ep: Ep) -> bool:
        """A live failure of ``ep``'s rollout: RL abandons its group's unsealed work as
        the granularity says, and retries it; False if the ledger has moved on."""
        async with self.barrier.mutation("recovery_retries") as cut:
            with self._seeded_ids():
                found = self._locate(ep.rollout_id)
                if found is None:
                    return False
                record, index = found
                attempt = record.siblings[index].current_attempt
                if record.status is not PromptGroupStatus.GENERATING \
                        or attempt.status not in _HOLDS or attempt.gym_attempt != ep.attempt:
                    return False
                self.ledger.abandon_unsealed(cut, record.group_id)
                self.ledger.prepare_incomplete_retry(cut, record.group_id)
                return True

    # --- what the checkers read -------------------------------------------------------

    def finished_unsealed(self, before: float) -> list[str]:
        """The replies that reached RL before ``before`` which RL could seal (their
        attempt current and dispatched; a prompt group's with every sibling's in), not
        sealed yet."""
        found = []
        for rid, reply in sorted(self.replies.items()):
            located = self._locate(rid)
            if reply.at >= before or located is None:
                continue
            record, index = located
            if record.siblings[index].current_attempt.status \
                    is not RolloutAttemptStatus.DISPATCHED:
                continue
            if record.recovery_granularity is RecoveryGranularity.PROMPT_GROUP and not all(
                    record.gym_episode(s.generation_index)[0] in self.replies
                    for s in record.siblings):
                continue
            found.append(reply.episode.capture_key)
        return found

    def dropped(self) -> frozenset[tuple[str, int]]:
        """``(rollout_id, attempt)`` of every Gym episode the ledger dropped (abandoned,
        failed, or replaced by a retry) that had an owner."""
        found = set()
        for record in self._records():
            for sibling in record.siblings:
                for position, attempt in enumerate(sibling.attempts):
                    current = position == len(sibling.attempts) - 1
                    if attempt.gym_instance_id is None or (current and attempt.status in (
                            RolloutAttemptStatus.RESERVED, RolloutAttemptStatus.DISPATCHED,
                            RolloutAttemptStatus.SEALED)):
                        continue
                    found.add((f"{record.logical_rollout_id(sibling.generation_index)}"
                               f"_a{attempt.attempt_id}", attempt.gym_attempt))
        return frozenset(found)

    def sealed(self, logical: tuple[str, int, str]) -> bool:
        """Whether RL will not run ``logical``'s rollout again: its attempt is sealed, or
        its group has left the ledger (published, or trained)."""
        group_id, index, attempt_id = logical
        if group_id not in self.ledger:
            return True
        attempt = self._record(group_id).siblings[index].current_attempt
        return attempt.attempt_id == attempt_id \
            and attempt.status is RolloutAttemptStatus.SEALED

    def abandoned_whole(self) -> frozenset[tuple[str, int]]:
        """``(rollout_id, attempt)`` of the current attempts of generating prompt-group
        groups (a restore abandons such a group whole)."""
        return frozenset(record.gym_episode(s.generation_index)
                         for record in self._records()
                         if record.recovery_granularity is RecoveryGranularity.PROMPT_GROUP
                         and record.status is PromptGroupStatus.GENERATING
                         for s in record.siblings)

    def prompt_groups(self) -> frozenset[str]:
        """The generating groups of prompt-group granularity."""
        return frozenset(r.group_id for r in self._records()
                         if r.recovery_granularity is RecoveryGranularity.PROMPT_GROUP
                         and r.status is PromptGroupStatus.GENERATING)

    # --- internals --------------------------------------------------------------------

    def _records(self) -> list[PromptGroupRecoveryRecord]:
        """The ledger's group records, read only: not the copies ``groups()`` makes (the
        simulation reads them at every dispatch and seal; the integration calls
        ``groups()`` itself)."""
        return list(self.ledger._groups.values())

    def _record(self, group_id: str) -> PromptGroupRecoveryRecord:
        return self.ledger._groups[group_id]

    def _locate(self, rollout_id: str) -> tuple[PromptGroupRecoveryRecord, int] | None:
        """The group and sibling whose current attempt Gym runs as ``rollout_id``."""
        logical, _, _ = rollout_id.rpartition("_a")
        group_id, _, index = logical.rpartition("_g")
        if group_id not in self.ledger or not index.isdigit():
            return None
        record = self._record(group_id)
        if int(index) >= len(record.siblings) \
                or record.gym_episode(int(index))[0] != rollout_id:
            return None
        return record, int(index)

    @contextlib.contextmanager
    def _seeded_ids(self) -> Iterator[None]:
        """The double's new attempts with ids from the schedule's seed: a schedule is a
        pure function of its seed (the ids order the inventory and the sessions)."""
        made = double._fresh_attempt

        def seeded() -> RolloutAttemptRecord:
            return RolloutAttemptRecord(uuid.UUID(int=self.ids.getrandbits(128), version=4),
                                        RolloutAttemptStatus.RESERVED)

        double._fresh_attempt = seeded  # type: ignore[assignment]
        try:
            yield
        finally:
            double._fresh_attempt = made  # type: ignore[assignment]


def _logical(record: PromptGroupRecoveryRecord, index: int) -> tuple[str, int, str]:
    return record.group_id, index, record.siblings[index].current_attempt.attempt_id
