"""A test double of NeMo RL's rollout recovery objects, rewritten from NeMo RL's source.

It behaves as these NeMo RL files do (docs/NEMO_RL.md says, point by point, which stored
revision each behaviour follows): the recovery ledger ``RolloutRecoveryLedger`` of
``nemo_rl/experience/rollout_recovery.py`` (schema 4, which has no retirement queue),
the same ledger at a newer revision that queues the Gym episodes it drops
(``RolloutRecoveryLedgerWithRetirements``), and ``DataPlaneCheckpointBarrier`` with its
``DataPlaneMutationCut`` of ``nemo_rl/algorithms/async_utils/replay_buffer.py``.

Names, signatures, defaults, state transitions, error types and error messages are
NeMo RL's, so code written against this double ports to NeMo RL's objects, and
``nemo_ckpt.integrations.nemo_rl`` is tested against what they really do. Only what
NeMo RL keeps elsewhere is the double's own: ``StagingPartition`` (NeMo RL's staging
lives in its transfer queue), ``PublishedGroups`` with ``publish_group`` (the
controller's replay index: a group published for training leaves the ledger while its
staging rows stay until a train step clears them) and ``NemoRlState`` (RL's half of a
rollout snapshot for ``RolloutCheckpointManager``). No NeMo RL code is copied here.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import enum
import json
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from nemo_ckpt.interfaces import RestoredEnvironmentRollouts
from nemo_ckpt.storage.checkpoint_folder import folder_at
from nemo_ckpt.storage.stored_json import load_stored_json

__all__ = [
    "CHECKPOINT_MUTATION_KINDS",
    "ROLLOUT_RECOVERY_SCHEMA_VERSION",
    "STATE_FILE",
    "DataPlaneCheckpointBarrier",
    "DataPlaneMutationCut",
    "NemoRlState",
    "PromptGroupPhase",
    "PromptGroupRecoveryRecord",
    "PromptGroupStatus",
    "PromptRef",
    "PublishedGroups",
    "RecoveryGranularity",
    "RecoveryTargetLevel",
    "RolloutAttemptRecord",
    "RolloutAttemptStatus",
    "RolloutRecoveryLedger",
    "RolloutRecoveryLedgerWithRetirements",
    "RolloutSiblingRecord",
    "SiblingSealResult",
    "StagingPartition",
    "publish_group",
]

ROLLOUT_RECOVERY_SCHEMA_VERSION = 4

STATE_FILE = "nemo_rl_state.json"
# The most the state file is read as: the ledger and the staging rows of a test job.
_MAX_STATE_BYTES = 256 << 20

# The kinds a barrier's mutation section may name (NeMo RL counts waits per kind).
CHECKPOINT_MUTATION_KINDS = (
    "advantage_writeback", "group_commits", "group_removals", "other",
    "prompt_reservations", "recovery_restore", "recovery_retries", "sample_clears",
    "sibling_seals",
)


# --- the barrier and its cut ---------------------------------------------------------


class DataPlaneMutationCut:
    """Proof that code runs inside a barrier section; ``require_live()`` is all it has."""

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live = True

    def require_live(self) -> None:
        if not self._live:
            raise RuntimeError("data-plane mutation cut is no longer active")

    def _invalidate(self) -> None:
        self._live = False


class DataPlaneCheckpointBarrier:
    """Mutations run side by side; a checkpoint waits for them and holds new ones back.

    One task holds one section at a time: a task that opens a second section inside
    its first is refused with ``RuntimeError`` (it must pass on the cut it has), as
    NeMo RL's barrier refuses it. ``mutation_version`` counts finished mutations."""

    def __init__(self) -> None:
        self._condition = asyncio.Condition()
        self._checkpoint_active = False
        self._active_mutations = 0
        self._holders: set[asyncio.Task[Any]] = set()
        self._mutation_version = 0

    @property
    def mutation_version(self) -> int:
        return self._mutation_version

    def _entering_task(self) -> asyncio.Task[Any]:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("data-plane barrier sections require an asyncio task")
        if task in self._holders:
            raise RuntimeError(
                "this task already holds a data-plane barrier section; pass the "
                "DataPlaneMutationCut you already have instead of opening another")
        return task

    @contextlib.asynccontextmanager
    async def mutation(self, kind: str = "other") -> AsyncIterator[DataPlaneMutationCut]:
        if kind not in CHECKPOINT_MUTATION_KINDS:
            raise ValueError(f"unknown checkpoint mutation kind {kind!r}; expected one "
                             f"of {CHECKPOINT_MUTATION_KINDS!r}")
        async with self._condition:
            task = self._entering_task()
            await self._condition.wait_for(lambda: not self._checkpoint_active)
            self._active_mutations += 1
            self._holders.add(task)
        cut = DataPlaneMutationCut()
        try:
            yield cut
        finally:
            cut._invalidate()
            async with self._condition:
                self._holders.discard(task)
                self._active_mutations -= 1
                self._mutation_version += 1  # counted even when the body raised
                if self._active_mutations == 0:
                    self._condition.notify_all()

    @contextlib.asynccontextmanager
    async def checkpoint(self) -> AsyncIterator[DataPlaneMutationCut]:
        async with self._condition:
            task = self._entering_task()
            await self._condition.wait_for(lambda: not self._checkpoint_active)
            self._checkpoint_active = True
            try:
                await self._condition.wait_for(lambda: self._active_mutations == 0)
            except BaseException:
                self._checkpoint_active = False
                self._condition.notify_all()
                raise
            self._holders.add(task)
        cut = DataPlaneMutationCut()
        try:
            yield cut
        finally:
            cut._invalidate()
            async with self._condition:
                self._holders.discard(task)
                self._checkpoint_active = False
                self._condition.notify_all()


# --- the double's own: staging rows and the published groups that still need them -----


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


class PublishedGroups:
    """The controller's index of groups published for training: once published, a
    group leaves the ledger (``discard_group``) but its staging rows stay until a train
    step takes it; they are rows RL still needs at a restore (NeMo RL's keep set adds
    its route plans' cleanup keys)."""

    def __init__(self) -> None:
        # Per group, each sibling's staging rows in manifest order.
        self.groups: dict[str, tuple[tuple[str, ...], ...]] = {}

    def add(self, cut: DataPlaneMutationCut, group_id: str,
            rows: Iterable[Iterable[str]]) -> None:
        cut.require_live()
        if group_id in self.groups:
            raise ValueError(f"group {group_id!r} is already published")
        self.groups[group_id] = tuple(tuple(keys) for keys in rows)

    def take(self, cut: DataPlaneMutationCut, group_id: str
             ) -> tuple[tuple[str, ...], ...]:
        """A train step consumed ``group_id``: each sibling's rows, for RL to clear."""
        cut.require_live()
        try:
            return self.groups.pop(group_id)
        except KeyError:
            raise ValueError(f"group {group_id!r} is not published") from None

    def staging_keys(self) -> frozenset[str]:
        return frozenset(key for rows in self.groups.values() for keys in rows
                         for key in keys)


