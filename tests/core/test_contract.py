"""The contract RL's single controller programs against (``nemo_ckpt/interfaces.py``):
names, signatures, dataclass shapes, validation, and that both implementations in this
project (``NoEnvironmentCheckpoint`` and ``RayEnvironmentCheckpoint``) keep it.

These checks run without Ray: they are the contract, not the runtime.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

import nemo_ckpt
import nemo_ckpt.interfaces as contract
from nemo_ckpt.interfaces import (
    EnvironmentCheckpoint,
    EnvironmentEpisode,
    EnvironmentSnapshot,
    NoEnvironmentCheckpoint,
    RestoredEnvironmentRollouts,
)

pytestmark = pytest.mark.timeout(30)

CONTRACT_NAMES = ("EnvironmentEpisode", "RestoredEnvironmentRollouts", "EnvironmentSnapshot",
                  "EnvironmentCheckpoint", "NoEnvironmentCheckpoint")

# Each protocol member: (kind, parameters after self, return annotation as written).
SNAPSHOT_MEMBERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "restarted_rollouts": ("property", (), "int"),
    "check_against_cut": ("async", ("cut",), "None"),
    "metrics": ("method", ("paused_seconds",), "dict[str, float | int]"),
}
CHECKPOINT_MEMBERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "holds_rollout_state": ("property", (), "bool"),
    "check_startup": ("async", (), "None"),
    "snapshot": ("method", ("checkpoint_path",),
                 "contextlib.AbstractAsyncContextManager[Optional[EnvironmentSnapshot]]"),
    "restored": ("method", ("checkpoint_path",),
                 "contextlib.AbstractAsyncContextManager[RestoredEnvironmentRollouts]"),
    "is_unavailable": ("method", ("error",), "bool"),
}
PARAMETER_ANNOTATIONS = {"cut": "DataPlaneMutationCut", "paused_seconds": "float",
                         "checkpoint_path": "Path", "error": "BaseException"}


def params(fn: Any) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def kind(cls: type, name: str) -> str:
    member = inspect.getattr_static(cls, name)
    if isinstance(member, property):
        return "property"
    return "async" if inspect.iscoroutinefunction(member) else "method"


# --- names --------------------------------------------------------------------------------


def test_the_module_defines_and_exports_every_contract_name() -> None:
    assert set(CONTRACT_NAMES) <= set(contract.__all__)
    for name in CONTRACT_NAMES:
        assert getattr(contract, name) is getattr(nemo_ckpt, name), name


# --- EnvironmentEpisode -------------------------------------------------------------------


def test_episode_is_a_frozen_ordered_dataclass_of_rollout_id_and_attempt() -> None:
    assert dataclasses.is_dataclass(EnvironmentEpisode)
    params_ = EnvironmentEpisode.__dataclass_params__  # type: ignore[attr-defined]
    assert params_.frozen and params_.order
    assert [(f.name, f.type) for f in dataclasses.fields(EnvironmentEpisode)] == [
        ("rollout_id", "str"), ("attempt", "int")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        EnvironmentEpisode("a", 1).attempt = 2  # type: ignore[misc]
    assert len({EnvironmentEpisode("a", 1), EnvironmentEpisode("a", 1)}) == 1


@pytest.mark.parametrize("rollout_id, attempt, message", [
    ("", 0, "rollout_id must not be empty"),
    (7, 0, "rollout_id must not be empty"),
    ("r", -1, "attempt must be non-negative"),
    ("r", True, "attempt must be non-negative"),
    ("r", 1.0, "attempt must be non-negative"),
    ("r", "1", "attempt must be non-negative"),
])
def test_episode_validation_refuses_bad_ids_and_attempts(
        rollout_id: object, attempt: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EnvironmentEpisode(rollout_id, attempt)  # type: ignore[arg-type]


def test_capture_key_and_next_attempt() -> None:
    assert EnvironmentEpisode("roll-7", 0).capture_key == "roll-7"
    assert EnvironmentEpisode("roll-7", 3).capture_key == "roll-7-a3"
    assert EnvironmentEpisode("roll-7", 3).next_attempt() == EnvironmentEpisode("roll-7", 4)
    assert inspect.signature(EnvironmentEpisode.next_attempt).return_annotation \
        == "EnvironmentEpisode"
    assert isinstance(inspect.getattr_static(EnvironmentEpisode, "capture_key"), property)


def test_episodes_order_by_rollout_then_attempt() -> None:
    E = EnvironmentEpisode
    assert sorted([E("b", 0), E("a", 2), E("a", 1)]) == [E("a", 1), E("a", 2), E("b", 0)]


# --- RestoredEnvironmentRollouts ----------------------------------------------------------


def test_restored_rollouts_is_frozen_with_two_empty_frozenset_defaults() -> None:
    R = RestoredEnvironmentRollouts
    assert R.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert [(f.name, f.type) for f in dataclasses.fields(R)] == [
        ("continued_attempts", "frozenset[tuple[str, str, int]]"),
        ("staging_keys", "frozenset[str]")]
    assert R().continued_attempts == frozenset() and R().staging_keys == frozenset()
    with pytest.raises(dataclasses.FrozenInstanceError):
        R().staging_keys = frozenset()  # type: ignore[misc]


# --- the protocols ------------------------------------------------------------------------


@pytest.mark.parametrize("protocol, members", [
    (EnvironmentSnapshot, SNAPSHOT_MEMBERS),
    (EnvironmentCheckpoint, CHECKPOINT_MEMBERS),
])
def test_protocol_members_have_the_contracts_signatures(
        protocol: type, members: dict[str, tuple[str, tuple[str, ...], str]]) -> None:
    for name, (expected_kind, expected_params, returns) in members.items():
        assert kind(protocol, name) == expected_kind, name
        member = inspect.getattr_static(protocol, name)
        fn = member.fget if isinstance(member, property) else member
        signature = inspect.signature(fn)
        assert params(fn) == expected_params, name
        assert signature.return_annotation == returns, name
        for p in expected_params:
            assert signature.parameters[p].annotation == PARAMETER_ANNOTATIONS[p], (name, p)


# --- the implementations ------------------------------------------------------------------


@pytest.mark.parametrize("impl", [NoEnvironmentCheckpoint, nemo_ckpt.RayEnvironmentCheckpoint])
def test_each_checkpoint_implementation_has_every_protocol_member(impl: type) -> None:
    for name, (expected_kind, expected_params, _) in CHECKPOINT_MEMBERS.items():
        assert kind(impl, name) == expected_kind, (impl.__name__, name)
        if expected_kind != "property":
            assert params(getattr(impl, name)) == expected_params, (impl.__name__, name)


def test_the_ray_snapshot_has_every_snapshot_member() -> None:
    for name, (expected_kind, expected_params, _) in SNAPSHOT_MEMBERS.items():
        assert kind(nemo_ckpt.RaySnapshot, name) == expected_kind, name
        if expected_kind != "property":
            assert params(getattr(nemo_ckpt.RaySnapshot, name)) == expected_params, name


async def test_no_environment_checkpoint_behaves_as_the_contract_says(tmp_path: Path) -> None:
    backend = NoEnvironmentCheckpoint()
    assert backend.holds_rollout_state is False
    assert await backend.check_startup() is None
    async with backend.snapshot(tmp_path) as snap:
        assert snap is None
    with pytest.raises(RuntimeError) as err:
        async with backend.restored(tmp_path):
            raise AssertionError("restored() of a backend without state must refuse")
    assert str(tmp_path) in str(err.value), "the refusal names the checkpoint path"
    assert backend.is_unavailable(RuntimeError("x")) is False
