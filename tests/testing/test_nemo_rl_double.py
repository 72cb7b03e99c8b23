"""The double of NeMo RL's recovery objects (``nemo_ckpt.testing.nemo_rl``) behaves as
NeMo RL's own do (docs/NEMO_RL.md names the revision of each): each test names the
NeMo RL behaviour it pins, with NeMo RL's error type and message where one is raised.
In-process, no Ray."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from nemo_ckpt.integrations.nemo_rl import RestartPlan
from nemo_ckpt.interfaces import RestoredEnvironmentRollouts
from nemo_ckpt.testing.nemo_rl import (
    STATE_FILE,
    DataPlaneCheckpointBarrier,
    DataPlaneMutationCut,
    NemoRlState,
    PromptGroupStatus,
    PublishedGroups,
    RecoveryGranularity,
    RecoveryTargetLevel,
    RolloutAttemptStatus,
    RolloutRecoveryLedger,
    RolloutRecoveryLedgerWithRetirements,
    SiblingSealResult,
    StagingPartition,
    publish_group,
)

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")
OWNER = "tools/replica-0"


def mutate(fn: Callable[[DataPlaneMutationCut], T]) -> T:
    """``fn`` under a live cut of a fresh barrier, as NeMo RL's own tests take one."""
    async def run() -> T:
        async with DataPlaneCheckpointBarrier().mutation() as cut:
            return fn(cut)
    return asyncio.run(run())


def reserve(ledger: RolloutRecoveryLedger, group: str = "g7", prompt: int = 7,
            generations: int = 2, **kwargs: Any) -> Any:
    return mutate(lambda cut: ledger.reserve_group(
        cut, group_id=group, prompt_id=str(prompt), prompt_payload={"idx": prompt},
        expected_generations=generations, target_step=1, start_weight_version=0, **kwargs))


def turn_group(ledger: RolloutRecoveryLedger, group: str = "g7", prompt: int = 7,
               **kwargs: Any) -> Any:
    """A TURN-level group dispatched to ``OWNER``."""
    record = reserve(ledger, group, prompt, restore_level=RecoveryTargetLevel.TURN, **kwargs)
    mutate(lambda cut: ledger.mark_group_dispatched(cut, group, gym_instance_id=OWNER))
    return record


def seal(ledger: RolloutRecoveryLedger, group: str, index: int, keys: list[str]) -> None:
    gate = ledger.get_group(group).gate_rollout_id(index)
    mutate(lambda cut: ledger.mark_sibling_sealed(
        cut, group, generation_index=index, gate_rollout_id=gate,
        receipt={"rollout_id": gate, "manifest": [{"staging_key": k} for k in keys]},
        reward=1.0, mask_sample=False))


def statuses(ledger: RolloutRecoveryLedger, group: str) -> list[RolloutAttemptStatus]:
    return [s.current_attempt.status for s in ledger.get_group(group).siblings]


# --- signatures and defaults (rollout_recovery.py) ------------------------------------


def test_reserve_group_takes_the_prompt_its_target_step_and_its_weight_version() -> None:
    ledger = RolloutRecoveryLedger()
    with pytest.raises(TypeError, match="prompt_id"):
        mutate(lambda cut: ledger.reserve_group(  # type: ignore[call-arg]
            cut, group_id="g7", expected_generations=1))
    record = reserve(ledger)
    assert (record.prompt_id, record.prompt_ref.sample_id, record.target_step,
            record.start_weight_version) == ("7", "7", 1, 0)
    assert [s.current_attempt.status for s in record.siblings] == [
        RolloutAttemptStatus.RESERVED] * 2


