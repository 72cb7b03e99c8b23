"""A test double of NeMo RL's rollout recovery objects, written from NeMo RL's documented
behaviour: its ``RolloutRecoveryLedger`` (ledger schema 4), ``DataPlaneCheckpointBarrier``
and ``DataPlaneMutationCut``, and a staging partition. It follows NeMo RL's
``nemo_rl/experience/rollout_recovery.py`` and
``nemo_rl/algorithms/async_utils/replay_buffer.py`` as of December 2026 (docs/NEMO_RL.md
says what each method does there and where this double is simpler).

Names and signatures are NeMo RL's, so ``nemo_ckpt.integrations.nemo_rl`` is tested
against the methods it calls on the real objects. Where NeMo RL needs more than a test
needs (prompts, rewards, weight versions, the trainer's claim of groups), the double
keeps only what recovery reads. Three methods are the double's own, standing for steps
NeMo RL takes elsewhere: ``mark_group_trained`` (a group's rows consumed by a train step),
``acknowledge_gym_retirements`` (the controller recorded the retirements it sent) and
``StagingPartition`` as a whole (NeMo RL's staging lives in its transfer queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import json
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from nemo_ckpt.interfaces import RestoredEnvironmentRollouts
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.stored_json import load_stored_json

__all__ = [
    "LEDGER_SCHEMA_VERSION",
    "AttemptStatus",
    "DataPlaneCheckpointBarrier",
    "DataPlaneMutationCut",
    "GroupStatus",
    "PromptGroupRecord",
    "RestoreLevel",
    "RolloutRecoveryLedger",
    "NemoRlState",
    "STATE_FILE",
    "StagingPartition",
]

STATE_FILE = "nemo_rl_state.json"
# The most the state file is read as: the ledger and the staging rows of a test job.
_MAX_STATE_BYTES = 256 << 20

LEDGER_SCHEMA_VERSION = 4


class DataPlaneMutationCut:
    """A live capability proving code runs inside a barrier section: ``require_live()``
    is all it has, as NeMo RL's."""

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live = True

    def require_live(self) -> None:
        if not self._live:
            raise RuntimeError("data-plane mutation cut is no longer active")

    def _invalidate(self) -> None:
        self._live = False


class DataPlaneCheckpointBarrier:
    """Concurrent mutations, and checkpoints that exclude them: ``mutation()`` waits for
    an active checkpoint to exit; ``checkpoint()`` waits for the active mutations."""

    def __init__(self) -> None:
        self._condition = asyncio.Condition()
        self._checkpoint_active = False
        self._active_mutations = 0

    @contextlib.asynccontextmanager
    async def mutation(self, kind: str = "other") -> AsyncIterator[DataPlaneMutationCut]:
        del kind
        async with self._condition:
            await self._condition.wait_for(lambda: not self._checkpoint_active)
            self._active_mutations += 1
        cut = DataPlaneMutationCut()
        try:
            yield cut
        finally:
            cut._invalidate()
            async with self._condition:
                self._active_mutations -= 1
                self._condition.notify_all()

    @contextlib.asynccontextmanager
    async def checkpoint(self) -> AsyncIterator[DataPlaneMutationCut]:
        async with self._condition:
            await self._condition.wait_for(lambda: not self._checkpoint_active)
            self._checkpoint_active = True
            try:
                await self._condition.wait_for(lambda: self._active_mutations == 0)
            except BaseException:
                self._checkpoint_active = False
                self._condition.notify_all()
                raise
        cut = DataPlaneMutationCut()
        try:
            yield cut
        finally:
            cut._invalidate()
            async with self._condition:
                self._checkpoint_active = False
                self._condition.notify_all()