# --- the ledger's records ------------------------------------------------------------


class PromptGroupPhase(str, enum.Enum):
    RESERVED = "reserved"
    ADMITTED = "admitted"


class RecoveryGranularity(str, enum.Enum):
    """What a live failure retries: one sibling, or the whole prompt group."""

    SIBLING = "sibling"
    PROMPT_GROUP = "prompt_group"


class RecoveryTargetLevel(str, enum.Enum):
    """The finest boundary a restart may resume an unfinished rollout from."""

    TURN = "turn"
    SIBLING = "sibling"
    PROMPT_GROUP = "prompt_group"


class RolloutAttemptStatus(str, enum.Enum):
    RESERVED = "reserved"
    DISPATCHED = "dispatched"
    SEALED = "sealed"
    FAILED = "failed"
    ABANDONED = "abandoned"


class PromptGroupStatus(str, enum.Enum):
    GENERATING = "generating"
    READY_TO_FINALIZE = "ready_to_finalize"
    FINALIZING = "finalizing"
    FINALIZATION_UNKNOWN = "finalization_unknown"


_DROPPABLE = frozenset({RolloutAttemptStatus.ABANDONED, RolloutAttemptStatus.FAILED})


@dataclass(frozen=True)
class PromptRef:
    """Where the dataset keeps a group's prompt: the ledger saves this, not the prompt."""

    sample_id: str
    task_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.sample_id:
            raise ValueError("prompt sample_id must not be empty")


@dataclass
class RolloutAttemptRecord:
    attempt_uuid: uuid.UUID
    status: RolloutAttemptStatus
    receipt: Optional[dict[str, Any]] = None
    reward: Optional[float] = None
    mask_sample: Optional[bool] = None
    staging_keys: list[str] = field(default_factory=list)
    gym_instance_id: Optional[str] = None
    gym_attempt: int = 0

    @property
    def attempt_id(self) -> str:
        return self.attempt_uuid.hex


@dataclass
class RolloutSiblingRecord:
    generation_index: int
    attempts: list[RolloutAttemptRecord]

    @property
    def current_attempt(self) -> RolloutAttemptRecord:
        if not self.attempts:
            raise RuntimeError(f"generation index {self.generation_index} has no attempts")
        return self.attempts[-1]


@dataclass
class PromptGroupRecoveryRecord:
    group_id: str
    admission_id: str
    prompt_id: str
    prompt_ref: PromptRef
    task_source: Optional[str]
    recovery_granularity: RecoveryGranularity
    restore_level: RecoveryTargetLevel
    runtime_prompt_payload: Optional[Mapping[str, Any]]
    expected_generations: int
    target_step: Optional[int]
    start_weight_version: int
    siblings: list[RolloutSiblingRecord]
    phase: PromptGroupPhase
    status: PromptGroupStatus = PromptGroupStatus.GENERATING

    @property
    def prompt_payload(self) -> Mapping[str, Any]:
        """The prompt itself: gone after a load until ``bind_runtime_prompt``."""
        if self.runtime_prompt_payload is None:
            raise RuntimeError(f"recovery group {self.group_id!r} has not rehydrated "
                               f"prompt sample_id={self.prompt_ref.sample_id!r}")
        return self.runtime_prompt_payload

    def logical_rollout_id(self, generation_index: int) -> str:
        return f"{self.group_id}_g{generation_index}"

    @property
    def logical_rollout_ids(self) -> list[str]:
        return [self.logical_rollout_id(s.generation_index) for s in self.siblings]

    def gym_episode(self, generation_index: int) -> tuple[str, int]:
        """Gym's base rollout id and attempt of one sibling's current attempt."""
        attempt = self.siblings[generation_index].current_attempt
        return (f"{self.logical_rollout_id(generation_index)}_a{attempt.attempt_id}",
                attempt.gym_attempt)

    def gate_rollout_id(self, generation_index: int) -> str:
        """The string a result carries: the base id, ``-a<n>`` from Gym's attempt 1."""
        base, gym_attempt = self.gym_episode(generation_index)
        return base if gym_attempt == 0 else f"{base}-a{gym_attempt}"

    @property
    def gate_rollout_ids(self) -> list[str]:
        return [self.gate_rollout_id(s.generation_index) for s in self.siblings]

    @property
    def sealed_generation_indices(self) -> list[int]:
        return [s.generation_index for s in self.siblings
                if s.current_attempt.status is RolloutAttemptStatus.SEALED]


@dataclass(frozen=True)
class SiblingSealResult:
    """One sibling's result for ``mark_group_sealed`` (a receipt of None: a masked
    placeholder for a capture that failed)."""

    gate_rollout_id: str
    receipt: Optional[dict[str, Any]]
    reward: float
    mask_sample: bool


def _fresh_attempt() -> RolloutAttemptRecord:
    return RolloutAttemptRecord(attempt_uuid=uuid.uuid4(),
                                status=RolloutAttemptStatus.RESERVED)


def _manifest_keys(receipt: Optional[Mapping[str, Any]]) -> list[str]:
    """A receipt's staging keys in manifest order (none for a missing receipt)."""
    if receipt is None:
        return []
    manifest = receipt.get("manifest")
    if not isinstance(manifest, list):
        raise ValueError("sealed rollout receipt must contain a manifest list")
    keys = []
    for entry in manifest:
        if not isinstance(entry, dict) or not isinstance(entry.get("staging_key"), str):
            raise ValueError("sealed rollout receipt manifest entries must contain "
                             "string staging_key values")
        keys.append(entry["staging_key"])
    return keys


def _check_prompt(ref: PromptRef, payload: Mapping[str, Any], group_id: str) -> None:
    """A prompt must be the dataset sample its group names (its ``idx``, ``task_name``)."""
    idx = payload.get("idx")
    if isinstance(idx, bool) or not isinstance(idx, int):
        raise ValueError(f"recovery group {group_id!r} prompt payload must contain an "
                         f"integer idx")
    if str(idx) != ref.sample_id:
        raise ValueError(f"recovery group {group_id!r} resolved sample_id={idx!r}; "
                         f"expected {ref.sample_id!r}")
    task_name = payload.get("task_name")
    if task_name is not None and not isinstance(task_name, str):
        raise TypeError("prompt task_name must be a string or None")
    if task_name != ref.task_name:
        raise ValueError(f"recovery group {group_id!r} resolved task_name={task_name!r}; "
                         f"expected {ref.task_name!r}")


def _unknown_fields(mapping: Mapping[Any, Any], allowed: frozenset[str], where: str
                    ) -> None:
    extra = set(mapping) - allowed
    if extra:
        raise ValueError(f"{where} contains unknown fields: {sorted(extra, key=repr)!r}")