def test_the_default_restore_level_is_sibling_and_prompt_group_for_prompt_group_granularity(
        ) -> None:
    ledger = RolloutRecoveryLedger()
    sibling = reserve(ledger, "g1", 1)
    whole = reserve(ledger, "g2", 2, recovery_granularity=RecoveryGranularity.PROMPT_GROUP)
    chosen = reserve(ledger, "g3", 3, recovery_granularity=RecoveryGranularity.PROMPT_GROUP,
                     restore_level=RecoveryTargetLevel.TURN)
    assert (sibling.recovery_granularity, sibling.restore_level) == (
        RecoveryGranularity.SIBLING, RecoveryTargetLevel.SIBLING)
    assert whole.restore_level is RecoveryTargetLevel.PROMPT_GROUP
    assert chosen.restore_level is RecoveryTargetLevel.TURN


def test_a_turn_level_dispatch_without_an_owner_is_refused() -> None:
    ledger = RolloutRecoveryLedger()
    reserve(ledger, restore_level=RecoveryTargetLevel.TURN)
    with pytest.raises(ValueError, match="^turn-level rollout dispatch requires a Gym "
                                         "checkpoint owner$"):
        mutate(lambda cut: ledger.mark_group_dispatched(cut, "g7"))


def test_mark_sibling_sealed_requires_a_reward_and_a_boolean_mask_sample() -> None:
    ledger = RolloutRecoveryLedger()
    record = reserve(ledger)
    mutate(lambda cut: ledger.mark_group_dispatched(cut, "g7"))
    gate = record.gate_rollout_id(0)
    with pytest.raises(TypeError, match="reward"):
        mutate(lambda cut: ledger.mark_sibling_sealed(  # type: ignore[call-arg]
            cut, "g7", generation_index=0, gate_rollout_id=gate, receipt=None))
    with pytest.raises(TypeError, match="^mask_sample must be a bool$"):
        mutate(lambda cut: ledger.mark_sibling_sealed(
            cut, "g7", generation_index=0, gate_rollout_id=gate, receipt=None, reward=1.0,
            mask_sample=1))  # type: ignore[arg-type]
    seal(ledger, "g7", 0, ["g7/0"])
    assert statuses(ledger, "g7") == [RolloutAttemptStatus.SEALED,
                                      RolloutAttemptStatus.DISPATCHED]


def test_a_prompt_group_granularity_group_seals_all_siblings_at_once_or_none() -> None:
    ledger = RolloutRecoveryLedger()
    record = reserve(ledger, recovery_granularity=RecoveryGranularity.PROMPT_GROUP)
    mutate(lambda cut: ledger.mark_group_dispatched(cut, "g7"))
    with pytest.raises(ValueError, match="^prompt-group recovery must seal every sibling "
                                         "atomically$"):
        seal(ledger, "g7", 0, [])
    gates = record.gate_rollout_ids
    results = {i: SiblingSealResult(gates[i], None, 0.0, True) for i in range(2)}
    with pytest.raises(ValueError, match="requires every logical sibling exactly once"):
        mutate(lambda cut: ledger.mark_group_sealed(cut, "g7", {0: results[0]}))
    assert statuses(ledger, "g7") == [RolloutAttemptStatus.DISPATCHED] * 2
    mutate(lambda cut: ledger.mark_group_sealed(cut, "g7", results))
    assert ledger.get_group("g7").status is PromptGroupStatus.READY_TO_FINALIZE


def test_an_unknown_group_is_a_value_error() -> None:
    ledger = RolloutRecoveryLedger()
    with pytest.raises(ValueError, match=r"^unknown recovery group_id='nope'$"):
        ledger.get_group("nope")
    with pytest.raises(ValueError, match=r"^unknown recovery group_id='nope'$"):
        mutate(lambda cut: ledger.discard_group(cut, "nope"))


def test_a_mutation_with_an_expired_cut_is_refused() -> None:
    ledger = RolloutRecoveryLedger()

    async def run() -> None:
        async with DataPlaneCheckpointBarrier().mutation() as cut:
            pass
        with pytest.raises(RuntimeError, match="^data-plane mutation cut is no longer "
                                               "active$"):
            ledger.reserve_group(cut, prompt_id="7", prompt_payload={"idx": 7},
                                 expected_generations=1, target_step=1,
                                 start_weight_version=0)

    asyncio.run(run())
    assert len(ledger) == 0


# --- the barrier (replay_buffer.py) ---------------------------------------------------