class StagingPartition:
    """Token-capture staging rows by key: written by environment workers inside a turn,
    listed under a checkpoint's cut, cleared by RL (a trained group's, or every row a
    restore does not keep)."""

    def __init__(self) -> None:
        self.rows: dict[str, bytes] = {}

    def put(self, cut: DataPlaneMutationCut, key: str, value: bytes) -> None:
        cut.require_live()
        self.rows[key] = value

    def clear(self, cut: DataPlaneMutationCut, keys: Iterable[str]) -> None:
        cut.require_live()
        for key in keys:
            self.rows.pop(key, None)

    def keep_only(self, cut: DataPlaneMutationCut, keep: Iterable[str]) -> frozenset[str]:
        """Clear every row not in ``keep`` (a restore's orphans); returns those cleared."""
        cut.require_live()
        cleared = frozenset(self.rows) - frozenset(keep)
        self.clear(cut, cleared)
        return cleared

    async def list_keys(self) -> frozenset[str]:
        """The listing the integration awaits under the cut."""
        await asyncio.sleep(0)
        return frozenset(self.rows)

    def state_dict(self) -> dict[str, bytes]:
        return dict(self.rows)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, bytes]) -> StagingPartition:
        partition = cls()
        partition.rows = dict(state)
        return partition


class AttemptStatus(str, enum.Enum):
    RESERVED = "reserved"
    DISPATCHED = "dispatched"
    SEALED = "sealed"
    FAILED = "failed"
    ABANDONED = "abandoned"


class GroupStatus(str, enum.Enum):
    GENERATING = "generating"
    READY_TO_FINALIZE = "ready_to_finalize"


class RestoreLevel(str, enum.Enum):
    """NeMo RL's ``RecoveryTargetLevel``: the finest restart boundary of a group."""

    TURN = "turn"
    SIBLING = "sibling"
    PROMPT_GROUP = "prompt_group"


@dataclass
class Attempt:
    attempt_uuid: uuid.UUID
    status: AttemptStatus = AttemptStatus.RESERVED
    staging_keys: list[str] = field(default_factory=list)
    gym_instance_id: Optional[str] = None
    gym_attempt: int = 0

    @property
    def attempt_id(self) -> str:
        return self.attempt_uuid.hex


@dataclass
class Sibling:
    generation_index: int
    attempts: list[Attempt]

    @property
    def current_attempt(self) -> Attempt:
        return self.attempts[-1]


@dataclass
class PromptGroupRecord:
    group_id: str
    restore_level: RestoreLevel
    siblings: list[Sibling]
    status: GroupStatus = GroupStatus.GENERATING

    def logical_rollout_id(self, generation_index: int) -> str:
        return f"{self.group_id}_g{generation_index}"

    def gym_episode(self, generation_index: int) -> tuple[str, int]:
        """Gym's base rollout id and attempt of one sibling's current attempt."""
        attempt = self.siblings[generation_index].current_attempt
        return (f"{self.logical_rollout_id(generation_index)}_a{attempt.attempt_id}",
                attempt.gym_attempt)

    def gate_rollout_id(self, generation_index: int) -> str:
        rollout_id, gym_attempt = self.gym_episode(generation_index)
        return rollout_id if gym_attempt == 0 else f"{rollout_id}-a{gym_attempt}"


def _new_attempt(rng_uuid: Optional[uuid.UUID] = None) -> Attempt:
    return Attempt(attempt_uuid=rng_uuid or uuid.uuid4())