_STATE_FIELDS = frozenset({"schema_version", "groups"})
_GROUP_FIELDS = frozenset({
    "group_id", "admission_id", "prompt_id", "prompt_ref", "task_source",
    "recovery_granularity", "restore_level", "expected_generations", "target_step",
    "start_weight_version", "status", "phase", "siblings"})
_PROMPT_REF_FIELDS = frozenset({"sample_id", "task_name"})
_SIBLING_FIELDS = frozenset({"generation_index", "attempts"})
_ATTEMPT_FIELDS = frozenset({
    "attempt_uuid", "status", "receipt", "reward", "mask_sample", "staging_keys",
    "gym_instance_id", "gym_attempt"})


def _enum_field(kind: type[enum.Enum], raw: Any, name: str) -> Any:
    if not isinstance(raw, str):
        raise ValueError(f"{name} must be a string")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"invalid {name}={raw!r}") from None


# --- the ledger ----------------------------------------------------------------------

_Ledger = TypeVar("_Ledger", bound="_LedgerRecords")


class _LedgerRecords:
    """What every revision of the ledger shares: its groups, looked up and copied, their
    finalization states, and their saved state (schema 4)."""

    def __init__(self) -> None:
        self._groups: dict[str, PromptGroupRecoveryRecord] = {}

    # --- reading --------------------------------------------------------------------

    def groups(self) -> list[PromptGroupRecoveryRecord]:
        return [self._copy(g) for g in self._groups.values()]

    def get_group(self, group_id: str) -> PromptGroupRecoveryRecord:
        return self._copy(self._require_group(group_id))

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: object) -> bool:
        return isinstance(group_id, str) and group_id in self._groups

    # --- finalization ---------------------------------------------------------------

    def finalization_inputs(self, group_id: str) -> tuple[
            list[str], list[str], list[Optional[dict[str, Any]]], list[float], list[bool]]:
        """Gate ids, logical ids, receipts, rewards and masks of a sealed group."""
        record = self._require_group(group_id)
        if record.status is not PromptGroupStatus.READY_TO_FINALIZE:
            raise ValueError(f"group {group_id!r} is not ready to finalize: "
                             f"{record.status.value!r}")
        receipts, rewards, masks = [], [], []
        for sibling in record.siblings:
            attempt = sibling.current_attempt
            if (attempt.status is not RolloutAttemptStatus.SEALED or attempt.reward is None
                    or attempt.mask_sample is None):
                raise ValueError(f"logical rollout "
                                 f"{record.logical_rollout_id(sibling.generation_index)!r} "
                                 f"is not sealed")
            receipts.append(copy.deepcopy(attempt.receipt))
            rewards.append(attempt.reward)
            masks.append(attempt.mask_sample)
        return record.gate_rollout_ids, record.logical_rollout_ids, receipts, rewards, masks

    def mark_finalization_started(self, cut: DataPlaneMutationCut, group_id: str) -> None:
        cut.require_live()
        self._move(group_id, PromptGroupStatus.READY_TO_FINALIZE,
                   PromptGroupStatus.FINALIZING, "start finalization")

    def mark_finalization_unknown(self, cut: DataPlaneMutationCut, group_id: str) -> None:
        cut.require_live()
        self._move(group_id, PromptGroupStatus.FINALIZING,
                   PromptGroupStatus.FINALIZATION_UNKNOWN, "mark finalization unknown")

    def assert_checkpoint_safe(self) -> None:
        """A group being published (or whose publication is in doubt) cannot be saved
        or restarted."""
        unsafe = [g.group_id for g in self._groups.values()
                  if g.status in (PromptGroupStatus.FINALIZING,
                                  PromptGroupStatus.FINALIZATION_UNKNOWN)]
        if unsafe:
            raise RuntimeError(f"rollout recovery contains checkpoint-unsafe group "
                               f"states: groups={unsafe!r}")

    # --- persistence ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Schema 4: what the controller saves (uuids as 16 bytes; prompts by reference
        only, so every group's prompt must be bound)."""
        self.assert_checkpoint_safe()
        groups = []
        for record in self._groups.values():
            if record.runtime_prompt_payload is None:
                raise RuntimeError(f"cannot checkpoint recovery group {record.group_id!r} "
                                   f"before its prompt is rehydrated")
            _check_prompt(record.prompt_ref, record.runtime_prompt_payload, record.group_id)
            groups.append({
                "group_id": record.group_id, "admission_id": record.admission_id,
                "prompt_id": record.prompt_id,
                "prompt_ref": {"sample_id": record.prompt_ref.sample_id,
                               "task_name": record.prompt_ref.task_name},
                "task_source": record.task_source,
                "recovery_granularity": record.recovery_granularity.value,
                "restore_level": record.restore_level.value,
                "expected_generations": record.expected_generations,
                "target_step": record.target_step,
                "start_weight_version": record.start_weight_version,
                "status": record.status.value, "phase": record.phase.value,
                "siblings": [{"generation_index": s.generation_index, "attempts": [
                    {"attempt_uuid": a.attempt_uuid.bytes, "status": a.status.value,
                     "receipt": copy.deepcopy(a.receipt), "reward": a.reward,
                     "mask_sample": a.mask_sample, "staging_keys": list(a.staging_keys),
                     "gym_instance_id": a.gym_instance_id, "gym_attempt": a.gym_attempt}
                    for a in s.attempts]} for s in record.siblings]})
        return {"schema_version": ROLLOUT_RECOVERY_SCHEMA_VERSION, "groups": groups}

    @classmethod
    def from_state_dict(cls: type[_Ledger], state: Any) -> _Ledger:
        """A ledger from saved state, checked field by field; its groups' prompts are
        unbound until ``bind_runtime_prompt``."""
        if not isinstance(state, dict):
            raise TypeError(f"rollout recovery state must be a dictionary, got "
                            f"{type(state).__name__}")
        _unknown_fields(state, _STATE_FIELDS, "rollout recovery state")
        version = state.get("schema_version")
        if version != ROLLOUT_RECOVERY_SCHEMA_VERSION:
            raise ValueError(f"Unsupported rollout-recovery schema version: {version!r}; "
                             f"expected {ROLLOUT_RECOVERY_SCHEMA_VERSION}")
        raw_groups = state.get("groups")
        if not isinstance(raw_groups, list):
            raise ValueError("rollout-recovery state must contain a groups list")
        ledger = cls()
        seen: set[uuid.UUID] = set()
        for raw in raw_groups:
            record = _group_from_state(raw, seen)
            if record.group_id in ledger._groups:
                raise ValueError(f"duplicate recovery group_id={record.group_id!r}")
            ledger._groups[record.group_id] = record
        admissions: dict[str, tuple[PromptGroupPhase, Optional[int]]] = {}
        for record in ledger._groups.values():
            pair = (record.phase, record.target_step)
            if admissions.setdefault(record.admission_id, pair) != pair:
                raise ValueError(f"rollout recovery groups sharing admission_id="
                                 f"{record.admission_id!r} disagree on phase or target_step")
        return ledger

    def load_state_dict(self, cut: DataPlaneMutationCut, state: Any) -> None:
        """Fill this empty ledger from saved state."""
        cut.require_live()
        if self._groups:
            raise RuntimeError("cannot restore into a non-empty rollout recovery ledger")
        self._groups = self.from_state_dict(state)._groups

    # --- internals ------------------------------------------------------------------

    def _move(self, group_id: str, source: PromptGroupStatus, target: PromptGroupStatus,
              what: str) -> None:
        record = self._require_group(group_id)
        if record.status is not source:
            raise ValueError(f"cannot {what} group {group_id!r} from "
                             f"{record.status.value!r}")
        record.status = target

    def _require_group(self, group_id: str) -> PromptGroupRecoveryRecord:
        try:
            return self._groups[group_id]
        except KeyError:
            raise ValueError(f"unknown recovery group_id={group_id!r}") from None

    @staticmethod
    def _require_sibling(record: PromptGroupRecoveryRecord, index: int
                         ) -> RolloutSiblingRecord:
        if not 0 <= index < len(record.siblings):
            raise ValueError(f"generation_index={index} is outside group "
                             f"{record.group_id!r}")
        return record.siblings[index]

    @staticmethod
    def _copy(record: PromptGroupRecoveryRecord) -> PromptGroupRecoveryRecord:
        # The prompt is shared, not copied (it may be large); the lineage is copied.
        return dataclasses.replace(record, siblings=copy.deepcopy(record.siblings))