@pytest.mark.parametrize("inner", ["mutation", "checkpoint"])
@pytest.mark.parametrize("outer", ["mutation", "checkpoint"])
def test_the_barrier_refuses_a_second_section_in_one_task(outer: str, inner: str) -> None:
    barrier = DataPlaneCheckpointBarrier()

    async def run() -> None:
        async with getattr(barrier, outer)():
            with pytest.raises(RuntimeError, match="^this task already holds a data-plane "
                                                   "barrier section; pass the "
                                                   "DataPlaneMutationCut you already have"):
                async with getattr(barrier, inner)():
                    pass
        # Left, the section is free again: another in the same task opens.
        async with getattr(barrier, inner)() as cut:
            cut.require_live()

    asyncio.run(asyncio.wait_for(run(), 5))


def test_a_mutation_of_an_unknown_kind_is_refused() -> None:
    async def run() -> None:
        async with DataPlaneCheckpointBarrier().mutation("nonsense"):
            pass

    with pytest.raises(ValueError, match="^unknown checkpoint mutation kind 'nonsense'"):
        asyncio.run(run())


# --- what a restart does (prepare_for_restart) ----------------------------------------


def test_prepare_for_restart_leaves_reserved_attempts_reserved_and_abandons_dispatched_ones(
        ) -> None:
    ledger = RolloutRecoveryLedger()
    reserve(ledger)
    mutate(lambda cut: ledger.mark_group_dispatched(cut, "g7", generation_indices=[1]))
    mutate(lambda cut: ledger.prepare_for_restart(cut))
    assert statuses(ledger, "g7") == [RolloutAttemptStatus.RESERVED,
                                      RolloutAttemptStatus.ABANDONED]


def test_prepare_for_restart_continues_a_restored_turn_as_gyms_next_attempt() -> None:
    ledger = RolloutRecoveryLedger()
    record = turn_group(ledger, generations=1)
    (episode,) = ledger.gym_checkpoint_inventory({OWNER})[OWNER]
    mutate(lambda cut: ledger.prepare_for_restart(
        cut, restored_gym_episodes={(OWNER, *episode)}))
    attempt = ledger.get_group("g7").siblings[0].current_attempt
    assert (attempt.status, attempt.gym_attempt) == (RolloutAttemptStatus.RESERVED, 1)
    assert ledger.get_group("g7").gate_rollout_id(0) == f"{record.gate_rollout_id(0)}-a1"
    # Reserved after a restore, Gym holds its state: it is in the inventory still.
    assert ledger.gym_checkpoint_inventory({OWNER})[OWNER] == ((episode[0], 1),)
    with pytest.raises(ValueError, match="^restored Gym rollout must return to its "
                                         "checkpoint owner: expected='tools/replica-0', "
                                         "actual='tools/replica-1'$"):
        mutate(lambda cut: ledger.mark_group_dispatched(cut, "g7",
                                                        gym_instance_id="tools/replica-1"))


def test_the_inventory_lists_a_turn_level_group_of_prompt_group_granularity(
        ) -> None:
    ledger = RolloutRecoveryLedger()
    record = turn_group(ledger, recovery_granularity=RecoveryGranularity.PROMPT_GROUP)
    reserve(ledger, "g8", 8)  # sibling-level: never listed
    assert ledger.gym_checkpoint_inventory({OWNER, "tools/replica-1"}) == {
        OWNER: tuple(sorted(record.gym_episode(i) for i in range(2))),
        "tools/replica-1": ()}
    with pytest.raises(RuntimeError, match="^turn-level rollout references unavailable Gym "
                                           "instance 'tools/replica-0'$"):
        ledger.gym_checkpoint_inventory({"tools/replica-1"})