class RolloutRecoveryLedger:
    """Controller-owned lineage of prompt groups: each mutation needs a live cut."""

    def __init__(self) -> None:
        self._groups: dict[str, PromptGroupRecord] = {}
        # Dropped dispatched turn-level attempts Gym still runs: never persisted.
        self._retirements: set[tuple[str, str, int]] = set()

    # --- lineage --------------------------------------------------------------------------

    def reserve_group(self, cut: DataPlaneMutationCut, *, group_id: str,
                      expected_generations: int,
                      restore_level: RestoreLevel = RestoreLevel.TURN,
                      attempt_uuids: Optional[list[uuid.UUID]] = None,
                      ) -> PromptGroupRecord:
        cut.require_live()
        if group_id in self._groups:
            raise ValueError(f"duplicate recovery group_id={group_id!r}")
        if expected_generations < 1:
            raise ValueError("expected_generations must be at least one")
        uuids = attempt_uuids or [uuid.uuid4() for _ in range(expected_generations)]
        record = PromptGroupRecord(group_id, RestoreLevel(restore_level), [
            Sibling(i, [_new_attempt(uuids[i])]) for i in range(expected_generations)])
        self._groups[group_id] = record
        return copy.deepcopy(record)

    def mark_group_dispatched(self, cut: DataPlaneMutationCut, group_id: str, *,
                              generation_indices: Optional[list[int]] = None,
                              gym_instance_id: Optional[str] = None) -> None:
        cut.require_live()
        record = self._require(group_id)
        indices = generation_indices if generation_indices is not None \
            else list(range(len(record.siblings)))
        attempts = [record.siblings[i].current_attempt for i in indices]
        if any(a.status is not AttemptStatus.RESERVED for a in attempts):
            raise ValueError("only reserved rollout attempts may be dispatched")
        for attempt in attempts:
            if record.restore_level is RestoreLevel.TURN and attempt.gym_instance_id is None \
                    and gym_instance_id is None:
                raise ValueError("turn-level rollout dispatch requires a Gym checkpoint owner")
            if attempt.gym_instance_id is not None and gym_instance_id != attempt.gym_instance_id:
                raise ValueError(
                    f"restored Gym rollout must return to its checkpoint owner: "
                    f"expected={attempt.gym_instance_id!r}, actual={gym_instance_id!r}")
            if attempt.gym_instance_id is None:
                attempt.gym_instance_id = gym_instance_id
            attempt.status = AttemptStatus.DISPATCHED

    def mark_sibling_sealed(self, cut: DataPlaneMutationCut, group_id: str, *,
                            generation_index: int, gate_rollout_id: str,
                            receipt: Optional[dict[str, Any]]) -> None:
        """Record a finished sibling's receipt (its staging rows: ``receipt["manifest"]``)."""
        cut.require_live()
        record = self._require(group_id)
        attempt = record.siblings[generation_index].current_attempt
        if gate_rollout_id != record.gate_rollout_id(generation_index):
            raise ValueError(f"streamed rollout identity mismatch: result={gate_rollout_id!r}, "
                             f"expected={record.gate_rollout_id(generation_index)!r}")
        if attempt.status is not AttemptStatus.DISPATCHED:
            raise ValueError(f"cannot seal {record.logical_rollout_id(generation_index)!r} "
                             f"from status {attempt.status.value!r}")
        manifest = (receipt or {}).get("manifest", [])
        attempt.staging_keys = [entry["staging_key"] for entry in manifest]
        attempt.status = AttemptStatus.SEALED
        if all(s.current_attempt.status is AttemptStatus.SEALED for s in record.siblings):
            record.status = GroupStatus.READY_TO_FINALIZE

    def abandon_unsealed(self, cut: DataPlaneMutationCut, group_id: str) -> None:
        """Drop a group's unsealed attempts; Gym's dispatched turn-level ones are queued
        for retirement."""
        cut.require_live()
        record = self._require(group_id)
        for sibling in record.siblings:
            attempt = sibling.current_attempt
            if attempt.status is AttemptStatus.SEALED:
                continue
            self._queue_retirement(record, sibling)
            attempt.status = AttemptStatus.ABANDONED

    def discard_group(self, cut: DataPlaneMutationCut, group_id: str) -> None:
        cut.require_live()
        record = self._require(group_id)
        for sibling in record.siblings:
            self._queue_retirement(record, sibling)
        del self._groups[group_id]

    def prepare_incomplete_retry(self, cut: DataPlaneMutationCut, group_id: str
                                 ) -> PromptGroupRecord:
        """Fresh attempts for the abandoned or failed siblings."""
        cut.require_live()
        record = self._require(group_id)
        for sibling in record.siblings:
            if sibling.current_attempt.status in (AttemptStatus.ABANDONED,
                                                  AttemptStatus.FAILED):
                sibling.attempts.append(_new_attempt())
        return copy.deepcopy(record)

    def mark_group_trained(self, cut: DataPlaneMutationCut, group_id: str) -> list[str]:
        """The double's own: a finished group consumed by a train step leaves the ledger;
        returns its staging rows, for RL to clear."""
        cut.require_live()
        record = self._require(group_id)
        if record.status is not GroupStatus.READY_TO_FINALIZE:
            raise ValueError(f"group {group_id!r} is not finished")
        del self._groups[group_id]
        return [k for s in record.siblings for k in s.current_attempt.staging_keys]

    # --- what checkpointing reads ---------------------------------------------------------

    def gym_checkpoint_inventory(self, instance_ids: set[str] | frozenset[str]
                                 ) -> dict[str, tuple[tuple[str, int], ...]]:
        """Active turn-level Gym episodes by owner: dispatched attempts, and reserved ones
        a restore continues. An owner not in ``instance_ids`` raises."""
        inventory: dict[str, list[tuple[str, int]]] = {i: [] for i in instance_ids}
        for record in self._groups.values():
            if record.status is not GroupStatus.GENERATING \
                    or record.restore_level is not RestoreLevel.TURN:
                continue
            for sibling in record.siblings:
                attempt = sibling.current_attempt
                owns = attempt.status is AttemptStatus.DISPATCHED or (
                    attempt.status is AttemptStatus.RESERVED and attempt.gym_attempt > 0)
                if not owns:
                    continue
                owner = attempt.gym_instance_id
                if owner is None or owner not in inventory:
                    raise RuntimeError(f"turn-level rollout references unavailable Gym "
                                       f"instance {owner!r}")
                inventory[owner].append(record.gym_episode(sibling.generation_index))
        return {owner: tuple(sorted(eps)) for owner, eps in inventory.items()}

    def gym_checkpoint_retirements(self, instance_ids: set[str] | frozenset[str]
                                   ) -> dict[str, tuple[tuple[str, int], ...]]:
        """Dropped turn-level episodes Gym still runs, by owner (not persisted)."""
        listed: dict[str, list[tuple[str, int]]] = {i: [] for i in instance_ids}
        for owner, rollout_id, attempt in self._retirements:
            if owner in listed:
                listed[owner].append((rollout_id, attempt))
        return {owner: tuple(sorted(eps)) for owner, eps in listed.items()}

    def acknowledge_gym_retirements(self, retired: Iterable[tuple[str, str, int]]) -> None:
        """The double's own: the controller recorded these retirements as sent."""
        self._retirements -= set(retired)

    def expected_staging_keys(self) -> set[str]:
        """Staging rows still owned by sealed attempts (kept until trained)."""
        return {key for record in self._groups.values() for s in record.siblings
                if s.current_attempt.status is AttemptStatus.SEALED
                for key in s.current_attempt.staging_keys}

    def prepare_for_restart(self, cut: DataPlaneMutationCut, *,
                            restored_gym_episodes: Optional[set[tuple[str, str, int]]] = None
                            ) -> None:
        """Continue the restored turn-level attempts as Gym's next attempt; abandon every
        other unsealed attempt. A triple no dispatched turn-level attempt owns raises."""
        cut.require_live()
        restored = set(restored_gym_episodes or ())
        consumed: set[tuple[str, str, int]] = set()
        for record in self._groups.values():
            if record.status is not GroupStatus.GENERATING:
                continue
            if record.restore_level is RestoreLevel.PROMPT_GROUP:
                for sibling in record.siblings:
                    attempt = sibling.current_attempt
                    attempt.status = AttemptStatus.ABANDONED
                    attempt.staging_keys.clear()
                continue
            for sibling in record.siblings:
                attempt = sibling.current_attempt
                if attempt.status is AttemptStatus.SEALED:
                    continue
                rollout_id, gym_attempt = record.gym_episode(sibling.generation_index)
                key = (attempt.gym_instance_id or "", rollout_id, gym_attempt)
                if record.restore_level is RestoreLevel.TURN \
                        and attempt.status in (AttemptStatus.DISPATCHED,
                                               AttemptStatus.RESERVED) \
                        and attempt.gym_instance_id is not None and key in restored:
                    attempt.gym_attempt += 1
                    attempt.status = AttemptStatus.RESERVED
                    consumed.add(key)
                    continue
                if attempt.status is AttemptStatus.RESERVED:
                    continue
                attempt.status = AttemptStatus.ABANDONED
        unused = restored - consumed
        if unused:
            raise ValueError(f"Gym restored episodes are not owned by dispatched turn-level "
                             f"rollouts: {sorted(unused)!r}")

    def groups(self) -> list[PromptGroupRecord]:
        return [copy.deepcopy(g) for g in self._groups.values()]

    def get_group(self, group_id: str) -> PromptGroupRecord:
        return copy.deepcopy(self._require(group_id))

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    # --- persistence ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"schema_version": LEDGER_SCHEMA_VERSION, "groups": [
            {"group_id": g.group_id, "restore_level": g.restore_level.value,
             "status": g.status.value, "siblings": [
                 [{"attempt_uuid": a.attempt_id, "status": a.status.value,
                   "staging_keys": list(a.staging_keys),
                   "gym_instance_id": a.gym_instance_id, "gym_attempt": a.gym_attempt}
                  for a in s.attempts] for s in g.siblings]}
            for g in self._groups.values()]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> RolloutRecoveryLedger:
        if state.get("schema_version") != LEDGER_SCHEMA_VERSION:
            raise ValueError(f"unsupported rollout recovery schema "
                             f"{state.get('schema_version')!r}")
        ledger = cls()
        for g in state["groups"]:
            siblings = [Sibling(i, [Attempt(uuid.UUID(a["attempt_uuid"]),
                                            AttemptStatus(a["status"]),
                                            list(a["staging_keys"]), a["gym_instance_id"],
                                            int(a["gym_attempt"])) for a in attempts])
                        for i, attempts in enumerate(g["siblings"])]
            ledger._groups[g["group_id"]] = PromptGroupRecord(
                g["group_id"], RestoreLevel(g["restore_level"]), siblings,
                GroupStatus(g["status"]))
        return ledger

    # --- internals ------------------------------------------------------------------------

    def _require(self, group_id: str) -> PromptGroupRecord:
        try:
            return self._groups[group_id]
        except KeyError:
            raise KeyError(f"unknown recovery group {group_id!r}") from None

    def _queue_retirement(self, record: PromptGroupRecord, sibling: Sibling) -> None:
        attempt = sibling.current_attempt
        if record.restore_level is RestoreLevel.TURN and attempt.gym_instance_id is not None \
                and attempt.status is AttemptStatus.DISPATCHED:
            rollout_id, gym_attempt = record.gym_episode(sibling.generation_index)
            self._retirements.add((attempt.gym_instance_id, rollout_id, gym_attempt))