class RolloutRecoveryLedger(_LedgerRecords):
    """The controller's lineage of prompt groups (schema 4): every change needs a live
    cut. This revision keeps no record of the Gym episodes it drops."""

    # --- a group's life -------------------------------------------------------------

    def reserve_group(self, cut: DataPlaneMutationCut, *, prompt_id: str,
                      prompt_payload: Mapping[str, Any], expected_generations: int,
                      target_step: Optional[int], start_weight_version: int,
                      task_source: Optional[str] = None,
                      recovery_granularity: RecoveryGranularity = RecoveryGranularity.SIBLING,
                      restore_level: Optional[RecoveryTargetLevel] = None,
                      admitted: bool = True, group_id: Optional[str] = None,
                      admission_id: Optional[str] = None,
                      prompt_ref: Optional[PromptRef] = None,
                      ) -> PromptGroupRecoveryRecord:
        """A new group with one reserved attempt per sibling. Without ``restore_level``
        a group restarts from its siblings, or whole for prompt-group granularity."""
        cut.require_live()
        if not prompt_id:
            raise ValueError("prompt_id must not be empty")
        if prompt_ref is None:
            task_name = prompt_payload.get("task_name")
            if task_name is not None and not isinstance(task_name, str):
                raise TypeError("prompt task_name must be a string or None")
            prompt_ref = PromptRef(sample_id=prompt_id, task_name=task_name)
        if prompt_ref.sample_id != prompt_id:
            raise ValueError(f"dataset prompt reference must match prompt_id: "
                             f"{prompt_ref.sample_id!r} != {prompt_id!r}")
        if expected_generations < 1:
            raise ValueError("expected_generations must be at least one")
        group_id = group_id or str(uuid.uuid4())
        if group_id in self._groups:
            raise ValueError(f"duplicate recovery group_id={group_id!r}")
        admission_id = admission_id or group_id
        granularity = RecoveryGranularity(recovery_granularity)
        if restore_level is None:
            level = (RecoveryTargetLevel.PROMPT_GROUP
                     if granularity is RecoveryGranularity.PROMPT_GROUP
                     else RecoveryTargetLevel.SIBLING)
        else:
            level = RecoveryTargetLevel(restore_level)
        record = PromptGroupRecoveryRecord(
            group_id=group_id, admission_id=admission_id, prompt_id=prompt_id,
            prompt_ref=prompt_ref, task_source=task_source,
            recovery_granularity=granularity, restore_level=level,
            runtime_prompt_payload=prompt_payload,
            expected_generations=expected_generations, target_step=target_step,
            start_weight_version=start_weight_version,
            siblings=[RolloutSiblingRecord(i, [_fresh_attempt()])
                      for i in range(expected_generations)],
            phase=PromptGroupPhase.ADMITTED if admitted else PromptGroupPhase.RESERVED)
        self._groups[group_id] = record
        return self._copy(record)

    def mark_group_admitted(self, cut: DataPlaneMutationCut, group_id: str, *,
                            target_step: Optional[int], start_weight_version: int) -> None:
        cut.require_live()
        record = self._require_group(group_id)
        if record.phase is not PromptGroupPhase.RESERVED:
            raise ValueError(f"recovery group {group_id!r} is already {record.phase.value}")
        record.target_step = target_step
        record.start_weight_version = start_weight_version
        record.phase = PromptGroupPhase.ADMITTED

    def bind_runtime_prompt(self, cut: DataPlaneMutationCut, group_id: str,
                            prompt_payload: Mapping[str, Any]) -> None:
        """Give a loaded group its prompt back (the dataset's sample it names)."""
        cut.require_live()
        record = self._require_group(group_id)
        _check_prompt(record.prompt_ref, prompt_payload, group_id)
        record.runtime_prompt_payload = prompt_payload

    def mark_group_dispatched(self, cut: DataPlaneMutationCut, group_id: str, *,
                              generation_indices: Optional[list[int]] = None,
                              gym_instance_id: Optional[str] = None) -> None:
        cut.require_live()
        record = self._require_group(group_id)
        if record.phase is not PromptGroupPhase.ADMITTED:
            raise ValueError(f"cannot dispatch unadmitted recovery group {group_id!r}")
        if record.status is not PromptGroupStatus.GENERATING:
            raise ValueError(f"cannot dispatch group {group_id!r} from "
                             f"{record.status.value!r}")
        indices = (list(range(record.expected_generations)) if generation_indices is None
                   else generation_indices)
        attempts = [self._require_sibling(record, i).current_attempt for i in indices]
        if any(a.status is not RolloutAttemptStatus.RESERVED for a in attempts):
            raise ValueError("only reserved rollout attempts may be dispatched")
        for attempt in attempts:
            if (record.restore_level is RecoveryTargetLevel.TURN
                    and attempt.gym_instance_id is None and gym_instance_id is None):
                raise ValueError("turn-level rollout dispatch requires a Gym checkpoint "
                                 "owner")
            if attempt.gym_instance_id is not None:
                # A restored attempt goes back to the owner that holds its state.
                if gym_instance_id != attempt.gym_instance_id:
                    raise ValueError(
                        f"restored Gym rollout must return to its checkpoint owner: "
                        f"expected={attempt.gym_instance_id!r}, actual={gym_instance_id!r}")
            elif gym_instance_id is not None:
                attempt.gym_instance_id = gym_instance_id
            attempt.status = RolloutAttemptStatus.DISPATCHED

    def mark_sibling_sealed(self, cut: DataPlaneMutationCut, group_id: str, *,
                            generation_index: int, gate_rollout_id: str,
                            receipt: Optional[dict[str, Any]], reward: float,
                            mask_sample: bool) -> None:
        """One sibling's result, sealed as it streams in (sibling granularity only)."""
        cut.require_live()
        record = self._require_group(group_id)
        if record.recovery_granularity is RecoveryGranularity.PROMPT_GROUP:
            raise ValueError("prompt-group recovery must seal every sibling atomically")
        attempt = self._require_sibling(record, generation_index).current_attempt
        expected = record.gate_rollout_id(generation_index)
        keys = _manifest_keys(receipt)
        if not isinstance(mask_sample, bool):
            raise TypeError("mask_sample must be a bool")
        self._check_identity(gate_rollout_id, receipt, expected)
        if attempt.status is RolloutAttemptStatus.SEALED:
            same = (attempt.receipt == receipt and attempt.reward == float(reward)
                    and attempt.mask_sample is mask_sample and attempt.staging_keys == keys)
            if same:
                return  # the same seal twice: nothing to do
            raise ValueError(f"conflicting duplicate seal for "
                             f"{record.logical_rollout_id(generation_index)!r}")
        if attempt.status is not RolloutAttemptStatus.DISPATCHED:
            raise ValueError(f"cannot seal logical rollout "
                             f"{record.logical_rollout_id(generation_index)!r} from "
                             f"status {attempt.status.value!r}")
        self._seal(attempt, receipt, reward, mask_sample, keys)
        if all(s.current_attempt.status is RolloutAttemptStatus.SEALED
               for s in record.siblings):
            record.status = PromptGroupStatus.READY_TO_FINALIZE

    def mark_group_sealed(self, cut: DataPlaneMutationCut, group_id: str,
                          results: Mapping[int, SiblingSealResult]) -> None:
        """Every sibling of a prompt-group-granularity group at once, or none."""
        cut.require_live()
        record = self._require_group(group_id)
        if record.recovery_granularity is not RecoveryGranularity.PROMPT_GROUP:
            raise ValueError("atomic group sealing requires prompt-group recovery "
                             "granularity")
        if record.status is not PromptGroupStatus.GENERATING:
            raise ValueError(f"cannot seal group {group_id!r} from status "
                             f"{record.status.value!r}")
        wanted = set(range(record.expected_generations))
        if set(results) != wanted:
            raise ValueError(f"prompt-group seal requires every logical sibling exactly "
                             f"once: expected={sorted(wanted)}, actual={sorted(results)}")
        checked = []
        for index in range(record.expected_generations):
            result = results[index]
            attempt = self._require_sibling(record, index).current_attempt
            if attempt.status is not RolloutAttemptStatus.DISPATCHED:
                raise ValueError(f"cannot seal logical rollout "
                                 f"{record.logical_rollout_id(index)!r} from status "
                                 f"{attempt.status.value!r}")
            self._check_identity(result.gate_rollout_id, result.receipt,
                                 record.gate_rollout_id(index))
            if not isinstance(result.mask_sample, bool):
                raise TypeError("mask_sample must be a bool")
            checked.append((attempt, result, _manifest_keys(result.receipt)))
        for attempt, result, keys in checked:  # all checked: now change them all
            self._seal(attempt, result.receipt, result.reward, result.mask_sample, keys)
        record.status = PromptGroupStatus.READY_TO_FINALIZE

    def abandon_unsealed(self, cut: DataPlaneMutationCut, group_id: str) -> None:
        """Drop a group's failed work as its granularity says: a generating
        prompt-group group whole, otherwise its unsealed siblings."""
        cut.require_live()
        record = self._require_group(group_id)
        if record.status not in (PromptGroupStatus.GENERATING,
                                 PromptGroupStatus.READY_TO_FINALIZE):
            raise ValueError(f"cannot abandon group {group_id!r} from "
                             f"{record.status.value!r}")
        if (record.recovery_granularity is RecoveryGranularity.PROMPT_GROUP
                and record.status is PromptGroupStatus.GENERATING):
            self._abandon_whole_group(record)
            return
        for sibling in record.siblings:
            attempt = sibling.current_attempt
            if attempt.status is not RolloutAttemptStatus.SEALED:
                self._dropping(record, sibling)
                attempt.status = RolloutAttemptStatus.ABANDONED
        all_sealed = all(s.current_attempt.status is RolloutAttemptStatus.SEALED
                         for s in record.siblings)
        record.status = (PromptGroupStatus.READY_TO_FINALIZE if all_sealed
                         else PromptGroupStatus.GENERATING)

    def prepare_incomplete_retry(self, cut: DataPlaneMutationCut, group_id: str
                                 ) -> PromptGroupRecoveryRecord:
        """Fresh attempts for the abandoned or failed siblings (every sibling, for a
        prompt-group group, which must have dropped them all together)."""
        cut.require_live()
        record = self._require_group(group_id)
        if record.status is not PromptGroupStatus.GENERATING:
            raise ValueError(f"cannot retry group {group_id!r} from status "
                             f"{record.status.value!r}")
        statuses = [s.current_attempt.status for s in record.siblings]
        whole = (record.recovery_granularity is RecoveryGranularity.PROMPT_GROUP
                 and any(s in _DROPPABLE for s in statuses))
        if whole and not all(s in _DROPPABLE for s in statuses):
            raise ValueError("prompt-group retry requires every sibling attempt to be "
                             "abandoned or failed together")
        for sibling in record.siblings:
            status = sibling.current_attempt.status
            if status is RolloutAttemptStatus.RESERVED or (
                    status is RolloutAttemptStatus.SEALED
                    and record.recovery_granularity is RecoveryGranularity.SIBLING):
                continue
            if status not in _DROPPABLE:
                raise ValueError(f"cannot retry logical rollout "
                                 f"{record.logical_rollout_id(sibling.generation_index)!r} "
                                 f"from status {status.value!r}")
            sibling.attempts.append(_fresh_attempt())
        return self._copy(record)

    # --- leaving the ledger ---------------------------------------------------------

    def discard_group(self, cut: DataPlaneMutationCut, group_id: str) -> None:
        """The group leaves the ledger (published, or cleaned up); its staging rows are
        the caller's."""
        cut.require_live()
        record = self._require_group(group_id)
        for sibling in record.siblings:
            self._dropping(record, sibling)
        del self._groups[group_id]

    def discard_canonical_groups(self, cut: DataPlaneMutationCut, group_ids: set[str]
                                 ) -> int:
        cut.require_live()
        gone = [g for g in self._groups if g in group_ids]
        for group_id in gone:
            del self._groups[group_id]
        return len(gone)

    # --- what checkpointing reads ---------------------------------------------------

    def expected_staging_keys(self) -> set[str]:
        """The staging rows of the sealed current attempts of the groups it holds."""
        return {key for record in self._groups.values() for sibling in record.siblings
                if sibling.current_attempt.status is RolloutAttemptStatus.SEALED
                for key in sibling.current_attempt.staging_keys}

    def gym_checkpoint_inventory(self, instance_ids: set[str] | frozenset[str]
                                 ) -> dict[str, tuple[tuple[str, int], ...]]:
        """Per owner, the ``(rollout_id, attempt)`` of every generating TURN-level
        group's attempt Gym holds state for: dispatched, or reserved after a restore.
        Granularity does not matter here. An owner not asked about raises."""
        listed: dict[str, list[tuple[str, int]]] = {i: [] for i in instance_ids}
        for record in self._groups.values():
            if (record.status is not PromptGroupStatus.GENERATING
                    or record.restore_level is not RecoveryTargetLevel.TURN):
                continue
            for sibling in record.siblings:
                attempt = sibling.current_attempt
                if not _holds_gym_state(attempt):
                    continue
                owner = attempt.gym_instance_id
                if owner is None:
                    raise RuntimeError(
                        f"cannot checkpoint a dispatched turn-level rollout without Gym "
                        f"ownership: group={record.group_id!r}, "
                        f"generation_index={sibling.generation_index}")
                if owner not in listed:
                    raise RuntimeError(f"turn-level rollout references unavailable Gym "
                                       f"instance {owner!r}")
                listed[owner].append(record.gym_episode(sibling.generation_index))
        return {owner: tuple(sorted(eps)) for owner, eps in listed.items()}

    def prepare_for_restart(self, cut: DataPlaneMutationCut, *,
                            restored_gym_episodes: Optional[set[tuple[str, str, int]]] = None
                            ) -> None:
        """After a load: each generating group's unfinished attempts as its policy says.

        First, a group being published raises ``RuntimeError``. Finished groups are not
        touched. A generating group of PROMPT_GROUP granularity is abandoned whole
        (sealed siblings too, their rows let go), whatever its level. In the others,
        sealed attempts stay; a TURN-level attempt, dispatched or reserved, whose
        ``(owner, rollout_id, attempt)`` is in ``restored_gym_episodes`` continues as
        Gym's next attempt (reserved again); other reserved attempts stay reserved;
        every other attempt is abandoned. Then, if a given triple was not continued,
        ``ValueError`` (the changes above are already made)."""
        cut.require_live()
        self.assert_checkpoint_safe()
        restored = set(restored_gym_episodes or ())
        continued: set[tuple[str, str, int]] = set()
        for record in self._groups.values():
            if record.status is not PromptGroupStatus.GENERATING:
                continue
            if record.recovery_granularity is RecoveryGranularity.PROMPT_GROUP:
                self._abandon_whole_group(record, queue=False)
                continue
            for sibling in record.siblings:
                attempt = sibling.current_attempt
                if attempt.status is RolloutAttemptStatus.SEALED:
                    continue
                rollout_id, gym_attempt = record.gym_episode(sibling.generation_index)
                triple = (attempt.gym_instance_id or "", rollout_id, gym_attempt)
                if (record.restore_level is RecoveryTargetLevel.TURN
                        and attempt.status in (RolloutAttemptStatus.DISPATCHED,
                                               RolloutAttemptStatus.RESERVED)
                        and attempt.gym_instance_id is not None and triple in restored):
                    attempt.gym_attempt += 1
                    attempt.status = RolloutAttemptStatus.RESERVED
                    continued.add(triple)
                elif attempt.status is not RolloutAttemptStatus.RESERVED:
                    attempt.status = RolloutAttemptStatus.ABANDONED
        unused = restored - continued
        if unused:
            raise ValueError(f"Gym restored episodes are not owned by dispatched "
                             f"turn-level rollouts: {sorted(unused)!r}")

    # --- internals ------------------------------------------------------------------

    def _dropping(self, record: PromptGroupRecoveryRecord, sibling: RolloutSiblingRecord
                  ) -> None:
        """Called before a sibling's current attempt is dropped: this revision keeps
        no record of it."""

    def _abandon_whole_group(self, record: PromptGroupRecoveryRecord, queue: bool = True
                             ) -> None:
        for sibling in record.siblings:
            if queue:
                self._dropping(record, sibling)
            attempt = sibling.current_attempt
            attempt.status = RolloutAttemptStatus.ABANDONED
            attempt.receipt = None
            attempt.reward = None
            attempt.staging_keys.clear()
        record.status = PromptGroupStatus.GENERATING

    @staticmethod
    def _check_identity(gate_rollout_id: str, receipt: Optional[Mapping[str, Any]],
                        expected: str) -> None:
        if gate_rollout_id != expected:
            raise ValueError(f"streamed rollout identity mismatch: "
                             f"result={gate_rollout_id!r}, expected={expected!r}")
        if receipt is not None and receipt.get("rollout_id") != gate_rollout_id:
            raise ValueError(f"receipt rollout identity mismatch: "
                             f"receipt={receipt.get('rollout_id')!r}, "
                             f"expected={gate_rollout_id!r}")

    @staticmethod
    def _seal(attempt: RolloutAttemptRecord, receipt: Optional[dict[str, Any]],
              reward: float, mask_sample: bool, keys: list[str]) -> None:
        attempt.receipt = copy.deepcopy(receipt)
        attempt.reward = float(reward)
        attempt.mask_sample = mask_sample
        attempt.staging_keys = keys
        attempt.status = RolloutAttemptStatus.SEALED