def test_prepare_for_restart_abandons_a_prompt_group_granularity_group_whole_then_refuses_its_sessions(  # noqa: E501
        ) -> None:
    """Issue 52 point 1: listed by the inventory, such a group's captured sessions are
    handed to ``prepare_for_restart``, which abandons the group whole (by granularity,
    whatever its level) and then raises for the triples it did not continue."""
    ledger = RolloutRecoveryLedger()
    turn_group(ledger, recovery_granularity=RecoveryGranularity.PROMPT_GROUP)
    triples = {(OWNER, *ep) for ep in ledger.gym_checkpoint_inventory({OWNER})[OWNER]}
    with pytest.raises(ValueError, match="^Gym restored episodes are not owned by "
                                         "dispatched turn-level rollouts: "):
        mutate(lambda cut: ledger.prepare_for_restart(cut, restored_gym_episodes=triples))
    # The changes were made before it raised.
    assert statuses(ledger, "g7") == [RolloutAttemptStatus.ABANDONED] * 2
    assert ledger.gym_checkpoint_inventory({OWNER}) == {OWNER: ()}


def test_prepare_for_restart_drops_a_prompt_group_groups_sealed_rows_and_keeps_a_finished_group(
        ) -> None:
    ledger = RolloutRecoveryLedger()
    record = reserve(ledger, recovery_granularity=RecoveryGranularity.PROMPT_GROUP,
                     restore_level=RecoveryTargetLevel.SIBLING)
    mutate(lambda cut: ledger.mark_group_dispatched(cut, "g7"))
    gates = record.gate_rollout_ids
    mutate(lambda cut: ledger.mark_group_sealed(cut, "g7", {
        i: SiblingSealResult(gates[i], {"rollout_id": gates[i],
                                        "manifest": [{"staging_key": f"g7/{i}"}]}, 1.0,
                             False) for i in range(2)}))
    reserve(ledger, "g8", 8, recovery_granularity=RecoveryGranularity.PROMPT_GROUP)
    mutate(lambda cut: ledger.mark_group_dispatched(cut, "g8"))
    mutate(lambda cut: ledger.prepare_for_restart(cut))
    # Only generating groups are touched: g7 is finished, g8 is abandoned whole.
    assert ledger.get_group("g7").status is PromptGroupStatus.READY_TO_FINALIZE
    assert ledger.expected_staging_keys() == {"g7/0", "g7/1"}
    assert statuses(ledger, "g8") == [RolloutAttemptStatus.ABANDONED] * 2


def test_prepare_for_restart_refuses_a_group_still_finalizing_before_changing_anything(
        ) -> None:
    ledger = RolloutRecoveryLedger()
    reserve(ledger, "g7", 7, generations=1)
    mutate(lambda cut: ledger.mark_group_dispatched(cut, "g7"))
    seal(ledger, "g7", 0, ["g7/0"])
    mutate(lambda cut: ledger.mark_finalization_started(cut, "g7"))
    turn_group(ledger, "g8", 8)
    with pytest.raises(RuntimeError, match=r"^rollout recovery contains checkpoint-unsafe "
                                           r"group states: groups=\['g7'\]$"):
        mutate(lambda cut: ledger.prepare_for_restart(cut))
    assert statuses(ledger, "g8") == [RolloutAttemptStatus.DISPATCHED] * 2
    with pytest.raises(RuntimeError, match="checkpoint-unsafe group states"):
        ledger.state_dict()


# --- published groups and their rows (the controller's order) ------------------------


def test_a_published_group_leaves_the_ledger_while_its_staging_rows_stay() -> None:
    ledger, staging, published = RolloutRecoveryLedger(), StagingPartition(), PublishedGroups()
    reserve(ledger)
    mutate(lambda cut: ledger.mark_group_dispatched(cut, "g7"))
    def stage(cut: DataPlaneMutationCut) -> None:
        for i in range(2):
            staging.put(cut, f"g7/{i}", b"tokens")

    mutate(stage)
    for i in range(2):
        seal(ledger, "g7", i, [f"g7/{i}"])
    rows = mutate(lambda cut: publish_group(cut, ledger, published, "g7"))
    assert rows == (("g7/0",), ("g7/1",))
    assert "g7" not in ledger and ledger.expected_staging_keys() == set()
    assert set(staging.rows) == {"g7/0", "g7/1"} == published.staging_keys()
    assert mutate(lambda cut: published.take(cut, "g7")) == rows
    assert published.staging_keys() == frozenset()