class NemoRlState:
    """RL's half of a rollout snapshot for ``RolloutCheckpointManager`` (``RlHalf``): the
    ledger and the staging partition, saved as ``<path>/nemo_rl_state.json``, restored
    through ``NemoRlEnvironmentCheckpoint.prepare_for_restart`` (rows it does not keep
    cleared), removed with the snapshot. ``ledger`` and ``staging`` are replaced by a
    restore; read them from here."""

    def __init__(self, integration: Any, barrier: DataPlaneCheckpointBarrier,
                 ledger: Optional[RolloutRecoveryLedger] = None,
                 staging: Optional[StagingPartition] = None) -> None:
        self.integration = integration
        self.barrier = barrier
        self.ledger = ledger or RolloutRecoveryLedger()
        self.staging = staging or StagingPartition()
        self.cleared: frozenset[str] = frozenset()

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        run = getattr(self.integration, "run_blocking", None)
        return await (run(fn, *args) if run is not None else asyncio.to_thread(fn, *args))

    async def save(self, cut: DataPlaneMutationCut, path: str) -> None:
        cut.require_live()
        data = json.dumps({"ledger": self.ledger.state_dict(),
                           "staging": {k: v.hex() for k, v in self.staging.rows.items()}})
        folder = folder_at(path)
        await self._blocking(folder.prepare)
        await self._blocking(folder.write_bytes, STATE_FILE, data.encode())

    async def restore(self, path: str, restored: RestoredEnvironmentRollouts) -> None:
        folder = folder_at(path)
        raw = load_stored_json(
            await self._blocking(folder.read, STATE_FILE, _MAX_STATE_BYTES + 1),
            folder.describe(STATE_FILE), _MAX_STATE_BYTES)
        self.ledger = RolloutRecoveryLedger.from_state_dict(raw["ledger"])
        self.staging = StagingPartition.from_state_dict(
            {k: bytes.fromhex(v) for k, v in raw["staging"].items()})
        async with self.barrier.checkpoint() as cut:
            plan = await self.integration.prepare_for_restart(cut, restored)
            self.cleared = self.staging.keep_only(cut, plan.keep_staging_keys)

    async def remove(self, path: str) -> None:
        folder = folder_at(path)
        if STATE_FILE in await self._blocking(folder.names):
            await self._blocking(folder.remove, [STATE_FILE])