class RolloutRecoveryLedgerWithRetirements(RolloutRecoveryLedger):
    """NeMo RL's ledger at a newer revision than schema 4's first: it also remembers
    the turn-level Gym episodes it drops while Gym still runs them (dispatched, or
    reserved after a restore), for the controller to retire and then acknowledge with
    ``mark_gym_retired``. The queue lives in this process only: never saved, empty
    after a load. Its saved state is schema 4's."""

    def __init__(self) -> None:
        super().__init__()
        self._retiring: dict[str, set[tuple[str, int]]] = {}

    def gym_checkpoint_retirements(self, instance_ids: set[str] | frozenset[str]
                                   ) -> dict[str, tuple[tuple[str, int], ...]]:
        """Per owner asked about, the dropped episodes not acknowledged yet."""
        return {owner: tuple(sorted(self._retiring.get(owner, ())))
                for owner in instance_ids}

    def mark_gym_retired(self, sent: Mapping[str, Iterable[tuple[str, int]]]) -> None:
        """The retirements in ``sent`` (as listed) reached Gym; later drops stay queued."""
        for owner, episodes in sent.items():
            queued = self._retiring.get(owner)
            if queued is not None:
                queued.difference_update(tuple(e) for e in episodes)

    def _dropping(self, record: PromptGroupRecoveryRecord, sibling: RolloutSiblingRecord
                  ) -> None:
        attempt = sibling.current_attempt
        if (record.restore_level is RecoveryTargetLevel.TURN
                and attempt.gym_instance_id is not None and _holds_gym_state(attempt)):
            self._retiring.setdefault(attempt.gym_instance_id, set()).add(
                record.gym_episode(sibling.generation_index))