# --- retirements: schema 4 has none, a newer ledger queues them -----------------------


def test_the_schema_4_ledger_has_no_retirement_queue() -> None:
    ledger = RolloutRecoveryLedger()
    assert not hasattr(ledger, "gym_checkpoint_retirements")
    assert not hasattr(ledger, "mark_gym_retired")
    turn_group(ledger)
    mutate(lambda cut: ledger.abandon_unsealed(cut, "g7"))
    assert statuses(ledger, "g7") == [RolloutAttemptStatus.ABANDONED] * 2


def test_the_newer_ledger_queues_dropped_gym_episodes_until_mark_gym_retired() -> None:
    ledger = RolloutRecoveryLedgerWithRetirements()
    first = turn_group(ledger)
    mutate(lambda cut: ledger.abandon_unsealed(cut, "g7"))
    sent = ledger.gym_checkpoint_retirements({OWNER})
    assert sent == {OWNER: tuple(sorted(first.gym_episode(i) for i in range(2)))}
    later = turn_group(ledger, "g8", 8, generations=1)
    mutate(lambda cut: ledger.discard_group(cut, "g8"))
    reserve(ledger, "g9", 9, restore_level=RecoveryTargetLevel.TURN)  # never reached Gym
    mutate(lambda cut: ledger.abandon_unsealed(cut, "g9"))
    ledger.mark_gym_retired(sent)
    assert ledger.gym_checkpoint_retirements({OWNER}) == {OWNER: (later.gym_episode(0),)}
    # This process's bookkeeping only: a loaded ledger has none.
    loaded = RolloutRecoveryLedgerWithRetirements.from_state_dict(ledger.state_dict())
    assert loaded.gym_checkpoint_retirements({OWNER}) == {OWNER: ()}
    assert set(ledger.state_dict()) == {"schema_version", "groups"}


# --- saved state (schema 4) ----------------------------------------------------------


def test_the_saved_state_holds_attempt_ids_as_bytes_and_a_loaded_group_needs_its_prompt(
        ) -> None:
    ledger = RolloutRecoveryLedger()
    turn_group(ledger)
    seal(ledger, "g7", 0, ["g7/0"])
    state = ledger.state_dict()
    assert state["schema_version"] == 4
    attempt = state["groups"][0]["siblings"][0]["attempts"][0]
    assert isinstance(attempt["attempt_uuid"], bytes) and len(attempt["attempt_uuid"]) == 16
    with pytest.raises(TypeError, match="not JSON serializable"):
        json.dumps(state)
    loaded = RolloutRecoveryLedger()
    mutate(lambda cut: loaded.load_state_dict(cut, state))
    with pytest.raises(RuntimeError, match="^cannot checkpoint recovery group 'g7' before "
                                           "its prompt is rehydrated$"):
        loaded.state_dict()
    with pytest.raises(ValueError, match="resolved sample_id=8; expected '7'"):
        mutate(lambda cut: loaded.bind_runtime_prompt(cut, "g7", {"idx": 8}))
    mutate(lambda cut: loaded.bind_runtime_prompt(cut, "g7", {"idx": 7}))
    assert loaded.state_dict() == state
    with pytest.raises(RuntimeError, match="^cannot restore into a non-empty rollout "
                                           "recovery ledger$"):
        mutate(lambda cut: loaded.load_state_dict(cut, state))


def test_a_saved_state_of_another_schema_or_with_unknown_fields_is_refused() -> None:
    ledger = RolloutRecoveryLedger()
    reserve(ledger)
    state = ledger.state_dict()
    with pytest.raises(ValueError, match="^Unsupported rollout-recovery schema version: 3; "
                                         "expected 4$"):
        RolloutRecoveryLedger.from_state_dict({**state, "schema_version": 3})
    state["groups"][0]["siblings"][0]["attempts"][0]["extra"] = 1
    with pytest.raises(ValueError, match=r"^rollout-recovery attempt contains unknown "
                                         r"fields: \['extra'\]$"):
        RolloutRecoveryLedger.from_state_dict(state)