def _holds_gym_state(attempt: RolloutAttemptRecord) -> bool:
    """Gym holds the attempt's state: dispatched, or reserved to continue a restore."""
    return attempt.status is RolloutAttemptStatus.DISPATCHED or (
        attempt.status is RolloutAttemptStatus.RESERVED and attempt.gym_attempt > 0)


def _nonempty(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _group_from_state(raw: Any, seen: set[uuid.UUID]) -> PromptGroupRecoveryRecord:
    """One saved group, checked as NeMo RL checks it."""
    if not isinstance(raw, dict):
        raise ValueError("rollout-recovery group must be a mapping")
    _unknown_fields(raw, _GROUP_FIELDS, "rollout-recovery group")
    group_id = _nonempty(raw.get("group_id"), "group_id")
    admission_id = _nonempty(raw.get("admission_id"), "admission_id")
    prompt_id = _nonempty(raw.get("prompt_id"), "prompt_id")
    task_source = raw.get("task_source")
    if task_source is not None and not isinstance(task_source, str):
        raise ValueError("task_source must be a string or None")
    granularity = _enum_field(RecoveryGranularity, raw.get("recovery_granularity"),
                              "recovery_granularity")
    level = _enum_field(RecoveryTargetLevel, raw.get("restore_level"), "restore_level")
    generations = raw.get("expected_generations")
    if isinstance(generations, bool) or not isinstance(generations, int) or generations < 1:
        raise ValueError("expected_generations must be a positive integer")
    raw_siblings = raw.get("siblings")
    if not isinstance(raw_siblings, list) or len(raw_siblings) != generations:
        raise ValueError(f"recovery group {group_id!r} must contain {generations} siblings")
    status = _enum_field(PromptGroupStatus, raw.get("status"), "prompt group status")
    phase = _enum_field(PromptGroupPhase, raw.get("phase"), "prompt group phase")
    siblings = [_sibling_from_state(s, i, f"{group_id}_g{i}", seen)
                for i, s in enumerate(raw_siblings)]
    ref = raw.get("prompt_ref")
    if not isinstance(ref, dict):
        raise ValueError("prompt_ref must be a mapping")
    _unknown_fields(ref, _PROMPT_REF_FIELDS, "rollout-recovery prompt_ref")
    sample_id, task_name = ref.get("sample_id"), ref.get("task_name")
    if not isinstance(sample_id, str) or not sample_id:
        raise ValueError("prompt_ref sample_id must be a non-empty string")
    if task_name is not None and not isinstance(task_name, str):
        raise ValueError("prompt_ref task_name must be a string or None")
    if sample_id != prompt_id:
        raise ValueError("prompt_ref sample_id must match prompt_id")
    target_step = raw.get("target_step")
    if target_step is not None and not isinstance(target_step, int):
        raise ValueError("target_step must be an integer or None")
    start_weight = raw.get("start_weight_version")
    if not isinstance(start_weight, int):
        raise ValueError("start_weight_version must be an integer")
    all_sealed = all(s.current_attempt.status is RolloutAttemptStatus.SEALED
                     for s in siblings)
    if status is PromptGroupStatus.GENERATING and all_sealed:
        raise ValueError("generating group must retain an unfinished sibling")
    if status is not PromptGroupStatus.GENERATING and not all_sealed:
        raise ValueError(f"group state {status.value!r} requires every sibling to be "
                         f"sealed")
    return PromptGroupRecoveryRecord(
        group_id=group_id, admission_id=admission_id, prompt_id=prompt_id,
        prompt_ref=PromptRef(sample_id, task_name), task_source=task_source,
        recovery_granularity=granularity, restore_level=level,
        runtime_prompt_payload=None, expected_generations=generations,
        target_step=target_step, start_weight_version=start_weight, siblings=siblings,
        phase=phase, status=status)


def _sibling_from_state(raw: Any, index: int, logical_id: str, seen: set[uuid.UUID]
                        ) -> RolloutSiblingRecord:
    if not isinstance(raw, dict):
        raise ValueError("rollout-recovery sibling must be a mapping")
    _unknown_fields(raw, _SIBLING_FIELDS, "rollout-recovery sibling")
    if raw.get("generation_index") != index:
        raise ValueError("generation indices must be contiguous")
    raw_attempts = raw.get("attempts")
    if not isinstance(raw_attempts, list) or not raw_attempts:
        raise ValueError(f"logical rollout {logical_id!r} has no attempts")
    return RolloutSiblingRecord(index, [_attempt_from_state(a, logical_id, seen)
                                        for a in raw_attempts])


def _attempt_from_state(raw: Any, logical_id: str, seen: set[uuid.UUID]
                        ) -> RolloutAttemptRecord:
    if not isinstance(raw, dict):
        raise ValueError("rollout-recovery attempt must be a mapping")
    _unknown_fields(raw, _ATTEMPT_FIELDS, "rollout-recovery attempt")
    raw_uuid = raw.get("attempt_uuid")
    if not isinstance(raw_uuid, bytes) or len(raw_uuid) != 16:
        raise ValueError("attempt_uuid must contain exactly 16 bytes")
    attempt_uuid = uuid.UUID(bytes=raw_uuid)
    if attempt_uuid in seen:
        raise ValueError("duplicate rollout attempt identity")
    seen.add(attempt_uuid)
    raw_status = raw.get("status")
    try:
        status = RolloutAttemptStatus(raw_status) if isinstance(raw_status, str) else None
    except ValueError:
        status = None
    if status is None:
        raise ValueError(f"invalid rollout attempt status={raw_status!r}")
    receipt, reward, mask_sample = raw.get("receipt"), raw.get("reward"), raw.get("mask_sample")
    keys, owner = raw.get("staging_keys"), raw.get("gym_instance_id")
    gym_attempt = raw.get("gym_attempt", 0)
    if owner is not None and (not isinstance(owner, str) or not owner):
        raise ValueError("gym_instance_id must be a non-empty string or None")
    if isinstance(gym_attempt, bool) or not isinstance(gym_attempt, int) or gym_attempt < 0:
        raise ValueError("gym_attempt must be a non-negative integer")
    if gym_attempt > 0 and owner is None:
        raise ValueError("resumed Gym attempts require gym_instance_id")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError("staging_keys must be a list of strings")
    if status is RolloutAttemptStatus.SEALED:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ValueError("sealed attempts require a reward")
        if not isinstance(mask_sample, bool):
            raise ValueError("sealed attempts require a boolean mask_sample")
        gate_id = f"{logical_id}_a{attempt_uuid.hex}"
        gate_id = gate_id if gym_attempt == 0 else f"{gate_id}-a{gym_attempt}"
        if receipt is None:
            if keys:
                raise ValueError("sealed missing-receipt attempt cannot own staging keys")
        elif not isinstance(receipt, dict):
            raise ValueError("sealed attempt receipt must be a mapping or None")
        elif receipt.get("rollout_id") != gate_id:
            raise ValueError("sealed receipt identity mismatch")
        elif _manifest_keys(receipt) != keys:
            raise ValueError("sealed receipt staging manifest mismatch")
    elif receipt is not None or reward is not None or mask_sample is not None or keys:
        raise ValueError("only sealed attempts may retain receipt data")
    return RolloutAttemptRecord(
        attempt_uuid=attempt_uuid, status=status, receipt=copy.deepcopy(receipt),
        reward=None if reward is None else float(reward), mask_sample=mask_sample,
        staging_keys=list(keys), gym_instance_id=owner, gym_attempt=gym_attempt)


def publish_group(cut: DataPlaneMutationCut, ledger: RolloutRecoveryLedger,
                  published: PublishedGroups, group_id: str
                  ) -> tuple[tuple[str, ...], ...]:
    """The controller's publication of a finished group, in NeMo RL's order: its
    finalization starts, it joins the replay index with its staging rows, and it
    leaves the ledger (``discard_group``). Returns each sibling's rows, which stay staged
    until a train step takes the group (``PublishedGroups.take``)."""
    cut.require_live()
    _, _, receipts, _, _ = ledger.finalization_inputs(group_id)
    ledger.mark_finalization_started(cut, group_id)
    rows = tuple(tuple(_manifest_keys(receipt)) for receipt in receipts)
    published.add(cut, group_id, rows)
    ledger.discard_group(cut, group_id)
    return rows


# --- RL's half of a rollout snapshot -------------------------------------------------

# A saved ledger may hold what JSON has no type for (attempt ids are 16 bytes), and
# maps with keys that are not strings: both are written as tagged objects, and any key
# that could be read as a tag is written the same way.
_BYTES, _ITEMS = "$bytes", "$items"


def _to_json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {_BYTES: bytes(value).hex()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _to_json(v) for k, v in value.items()}
        return {_ITEMS: [[_to_json(k), _to_json(v)] for k, v in value.items()]}
    raise TypeError(f"RL's state holds a {type(value).__name__}, which NemoRlState "
                    f"cannot save: give the ledger a state_dict() of mappings, lists, "
                    f"str, bytes, numbers, bools and None")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_BYTES} and isinstance(value[_BYTES], str):
            return bytes.fromhex(value[_BYTES])
        if set(value) == {_ITEMS} and isinstance(value[_ITEMS], list):
            return {_hashable(_from_json(k)): _from_json(v) for k, v in value[_ITEMS]}
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