# --- NemoRlState: RL's half with any ledger -------------------------------------------


class Handover:
    """The integration's part of a restore, as ``NemoRlEnvironmentCheckpoint`` does it:
    the ledger's ``prepare_for_restart`` with the continued attempts, and the rows kept."""

    def __init__(self) -> None:
        self.rl: NemoRlState | None = None

    async def prepare_for_restart(self, cut: DataPlaneMutationCut,
                                  restored: RestoredEnvironmentRollouts) -> RestartPlan:
        assert self.rl is not None
        ledger = self.rl.ledger
        ledger.prepare_for_restart(cut, restored_gym_episodes=set(restored.continued_attempts))
        keep = frozenset(restored.staging_keys) | frozenset(ledger.expected_staging_keys())
        return RestartPlan(frozenset(restored.continued_attempts), keep, frozenset())


def run_rl(fn: Callable[[NemoRlState, DataPlaneCheckpointBarrier], Awaitable[T]],
           ledger: Any) -> tuple[NemoRlState, T]:
    handover = Handover()
    barrier = DataPlaneCheckpointBarrier()
    rl = NemoRlState(handover, barrier, ledger=ledger)
    handover.rl = rl
    return rl, asyncio.run(asyncio.wait_for(fn(rl, barrier), 10))


@pytest.mark.parametrize("kind", [RolloutRecoveryLedger, RolloutRecoveryLedgerWithRetirements])
def test_nemo_rl_state_saves_and_restores_a_ledger_holding_groups_into_the_same_ledger(
        tmp_path: Path, kind: type[RolloutRecoveryLedger]) -> None:
    path = str(tmp_path / "snap")
    saved = kind()
    record = turn_group(saved)
    reserve(saved, "g8", 8)
    mutate(lambda cut: saved.mark_group_dispatched(cut, "g8"))
    for i in range(2):
        seal(saved, "g8", i, [f"g8/{i}"])

    async def save(rl: NemoRlState, barrier: DataPlaneCheckpointBarrier) -> None:
        async with barrier.mutation() as cut:
            rl.staging.put(cut, "g7/0", b"turn")
            rl.staging.put(cut, "stray", b"x")
            for i in range(2):
                rl.staging.put(cut, f"g8/{i}", b"sealed")
            publish_group(cut, rl.ledger, rl.published, "g8")
        async with barrier.checkpoint() as cut:
            await rl.save(cut, path)

    run_rl(save, saved)
    assert (tmp_path / "snap" / STATE_FILE).is_file()
    episode = record.gym_episode(0)
    restored = RestoredEnvironmentRollouts(
        continued_attempts=frozenset({(OWNER, *episode)}), staging_keys=frozenset({"g7/0"}))
    empty = kind()

    async def restore(rl: NemoRlState, barrier: DataPlaneCheckpointBarrier) -> None:
        await rl.restore(path, restored)

    rl, _ = run_rl(restore, empty)
    assert rl.ledger is empty and type(rl.ledger) is kind
    assert [g.group_id for g in empty.groups()] == ["g7"]
    assert empty.get_group("g7").siblings[0].current_attempt.gym_attempt == 1
    assert statuses(empty, "g7") == [RolloutAttemptStatus.RESERVED,
                                     RolloutAttemptStatus.ABANDONED]
    # The published group's rows are kept (still to be trained), the stray one cleared.
    assert rl.published.groups == {"g8": (("g8/0",), ("g8/1",))}
    assert set(rl.staging.rows) == {"g7/0", "g8/0", "g8/1"}
    assert rl.cleared == {"stray"}


def test_nemo_rl_state_keeps_the_empty_ledger_it_is_given() -> None:
    ledger = RolloutRecoveryLedgerWithRetirements()
    rl = NemoRlState(Handover(), DataPlaneCheckpointBarrier(), ledger=ledger)
    assert rl.ledger is ledger