class NemoRlState:
    """RL's half of a rollout snapshot for ``RolloutCheckpointManager`` (``RlHalf``):
    the ledger's ``state_dict()``, the staging rows and the published groups, saved as
    ``<path>/nemo_rl_state.json``; a restore loads them into the same objects (the
    ledger with ``load_state_dict(cut, state)``: it must be empty, as a restarted job's
    is), hands over through ``NemoRlEnvironmentCheckpoint.prepare_for_restart``, and
    clears the staging rows neither the plan nor a published group keeps.

    Any ledger with ``state_dict()`` and ``load_state_dict(cut, state)`` works (NeMo
    RL's, or this module's); the one given is the one kept. A loaded ledger's groups
    have no prompt until the caller binds them (``bind_runtime_prompt``), as NeMo RL's
    controller does from its dataset before the next save."""

    def __init__(self, integration: Any, barrier: DataPlaneCheckpointBarrier,
                 ledger: Optional[Any] = None, staging: Optional[StagingPartition] = None,
                 published: Optional[PublishedGroups] = None) -> None:
        self.integration = integration
        self.barrier = barrier
        self.ledger = RolloutRecoveryLedger() if ledger is None else ledger
        self.staging = StagingPartition() if staging is None else staging
        self.published = PublishedGroups() if published is None else published
        self.cleared: frozenset[str] = frozenset()

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        run = getattr(self.integration, "run_blocking", None)
        return await (run(fn, *args) if run is not None else asyncio.to_thread(fn, *args))

    async def save(self, cut: DataPlaneMutationCut, path: str) -> None:
        cut.require_live()
        data = json.dumps({
            "ledger": _to_json(self.ledger.state_dict()),
            "staging": {k: v.hex() for k, v in self.staging.rows.items()},
            "published": {g: [list(keys) for keys in rows]
                          for g, rows in self.published.groups.items()}})
        folder = folder_at(path)
        await self._blocking(folder.prepare)
        await self._blocking(folder.write_bytes, STATE_FILE, data.encode())

    async def restore(self, path: str, restored: RestoredEnvironmentRollouts) -> Any:
        """Load RL's half into this ledger and staging, hand the environment's restore
        over to the ledger, and return the ledger's plan (the manager's hand-over is made
        from it)."""
        folder = folder_at(path)
        raw = load_stored_json(
            await self._blocking(folder.read, STATE_FILE, _MAX_STATE_BYTES + 1),
            folder.describe(STATE_FILE), _MAX_STATE_BYTES)
        published = {str(g): tuple(tuple(keys) for keys in rows)
                     for g, rows in raw.get("published", {}).items()}
        async with self.barrier.checkpoint() as cut:
            self.ledger.load_state_dict(cut, _from_json(raw["ledger"]))
            self.staging.rows = {k: bytes.fromhex(v) for k, v in raw["staging"].items()}
            self.published.groups = published
            plan = await self.integration.prepare_for_restart(cut, restored)
            # As NeMo RL's controller keeps them: the plan's rows and the published
            # groups' (still to be trained).
            keep = frozenset(plan.keep_staging_keys) | self.published.staging_keys()
            self.cleared = self.staging.keep_only(cut, keep)
        return plan

    async def remove(self, path: str) -> None:
        folder = folder_at(path)
        if STATE_FILE in await self._blocking(folder.names):
            await self._blocking(folder.remove, [STATE_FILE])
